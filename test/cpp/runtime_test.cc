// The Runtime end to end at size 1, without torch: an in-memory control plane, a
// local communicator and malloc'ed memory. Covers what the Python layer cannot
// reach on a machine without GPUs: a CUDA tensor refused when CUDA is unusable.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>

#include "host_memory.h"
#include "in_memory_control_plane.h"
#include "local_communicator.h"
#include "runtime/runtime.h"

namespace hvdz {
namespace {

struct Fixture {
  testing::Hub hub{1};
  std::unique_ptr<Runtime> rt;
  Fixture() {
    Params p;
    rt = std::make_unique<Runtime>(WorldInfo{}, p, std::make_unique<testing::InMemoryControlPlane>(hub, 0),
                                   std::make_unique<testing::LocalCommunicator>(), std::make_unique<testing::MallocAllocator>());
    EXPECT_TRUE(rt->Start().ok());
  }
};

TensorEntry Entry(const std::string& name, std::vector<float>& data, int device = kCpuDevice) {
  TensorEntry e;
  e.request.name = name;
  e.request.device = device;
  e.request.reduce_op = ReduceOp::kSum;
  e.request.postscale = 2.0;
  e.request.shape = {static_cast<int64_t>(data.size())};
  e.input = {data.data(), DataType::kFloat32, e.request.shape, device};
  e.output = e.input;  // in place
  return e;
}

TEST(Runtime, FusedAllreduceRunsEndToEndAndScales) {
  Fixture f;
  std::vector<float> a{1, 2, 3}, b{4, 5};
  std::vector<TensorEntry> entries;
  entries.push_back(Entry("a", a));
  entries.push_back(Entry("b", b));
  std::vector<int64_t> handles;
  ASSERT_TRUE(f.rt->Enqueue(std::move(entries), nullptr, &handles).ok());
  for (auto h : handles) EXPECT_TRUE(f.rt->handles().Wait(h).ok());
  EXPECT_EQ(a, (std::vector<float>{2, 4, 6}));  // sum over one rank, postscale 2
  EXPECT_EQ(b, (std::vector<float>{8, 10}));
  auto stats = f.rt->counters().Snapshot();
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(stats.begin()->second.collectives, 1u);  // fused
  EXPECT_EQ(stats.begin()->second.tensors, 2u);
}

TEST(Runtime, AFinishedHandleKeepsTheEntrysObjectsUntilReleased) {
  Fixture f;
  std::vector<float> a{1, 2};
  std::vector<TensorEntry> entries;
  entries.push_back(Entry("kept", a));
  auto kept = std::make_shared<int>(7);
  std::weak_ptr<int> watch = kept;
  entries[0].keepalive = std::move(kept);
  std::vector<int64_t> handles;
  ASSERT_TRUE(f.rt->Enqueue(std::move(entries), nullptr, &handles).ok());
  ASSERT_TRUE(f.rt->handles().Wait(handles[0]).ok());
  // Done, but the framework's objects wait for the framework thread to take them.
  EXPECT_FALSE(watch.expired());
  std::shared_ptr<void> back = f.rt->handles().Release(handles[0]);
  EXPECT_EQ(*std::static_pointer_cast<int>(back), 7);
  back.reset();
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(f.rt->handles().Release(handles[0]), nullptr);  // already released
}

TEST(Runtime, ACudaTensorIsRefusedWhenCudaIsNotUsable) {
  Fixture f;
  if (f.rt->has_cuda()) GTEST_SKIP() << "this process can use CUDA";
  std::vector<float> a{1};
  std::vector<TensorEntry> entries;
  entries.push_back(Entry("on_gpu", a, /*device=*/0));
  std::vector<int64_t> handles;
  Status s = f.rt->Enqueue(std::move(entries), nullptr, &handles);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("'on_gpu' is on CUDA"), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find("move the tensor to the CPU"), std::string::npos) << s.reason();
  EXPECT_TRUE(handles.empty());
}

// Refused on every machine, before CUDA's availability is asked: host tensors would go to
// Gloo and device tensors to NCCL while the group is negotiated as one.
TEST(Runtime, AGroupOfHostAndDeviceTensorsIsRefused) {
  Fixture f;
  std::vector<float> a{1}, b{2}, c{3};
  std::vector<TensorEntry> entries;
  entries.push_back(Entry("on_host", a));
  entries.push_back(Entry("on_host_too", b));
  entries.push_back(Entry("on_gpu", c, /*device=*/1));
  std::vector<int64_t> handles;
  Status s = f.rt->Enqueue(std::move(entries), nullptr, &handles);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("'on_host' (cpu) and 'on_gpu' (cuda:1)"), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find("Group the tensors of each device separately"), std::string::npos) << s.reason();
  EXPECT_TRUE(handles.empty());
  // Nothing was admitted: the same names go through on the host afterwards.
  std::vector<float> d{1};
  std::vector<TensorEntry> again;
  again.push_back(Entry("on_host", d));
  ASSERT_TRUE(f.rt->Enqueue(std::move(again), nullptr, &handles).ok());
  EXPECT_TRUE(f.rt->handles().Wait(handles[0]).ok());
}

TEST(Runtime, ShutdownFailsWhatIsStillPendingAndRefusesMore) {
  Fixture f;
  f.rt->Shutdown();
  std::vector<float> a{1};
  std::vector<TensorEntry> entries;
  entries.push_back(Entry("late", a));
  std::vector<int64_t> handles;
  Status s = f.rt->Enqueue(std::move(entries), nullptr, &handles);
  EXPECT_EQ(s.type(), StatusType::kAborted);
  EXPECT_NE(s.reason().find("shut down"), std::string::npos) << s.reason();
}

}  // namespace
}  // namespace hvdz
