#include <gtest/gtest.h>

#include "fusion/fusion_plan.h"

namespace hvdz {
namespace {

Response R(const std::string& name, std::vector<int64_t> shape, OpType op = OpType::kAllreduce,
           DataType dt = DataType::kFloat32) {
  Response r;
  r.name = name;
  r.shape = std::move(shape);
  r.op = op;
  r.dtype = r.out_dtype = dt;
  return r;
}

TEST(FusionPlan, FusesCompatibleResponsesUpToTheThreshold) {
  std::vector<Response> rs{R("a", {10}), R("b", {10}, OpType::kAllreduce, DataType::kFloat16), R("c", {10}),
                           R("d", {100}), R("e", {5})};
  // a, c, e fit in 100 bytes (80 bytes); d (400 bytes) goes alone; b is another dtype.
  auto g = PlanFusion(rs, 100);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0], (std::vector<size_t>{0, 2, 4}));
  EXPECT_EQ(g[1], (std::vector<size_t>{1}));
  EXPECT_EQ(g[2], (std::vector<size_t>{3}));
}

TEST(FusionPlan, ZeroThresholdTurnsFusionOffAndErrorsAreLeftOut) {
  std::vector<Response> rs{R("a", {1}), R("b", {1}), R("c", {1})};
  rs[1].error = "bad";
  auto g = PlanFusion(rs, 0);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0], (std::vector<size_t>{0}));
  EXPECT_EQ(g[1], (std::vector<size_t>{2}));
}

TEST(FusionPlan, DifferentScalesOrRootsDoNotFuse) {
  std::vector<Response> rs{R("a", {1}), R("b", {1}), R("c", {1}, OpType::kBroadcast), R("d", {1}, OpType::kBroadcast)};
  rs[1].prescale = 2.0;
  rs[3].root = 1;
  EXPECT_EQ(PlanFusion(rs, 1 << 20).size(), 4u);
}

TEST(FusionPlan, TensorsOnDifferentDevicesDoNotFuse) {
  // Model parallelism: each rank's two GPUs reduce apart.
  std::vector<Response> rs{R("a", {1}), R("b", {1}), R("c", {1})};
  for (auto& r : rs) r.on_cuda = true;
  rs[0].devices = rs[2].devices = {0, 2};
  rs[1].devices = {1, 3};
  auto g = PlanFusion(rs, 100);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0], (std::vector<size_t>{0, 2}));
  EXPECT_EQ(g[1], (std::vector<size_t>{1}));
}

TEST(FusionPlan, UnevenScatterGivesTheFirstRanksAnExtraRow) {
  EXPECT_EQ(ScatterRows(5, 3, 0), 2);
  EXPECT_EQ(ScatterRows(5, 3, 1), 2);
  EXPECT_EQ(ScatterRows(5, 3, 2), 1);
  EXPECT_EQ(ScatterFirstRow(5, 3, 2), 4);
  EXPECT_EQ(ScatterRows(2, 4, 3), 0);
}

TEST(FusionLayout, AllgatherIsRankMajorWithAlignedPaddedSegments) {
  Response a = R("a", {0, 2}, OpType::kAllgather), b = R("b", {0, 3}, OpType::kAllgather);
  a.first_dims = {3, 1, 2};
  b.first_dims = {1, 1, 1};
  FusionLayout L = ComputeLayout({&a, &b}, 3);
  // Counts per rank: a = rows * 2, b = 3. Offsets align to 16 floats (64 bytes).
  EXPECT_EQ(L.count[0], (std::vector<int64_t>{6, 2, 4}));
  EXPECT_EQ(L.offset[1], (std::vector<int64_t>{16, 16, 16}));
  EXPECT_EQ(L.segment_elems, 32);
  EXPECT_EQ(L.total_elems, 96);
}

TEST(FusionLayout, ReducescatterSegmentsHoldEachRanksRows) {
  Response a = R("a", {5, 4}, OpType::kReducescatter, DataType::kBFloat16);
  FusionLayout L = ComputeLayout({&a}, 2);
  EXPECT_EQ(L.count[0], (std::vector<int64_t>{12, 8}));
  EXPECT_EQ(L.segment_elems, 32);  // 12 rounded up to 32 bf16 (64 bytes)
}

TEST(FusionLayout, AllreduceTensorsFollowOneAnother) {
  Response a = R("a", {3}), b = R("b", {17});
  FusionLayout L = ComputeLayout({&a, &b}, 4);
  EXPECT_EQ(L.offset[0][0], 0);
  EXPECT_EQ(L.offset[1][0], 16);
  EXPECT_EQ(L.total_elems, 48);
}

}  // namespace
}  // namespace hvdz
