#include <gtest/gtest.h>

#include "negotiation/response_cache.h"

namespace hvdz {
namespace {

Response Resp(const std::string& name, std::vector<int64_t> shape) {
  Response r;
  r.name = name;
  r.shape = std::move(shape);
  return r;
}

Request Req(const std::string& name, std::vector<int64_t> shape) {
  Request q;
  q.name = name;
  q.shape = std::move(shape);
  return q;
}

TEST(ResponseCache, HitMissAndInvalid) {
  ResponseCache c(4);
  std::vector<uint32_t> ev;
  c.Put(Resp("a", {3}), &ev);
  uint32_t pos = 99;
  EXPECT_EQ(c.Find(Req("a", {3}), &pos), ResponseCache::Lookup::kHit);
  EXPECT_EQ(pos, 0u);
  EXPECT_EQ(c.Find(Req("a", {4}), &pos), ResponseCache::Lookup::kInvalid);
  EXPECT_EQ(c.Find(Req("b", {3}), &pos), ResponseCache::Lookup::kMiss);
}

TEST(ResponseCache, EvictsLeastRecentlyUsedAndReusesItsSlot) {
  ResponseCache c(2);
  std::vector<uint32_t> ev;
  c.Put(Resp("a", {1}), &ev);
  c.Put(Resp("b", {1}), &ev);
  c.Touch(0);  // a is now the most recent
  c.Put(Resp("c", {1}), &ev);
  ASSERT_EQ(ev, (std::vector<uint32_t>{1}));  // b went
  uint32_t pos;
  EXPECT_EQ(c.Find(Req("c", {1}), &pos), ResponseCache::Lookup::kHit);
  EXPECT_EQ(pos, 1u);
  EXPECT_EQ(c.Find(Req("b", {1}), &pos), ResponseCache::Lookup::kMiss);
  EXPECT_EQ(c.num_entries(), 2u);
}

TEST(ResponseCache, ErrorsAndZeroCapacityAreNeverCached) {
  ResponseCache c(2), none(0);
  std::vector<uint32_t> ev;
  Response e = Resp("e", {1});
  e.error = "boom";
  c.Put(e, &ev);
  none.Put(Resp("a", {1}), &ev);
  EXPECT_EQ(c.num_entries(), 0u);
  EXPECT_EQ(none.num_entries(), 0u);
}

TEST(ResponseCache, AllgatherHitNeedsThisRanksDimZero) {
  ResponseCache c(2);
  std::vector<uint32_t> ev;
  Response g = Resp("g", {2, 5});
  g.op = OpType::kAllgather;
  g.first_dims = {2, 7};
  c.Put(g, &ev);
  Request q = Req("g", {7, 5});
  q.op = OpType::kAllgather;
  q.rank = 1;
  uint32_t pos;
  EXPECT_EQ(c.Find(q, &pos), ResponseCache::Lookup::kHit);
  q.shape = {2, 5};  // rank 1 with rank 0's rows: not what was negotiated
  EXPECT_EQ(c.Find(q, &pos), ResponseCache::Lookup::kInvalid);
}

}  // namespace
}  // namespace hvdz
