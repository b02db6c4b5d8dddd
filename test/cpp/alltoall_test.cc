// Alltoall: negotiation of every rank's splits (the response's matrix, agreement
// on the shape past dim 0, bad splits, the cache while splits stay or change), the
// wire format, and the executor over ThreadCommunicator with uneven and empty parts.
#include <gtest/gtest.h>

#include <numeric>

#include "host_memory.h"
#include "negotiation_harness.h"
#include "ops/executor.h"
#include "thread_communicator.h"

namespace hvdz {
namespace {

using testing::ExpectIdentical;
using testing::Find;
using testing::RunRanks;

// splits[q][r]: rows rank q sends to rank r; 3 ranks, uneven, with empty parts
// (rank 1 sends nothing to rank 0, rank 2 sends nothing at all).
const std::vector<std::vector<int64_t>> kSplits = {{1, 2, 0}, {0, 3, 1}, {0, 0, 0}};

Request A2A(const std::string& name, int rank, const std::vector<std::vector<int64_t>>& splits, int64_t row = 2) {
  const auto& s = splits[rank];
  Request q = testing::Req(name, {std::accumulate(s.begin(), s.end(), int64_t{0}), row}, OpType::kAlltoall);
  q.splits = s;
  return q;
}

TEST(AlltoallNegotiation, TheResponseCarriesEveryRanksSplits) {
  Params p;
  auto t = RunRanks(3, p, 1, [](int rank, int) { return std::vector<Request>{A2A("m", rank, kSplits)}; });
  ExpectIdentical(t);
  for (const auto& tr : t) {
    const Response* r = Find(tr, "m");
    ASSERT_NE(r, nullptr);
    ASSERT_TRUE(r->ok()) << r->error;
    EXPECT_EQ(r->first_dims, (std::vector<int64_t>{3, 4, 0}));
    EXPECT_EQ(r->splits, (std::vector<int64_t>{1, 2, 0, 0, 3, 1, 0, 0, 0}));
  }
}

TEST(AlltoallNegotiation, ShapesPastDimZeroMustAgreeAndSplitsMustFit) {
  Params p;
  auto t = RunRanks(2, p, 1, [](int rank, int) {
    const std::vector<std::vector<int64_t>> two = {{1, 1}, {2, 0}};
    Request shape = A2A("shape", rank, two, rank == 0 ? 2 : 3);
    Request bad = A2A("bad", rank, two);
    if (rank == 1) bad.splits = {1, 0};  // sums to 1, dim 0 is 2
    return std::vector<Request>{shape, bad};
  });
  for (const auto& tr : t) {
    const Response* shape = Find(tr, "shape");
    ASSERT_NE(shape, nullptr);
    EXPECT_NE(shape->error.find("shape past dim 0"), std::string::npos) << shape->error;
    EXPECT_NE(shape->error.find("[2]"), std::string::npos) << shape->error;
    EXPECT_NE(shape->error.find("[3]"), std::string::npos) << shape->error;
    const Response* bad = Find(tr, "bad");
    ASSERT_NE(bad, nullptr);
    EXPECT_NE(bad->error.find("rank 1"), std::string::npos) << bad->error;
    EXPECT_NE(bad->error.find("[1, 0]"), std::string::npos) << bad->error;
  }
}

TEST(AlltoallNegotiation, SameSplitsHitTheCacheAndNewSplitsAreNegotiatedAgain) {
  Params p;
  const std::vector<std::vector<int64_t>> changed = {{1, 2, 0}, {2, 2, 0}, {0, 0, 0}};
  auto t = RunRanks(3, p, 6, [&](int rank, int cycle) {
    if (cycle == 0 || cycle == 2) return std::vector<Request>{A2A("m", rank, kSplits)};
    if (cycle == 4) return std::vector<Request>{A2A("m", rank, changed)};
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (const auto& tr : t) {
    ASSERT_EQ(tr.cycles[2].size(), 1u);
    EXPECT_FALSE(tr.slow[2]) << "unchanged splits: a cache hit";
    ASSERT_EQ(tr.cycles[4].size(), 1u);
    EXPECT_TRUE(tr.slow[4]);
    ASSERT_TRUE(tr.cycles[4][0].ok()) << tr.cycles[4][0].error;
    EXPECT_EQ(tr.cycles[4][0].splits, (std::vector<int64_t>{1, 2, 0, 2, 2, 0, 0, 0, 0}));
  }
}

TEST(AlltoallNegotiation, SplitsSurviveTheWireFormat) {
  Request q = A2A("w", 1, kSplits);
  std::vector<uint8_t> bytes;
  SerializeRequests({q}, &bytes);
  std::vector<Request> back;
  ASSERT_TRUE(ParseRequests(bytes.data(), bytes.size(), &back));
  EXPECT_EQ(back[0].splits, q.splits);
  Response r;
  r.name = "w";
  r.splits = {1, 2, 3, 4};
  SerializeResponses({r}, &bytes);
  std::vector<Response> rb;
  ASSERT_TRUE(ParseResponses(bytes.data(), bytes.size(), &rb));
  EXPECT_EQ(rb[0].splits, r.splits);
}

// Rank q's row j holds 100 q + j in every column: each received row says where it came from.
TEST(AlltoallExecutor, UnevenAndEmptyPartsLandRankByRank) {
  const int size = 3;
  const int64_t row = 2;
  testing::CollectiveHub hub(size);
  testing::Spawn(size, [&](int rank) {
    testing::ThreadCommunicator comm(hub, rank, /*groups=*/true);
    testing::MallocAllocator alloc;
    CpuContext cpu(comm, alloc, int64_t{1} << 20);
    testing::RecordingContext ctx(cpu);
    Timeline timeline;
    Counters counters;
    Executor exec(rank, size, -1, timeline, counters);

    Response r;
    r.name = "a2a";
    r.op = OpType::kAlltoall;
    r.dtype = r.out_dtype = DataType::kInt64;
    r.shape = {3, row};
    for (int q = 0; q < size; ++q) {
      r.first_dims.push_back(std::accumulate(kSplits[q].begin(), kSplits[q].end(), int64_t{0}));
      r.splits.insert(r.splits.end(), kSplits[q].begin(), kSplits[q].end());
    }
    std::vector<int64_t> in(r.first_dims[rank] * row), out;
    for (size_t i = 0; i < in.size(); ++i) in[i] = 100 * rank + static_cast<int64_t>(i) / row;
    TensorEntry e;
    e.request.name = "a2a";
    e.input = {in.data(), DataType::kInt64, {r.first_dims[rank], row}, kCpuDevice};
    std::vector<int64_t> received, out_shape;
    e.received_splits = [&](const std::vector<int64_t>& s) { received = s; };
    e.allocate_output = [&](const std::vector<int64_t>& shape, void*, TensorDesc* o) {
      out_shape = shape;
      out.assign(NumElements(shape), -1);
      *o = {out.data(), DataType::kInt64, shape, kCpuDevice};
      return Status::OK();
    };
    Status done = Status::Error("never reported");
    e.callback = [&](const Status& s, std::shared_ptr<void>) { done = s; };
    std::vector<TensorEntry> entries;
    entries.push_back(std::move(e));
    exec.Execute(ctx, {&r}, std::move(entries));

    ASSERT_TRUE(done.ok()) << done.reason();
    std::vector<int64_t> want_splits, want;
    for (int q = 0; q < size; ++q) {
      want_splits.push_back(kSplits[q][rank]);
      int64_t first = 0;
      for (int k = 0; k < rank; ++k) first += kSplits[q][k];
      for (int64_t j = 0; j < kSplits[q][rank]; ++j)
        for (int64_t c = 0; c < row; ++c) want.push_back(100 * q + first + j);
    }
    EXPECT_EQ(received, want_splits) << "rank " << rank;
    EXPECT_EQ(out_shape, (std::vector<int64_t>{static_cast<int64_t>(want.size()) / row, row}));
    EXPECT_EQ(out, want) << "rank " << rank;
    EXPECT_TRUE(ctx.copies.empty()) << "straight from input to output";
    EXPECT_TRUE(ctx.buffers.empty());
    ASSERT_EQ(comm.launches().size(), 1u);
    EXPECT_FALSE(comm.launches()[0].grouped);
    auto stats = counters.Snapshot();
    ASSERT_EQ(stats.size(), 1u);
    EXPECT_EQ(std::get<1>(stats.begin()->first), OpType::kAlltoall);
    EXPECT_EQ(stats.begin()->second.bytes, 7u * row * 8) << "every rank's rows";
  });
}

}  // namespace
}  // namespace hvdz
