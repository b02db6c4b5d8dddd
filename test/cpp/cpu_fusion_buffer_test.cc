// The CPU fusion buffer grows only to what the ops asked for, is freed after an op
// that needed more than the context keeps, and is freed when the runtime goes idle.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "host_memory.h"
#include "in_memory_control_plane.h"
#include "local_communicator.h"
#include "runtime/runtime.h"
#include "thread_communicator.h"

namespace hvdz {
namespace {

TEST(CpuFusionBuffer, GrowsToTheLargestRequestOnlyAndIsFreedOnRelease) {
  testing::CollectiveHub hub(1);
  testing::ThreadCommunicator comm(hub, 0, /*groups=*/false);
  testing::MallocAllocator alloc;
  CpuContext ctx(comm, alloc, /*keep_buffer_bytes=*/1 << 20);
  void* p = nullptr;
  EXPECT_EQ(ctx.buffer_bytes(), 0);
  ASSERT_TRUE(ctx.FusionBuffer(1000, &p).ok());
  EXPECT_EQ(ctx.buffer_bytes(), 1000);
  void* q = nullptr;
  ASSERT_TRUE(ctx.FusionBuffer(600, &q).ok());  // fits: the same buffer
  EXPECT_EQ(q, p);
  EXPECT_EQ(ctx.buffer_bytes(), 1000);
  ASSERT_TRUE(ctx.FusionBuffer(5000, &q).ok());  // grows to exactly what is asked
  EXPECT_EQ(ctx.buffer_bytes(), 5000);
  ctx.Finish({}, Status::OK());  // within what it keeps
  EXPECT_EQ(ctx.buffer_bytes(), 5000);
  ctx.Release();
  EXPECT_EQ(ctx.buffer_bytes(), 0);
  ASSERT_TRUE(ctx.FusionBuffer((1 << 20) + 1, &q).ok());
  ctx.Finish({}, Status::OK());  // more than it keeps: freed after the op
  EXPECT_EQ(ctx.buffer_bytes(), 0);
}

// Allreduces `tensors` (floats, in place) as one group and waits for them.
void Allreduce(Runtime& rt, std::vector<std::vector<float>>& tensors, const std::string& prefix) {
  std::vector<TensorEntry> entries;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorEntry e;
    e.request.name = prefix + std::to_string(i);
    e.request.shape = {static_cast<int64_t>(tensors[i].size())};
    e.input = {tensors[i].data(), DataType::kFloat32, e.request.shape, kCpuDevice};
    e.output = e.input;
    entries.push_back(std::move(e));
  }
  std::vector<int64_t> handles;
  ASSERT_TRUE(rt.Enqueue(std::move(entries), nullptr, &handles).ok());
  for (auto h : handles) ASSERT_TRUE(rt.handles().Wait(h).ok());
}

TEST(CpuFusionBuffer, TheRuntimeHoldsWhatItsOpsNeededUntilItGoesIdle) {
  testing::Hub hub(1);
  Params p;  // 128 MiB fusion threshold: the old buffer was kept up to twice that
  Runtime rt(WorldInfo{}, p, std::make_unique<testing::InMemoryControlPlane>(hub, 0),
             std::make_unique<testing::LocalCommunicator>(), std::make_unique<testing::MallocAllocator>());
  ASSERT_TRUE(rt.Start().ok());
  std::vector<std::vector<float>> small(3, std::vector<float>(100, 1.0f));
  Allreduce(rt, small, "small.");
  // Three tensors of 400 bytes (a later idle cycle may already have freed it).
  constexpr int64_t kSmallGroup = 3 * 448;  // at most: each at a 64-byte aligned offset
  EXPECT_LE(rt.cpu_fusion_buffer_bytes(), kSmallGroup);
  // Two of 4 MiB: exactly their bytes (the old buffer was freed before this one).
  std::vector<std::vector<float>> large(2, std::vector<float>(1 << 20, 1.0f));
  Allreduce(rt, large, "large.");
  const int64_t held = rt.cpu_fusion_buffer_bytes();
  EXPECT_TRUE(held == 8 << 20 || held == 0) << held;
  // Idle for ~255 ms (doubling from 1 ms to 250 ms): the buffer goes.
  Allreduce(rt, small, "again.");
  for (int i = 0; i < 100 && rt.cpu_fusion_buffer_bytes() != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(rt.cpu_fusion_buffer_bytes(), 0);
  rt.Shutdown();
}

}  // namespace
}  // namespace hvdz
