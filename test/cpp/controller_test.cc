// Negotiation with ranks as threads: agreement, disagreement, the response cache
// (hit, miss, eviction, invalidation) and stalls.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "negotiation_harness.h"

namespace hvdz {
namespace {

using testing::ExpectIdentical;
using testing::Find;
using testing::Hub;
using testing::InMemoryControlPlane;
using testing::Names;
using testing::Req;
using testing::RunRanks;
using testing::Spawn;

TEST(Controller, AgreeingRanksGetIdenticalResponsesInTheSameOrder) {
  Params p;
  auto t = RunRanks(3, p, 2, [](int rank, int cycle) {
    std::vector<Request> rs{Req("a", {3}), Req("b", {2, 2}), Req("c", {1})};
    std::rotate(rs.begin(), rs.begin() + rank, rs.end());  // each rank submits in another order
    return cycle == 0 ? rs : std::vector<Request>{};
  });
  ExpectIdentical(t);
  EXPECT_EQ(t[0].cycles[0].size(), 3u);
  for (const auto& r : t[0].cycles[0]) EXPECT_TRUE(r.ok()) << r.error;
  EXPECT_TRUE(t[0].slow[0]);
  EXPECT_FALSE(t[0].slow[1]);  // nothing new: no slow path
}

TEST(Controller, RepeatedTensorsAreServedFromTheCache) {
  Params p;
  auto t = RunRanks(2, p, 4, [](int, int cycle) {
    return cycle == 0 || cycle == 2 ? std::vector<Request>{Req("a", {3}), Req("b", {4})} : std::vector<Request>{};
  });
  ExpectIdentical(t);
  EXPECT_TRUE(t[0].slow[0]);
  EXPECT_EQ(t[0].cycles[2].size(), 2u);
  EXPECT_FALSE(t[0].slow[2]) << "a cache hit must not take the slow path";
  EXPECT_EQ(t[0].cycles[2][0].shape, (std::vector<int64_t>{3}));
}

TEST(Controller, MismatchedShapeIsAnErrorNamingTheTensorAndBothValues) {
  Params p;
  auto t = RunRanks(2, p, 1, [](int rank, int) { return std::vector<Request>{Req("w0", {rank == 0 ? 3 : 4})}; });
  for (const auto& tr : t) {
    ASSERT_EQ(tr.cycles[0].size(), 1u);
    const auto& e = tr.cycles[0][0].error;
    EXPECT_NE(e.find("'w0'"), std::string::npos) << e;
    EXPECT_NE(e.find("[3]"), std::string::npos) << e;
    EXPECT_NE(e.find("[4]"), std::string::npos) << e;
  }
}

TEST(Controller, MismatchedDtypeAndRootAreErrors) {
  Params p;
  auto t = RunRanks(2, p, 1, [](int rank, int) {
    auto a = Req("d", {2}, OpType::kAllreduce, rank ? DataType::kFloat16 : DataType::kFloat32);
    auto b = Req("r", {2}, OpType::kBroadcast);
    b.root = rank;
    return std::vector<Request>{a, b};
  });
  EXPECT_NE(Find(t[1], "d")->error.find("float16"), std::string::npos);
  EXPECT_NE(Find(t[1], "r")->error.find("root rank"), std::string::npos);
}

TEST(Controller, AllgatherMayDifferInDimZeroOnly) {
  Params p;
  auto t = RunRanks(3, p, 1, [](int rank, int) {
    return std::vector<Request>{Req("g", {rank + 1, 2}, OpType::kAllgather)};
  });
  const Response* r = Find(t[2], "g");
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE(r->ok()) << r->error;
  EXPECT_EQ(r->first_dims, (std::vector<int64_t>{1, 2, 3}));
}

TEST(Controller, ATensorIsReadyOnlyOnceEveryRankSubmittedIt) {
  Params p;
  auto t = RunRanks(2, p, 7, [](int rank, int cycle) {
    // First round through the slow path, second through the cache.
    bool submit = (rank == 0 && (cycle == 0 || cycle == 3)) || (rank == 1 && (cycle == 2 || cycle == 5));
    return submit ? std::vector<Request>{Req("x", {8})} : std::vector<Request>{};
  });
  ExpectIdentical(t);
  std::vector<int> seen;
  for (int k = 0; k < 7; ++k)
    if (!t[0].cycles[k].empty()) seen.push_back(k);
  EXPECT_EQ(seen, (std::vector<int>{2, 5}));
  EXPECT_FALSE(t[0].slow[5]);
}

// [Note: arrivals]: rank 0 reports each rank's submission once, in the cycle it first
// sees it, on the slow path and from the cache's bits alike; the others report none.
TEST(Controller, RankZeroReportsWhenEachRankSubmitted) {
  Params p;
  auto t = RunRanks(3, p, 8, [](int rank, int cycle) {
    // Round one (slow path): rank 2 at cycle 0, rank 0 at 1, rank 1 at 3. Round two
    // (cached): ranks 0 and 1 at 4, rank 2 at 6.
    const int first[3] = {1, 3, 0}, second[3] = {4, 4, 6};
    bool submit = cycle == first[rank] || cycle == second[rank];
    return submit ? std::vector<Request>{Req("x", {8})} : std::vector<Request>{};
  }, 0, /*track_arrivals=*/true);
  ExpectIdentical(t);
  std::vector<std::vector<int>> ranks(8);
  for (int k = 0; k < 8; ++k)
    for (const auto& a : t[0].results[k].arrivals) {
      EXPECT_EQ(a.name, "x");
      ranks[k].push_back(a.rank);
    }
  EXPECT_EQ(ranks, (std::vector<std::vector<int>>{{2}, {0}, {}, {1}, {0, 1}, {}, {2}, {}}));
  int cycle = -1;
  ASSERT_NE(Find(t[0], "x", &cycle), nullptr);
  EXPECT_EQ(cycle, 3);
  EXPECT_FALSE(t[0].slow[6]);  // the second round came from the cache's bits
  for (int r = 1; r < 3; ++r)
    for (const auto& res : t[r].results) EXPECT_TRUE(res.arrivals.empty()) << "rank " << r;
}

// A pending hit whose cache entry another tensor evicts goes to the coordinator again:
// still one arrival per rank and round. Tracking turned on mid-run reports nothing pending.
TEST(Controller, ArrivalsSurviveEvictionAndStartFromWhatIsPending) {
  Params p;
  p.cache_capacity = 1;
  auto t = RunRanks(2, p, 4, [](int rank, int cycle) {
    std::vector<Request> reqs;
    // Cycle 0: both "a" (cached). Cycle 1: rank 0 "a" (a hit, waiting) and both "b", whose
    // entry evicts "a": rank 0's request goes to the coordinator in cycle 2. Cycle 3: rank 1's "a".
    if (cycle == 0 || (cycle == 1 && rank == 0) || (cycle == 3 && rank == 1)) reqs.push_back(Req("a", {4}));
    if (cycle == 1) reqs.push_back(Req("b", {4}));
    return reqs;
  }, 0, /*track_arrivals=*/true);
  ExpectIdentical(t);
  std::vector<std::vector<std::pair<int, std::string>>> got(4);
  for (int k = 0; k < 4; ++k)
    for (const auto& a : t[0].results[k].arrivals) got[k].push_back({a.rank, a.name});
  using V = std::vector<std::pair<int, std::string>>;
  EXPECT_EQ(got, (std::vector<V>{{{0, "a"}, {1, "a"}}, {{0, "a"}, {0, "b"}, {1, "b"}}, {}, {{1, "a"}}}));
  int cycle = -1;
  ASSERT_NE(Find(t[0], "b", &cycle), nullptr);
  EXPECT_EQ(cycle, 1);

  // Rank 1 submits "c" before rank 0's tracking starts, rank 0 after: only rank 0's is new.
  Hub hub(2);
  std::vector<std::vector<Arrival>> first(2), late(2);
  Spawn(2, [&](int rank) {
    InMemoryControlPlane cp(hub, rank);
    Logger log(LogLevel::kFatal, rank);
    Controller c(cp, p, log);
    for (int k = 0; k < 4; ++k) {
      std::vector<Request> reqs;
      if (k == 0) reqs.push_back(Req("c", {2}));               // cached
      if (k == 1 && rank == 1) reqs.push_back(Req("c", {2}));  // pending, not tracked yet
      if (k == 3 && rank == 0) reqs.push_back(Req("c", {2}));
      for (auto& r : reqs) r.rank = rank;
      c.TrackArrivals(k >= 2);
      CycleResult res;
      EXPECT_TRUE(c.RunCycle(reqs, false, &res).ok());
      if (k == 2) first[rank] = res.arrivals;
      if (k == 3) late[rank] = res.arrivals;
    }
  });
  EXPECT_TRUE(first[0].empty());  // the first cycle tracked learns rank 1's pending "c"
  ASSERT_EQ(late[0].size(), 1u);
  EXPECT_EQ(late[0][0].rank, 0);
  EXPECT_EQ(late[0][0].name, "c");
  EXPECT_TRUE(late[1].empty());
}

TEST(Controller, EvictionKeepsEveryRanksCacheInStep) {
  Params p;
  p.cache_capacity = 2;
  const char* order[] = {"a", "b", "c", "a", "c", "b"};
  auto t = RunRanks(3, p, 6, [&](int, int cycle) { return std::vector<Request>{Req(order[cycle], {4})}; });
  ExpectIdentical(t);
  // a, b, c are new; a was evicted by c, so it is new again; c is still cached;
  // b was evicted by a's return.
  std::vector<bool> expect_slow{true, true, true, true, false, true};
  EXPECT_EQ(t[0].slow, expect_slow);
  for (const auto& tr : t) EXPECT_EQ(tr.cache_entries, 2u);
}

TEST(Controller, ShapeChangedOnEveryRankReplacesTheCachedResponse) {
  Params p;
  auto t = RunRanks(2, p, 6, [](int, int cycle) {
    if (cycle == 0) return std::vector<Request>{Req("x", {3})};
    if (cycle == 2) return std::vector<Request>{Req("x", {5})};
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  int last = -1;
  const Response* r = nullptr;
  for (size_t k = 1; k < t[0].cycles.size(); ++k)
    for (const auto& x : t[0].cycles[k]) {
      r = &x;
      last = static_cast<int>(k);
    }
  ASSERT_NE(r, nullptr);
  EXPECT_GE(last, 2);
  EXPECT_TRUE(r->ok()) << r->error;
  EXPECT_EQ(r->shape, (std::vector<int64_t>{5}));
}

TEST(Controller, ShapeChangedOnOneRankIsAMismatchEvenWhenCached) {
  Params p;
  auto t = RunRanks(2, p, 6, [](int rank, int cycle) {
    if (cycle == 0) return std::vector<Request>{Req("x", {3})};
    if (cycle == 2) return std::vector<Request>{Req("x", {rank == 0 ? 3 : 4})};
    return std::vector<Request>{};
  });
  for (const auto& tr : t) {
    const Response* err = nullptr;
    for (size_t k = 1; k < tr.cycles.size(); ++k)
      for (const auto& x : tr.cycles[k])
        if (!x.ok()) err = &x;
    ASSERT_NE(err, nullptr);
    EXPECT_NE(err->error.find("[3]"), std::string::npos) << err->error;
    EXPECT_NE(err->error.find("[4]"), std::string::npos) << err->error;
  }
}

TEST(Controller, StalledTensorFailsNamingTheMissingRanks) {
  Params p;
  p.stall_check_seconds = 0.01;
  p.stall_shutdown_seconds = 0.05;
  auto t = RunRanks(3, p, 20, [](int rank, int cycle) {
    return cycle == 0 && rank != 1 ? std::vector<Request>{Req("lonely", {2})} : std::vector<Request>{};
  }, 10);
  ExpectIdentical(t);
  const Response* r = Find(t[0], "lonely");
  ASSERT_NE(r, nullptr);
  EXPECT_FALSE(r->ok());
  EXPECT_NE(r->error.find("not by ranks [1]"), std::string::npos) << r->error;
  EXPECT_NE(r->error.find("ranks [0, 2]"), std::string::npos) << r->error;
}

TEST(Controller, StalledCachedTensorFailsToo) {
  Params p;
  p.stall_check_seconds = 0.01;
  p.stall_shutdown_seconds = 0.05;
  auto t = RunRanks(2, p, 20, [](int rank, int cycle) {
    bool submit = cycle == 0 || (cycle == 2 && rank == 0);
    return submit ? std::vector<Request>{Req("y", {2})} : std::vector<Request>{};
  }, 10);
  ExpectIdentical(t);
  int errors = 0;
  for (size_t k = 1; k < t[0].cycles.size(); ++k)
    for (const auto& x : t[0].cycles[k])
      if (!x.ok()) {
        ++errors;
        EXPECT_NE(x.error.find("not by ranks [1]"), std::string::npos) << x.error;
      }
  EXPECT_EQ(errors, 1);
}

TEST(Controller, WithoutACacheEveryNewTensorTakesTheSlowPath) {
  Params p;
  p.cache_capacity = 0;
  auto t = RunRanks(2, p, 3, [](int, int cycle) {
    return cycle != 1 ? std::vector<Request>{Req("a", {2})} : std::vector<Request>{};
  });
  EXPECT_EQ(t[0].slow, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(Names(t[0].cycles[2]), (std::vector<std::string>{"a"}));
}

TEST(Controller, ShutdownRequestedByAnyRankReachesAll) {
  Params p;
  Hub hub(3);
  std::vector<int> stopped(3, 0);
  std::vector<std::vector<int>> who(3);
  Spawn(3, [&](int rank) {
    InMemoryControlPlane cp(hub, rank);
    Logger log(LogLevel::kFatal, rank);
    Controller c(cp, p, log);
    CycleResult res;
    EXPECT_TRUE(c.RunCycle({}, rank == 2, &res).ok());
    stopped[rank] = res.shutdown;
    who[rank] = res.shutdown_ranks;
  });
  EXPECT_EQ(stopped, (std::vector<int>{1, 1, 1}));
  for (const auto& w : who) EXPECT_EQ(w, (std::vector<int>{2})) << "every rank learns which rank left";
}

}  // namespace
}  // namespace hvdz
