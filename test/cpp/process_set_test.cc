// Process sets in whole runtimes, ranks as threads: an in-memory control plane and
// a thread communicator per set (test/cpp/in_memory_control_plane.*,
// thread_communicator.*). See [Note: process sets] in runtime/process_set.h.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "host_memory.h"
#include "in_memory_control_plane.h"
#include "runtime/runtime.h"
#include "thread_communicator.h"

namespace hvdz {
namespace {

using testing::CollectiveHub;
using testing::Hub;
using testing::InMemoryControlPlane;
using testing::ThreadCommunicator;

// The transports of one set (or of the whole job): where its ranks meet.
struct SetHubs {
  explicit SetHubs(std::vector<int> r) : ranks(std::move(r)), control(ranks.size()), data(ranks.size()) {}
  std::vector<int> ranks;
  Hub control;
  CollectiveHub data;
};

class Job {
 public:
  explicit Job(int size, Params p = Params()) : everyone_(Iota(size)) {
    for (int r = 0; r < size; ++r) {
      rt_.push_back(std::make_unique<Runtime>(WorldInfo{r, size, r, size, 0, 1}, p,
                                              std::make_unique<InMemoryControlPlane>(everyone_.control, r),
                                              std::make_unique<ThreadCommunicator>(everyone_.data, r, false),
                                              std::make_unique<testing::MallocAllocator>()));
      EXPECT_TRUE(rt_.back()->Start().ok());
    }
  }
  // The first rank's request to stop reaches every rank in the same global cycle.
  ~Job() {
    for (auto& rt : rt_) rt->Shutdown();
  }

  Runtime& rank(int r) { return *rt_[r]; }
  int size() const { return static_cast<int>(rt_.size()); }

  // Adds set `id` on every rank, as hvd.add_process_set() does, and waits for it.
  void Add(int32_t id, std::vector<int> ranks) {
    sets_.push_back(std::make_unique<SetHubs>(ranks));
    SetHubs& h = *sets_.back();
    std::vector<int64_t> handles;
    for (int r = 0; r < size(); ++r) {
      std::unique_ptr<ControlPlane> control;
      std::unique_ptr<Communicator> comm;
      for (size_t k = 0; k < ranks.size(); ++k) {
        if (ranks[k] != r) continue;
        control = std::make_unique<InMemoryControlPlane>(h.control, static_cast<int>(k));
        comm = std::make_unique<ThreadCommunicator>(h.data, static_cast<int>(k), false);
      }
      int64_t handle = 0;
      ASSERT_TRUE(rank(r).AddProcessSet(id, ranks, std::move(control), std::move(comm), Carrier(), nullptr, &handle).ok());
      handles.push_back(handle);
    }
    for (int r = 0; r < size(); ++r) ASSERT_TRUE(rank(r).handles().Wait(handles[r]).ok());
  }

  void Remove(int32_t id) {
    std::vector<int64_t> handles(size());
    for (int r = 0; r < size(); ++r) ASSERT_TRUE(rank(r).RemoveProcessSet(id, Carrier(), nullptr, &handles[r]).ok());
    for (int r = 0; r < size(); ++r) ASSERT_TRUE(rank(r).handles().Wait(handles[r]).ok());
  }

 private:
  static std::vector<int> Iota(int n) {
    std::vector<int> v(n);
    for (int i = 0; i < n; ++i) v[i] = i;
    return v;
  }
  TensorDesc Carrier() {
    carriers_.push_back(std::make_unique<int32_t>(0));
    return TensorDesc{carriers_.back().get(), DataType::kInt32, {1}, kCpuDevice};
  }

  SetHubs everyone_;
  std::vector<std::unique_ptr<SetHubs>> sets_;
  std::vector<std::unique_ptr<int32_t>> carriers_;
  std::vector<std::unique_ptr<Runtime>> rt_;  // last: they go first, before the hubs they use
};

TensorEntry Entry(const std::string& name, int32_t set, std::vector<float>& data, OpType op = OpType::kAllreduce,
                  int root = 0) {
  TensorEntry e;
  e.request.name = name;
  e.request.process_set = set;
  e.request.op = op;
  e.request.root = root;
  e.request.reduce_op = ReduceOp::kSum;
  e.request.shape = {static_cast<int64_t>(data.size())};
  e.input = {data.data(), DataType::kFloat32, e.request.shape, kCpuDevice};
  e.output = e.input;  // in place
  return e;
}

Status Submit(Runtime& rt, TensorEntry e, int64_t* handle) {
  std::vector<TensorEntry> entries;
  entries.push_back(std::move(e));
  std::vector<int64_t> hs;
  HVDZ_RETURN_IF_ERROR(rt.Enqueue(std::move(entries), nullptr, &hs));
  *handle = hs[0];
  return Status::OK();
}

// Sets {0, 1} and {1, 2} share rank 1, which submits in the order the others do
// not expect (B first); every set also has a tensor named "x", as the global set does.
TEST(ProcessSets, OverlappingSetsRunTogetherAndScopeNames) {
  Job job(3);
  job.Add(1, {0, 1});
  job.Add(2, {1, 2});
  std::vector<std::vector<float>> a(3), b(3), g(3);
  std::vector<std::vector<int64_t>> hs(3);
  for (int r = 0; r < 3; ++r) {
    a[r] = {float(r + 1), 10};
    b[r] = {float(100 * (r + 1))};
    g[r] = {1, 2, 3};
  }
  auto submit = [&](int r, int32_t set, std::vector<float>& data) {
    int64_t h = 0;
    ASSERT_TRUE(Submit(job.rank(r), Entry("x", set, data), &h).ok());
    hs[r].push_back(h);
  };
  submit(1, 2, b[1]);
  submit(1, 1, a[1]);
  submit(0, 1, a[0]);
  submit(2, 2, b[2]);
  for (int r = 0; r < 3; ++r) submit(r, 0, g[r]);
  for (int r = 0; r < 3; ++r)
    for (auto h : hs[r]) ASSERT_TRUE(job.rank(r).handles().Wait(h).ok());
  EXPECT_EQ(a[0], (std::vector<float>{3, 20}));
  EXPECT_EQ(a[1], (std::vector<float>{3, 20}));
  EXPECT_EQ(b[1], (std::vector<float>{500}));
  EXPECT_EQ(b[2], (std::vector<float>{500}));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g[r], (std::vector<float>{3, 6, 9}));
  EXPECT_EQ(job.rank(0).ProcessSetSize(2), 2);
}

TEST(ProcessSets, ARankOutsideTheSetIsRefusedAtTheCall) {
  Job job(3);
  job.Add(1, {0, 1});
  std::vector<float> v{1};
  int64_t h = 0;
  Status s = Submit(job.rank(2), Entry("outside", 1, v), &h);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("Rank 2 submitted the allreduce of 'outside' on process set 1 (ranks [0, 1]), which it "
                            "is not in"), std::string::npos) << s.reason();
  s = Submit(job.rank(0), Entry("nowhere", 7, v), &h);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("Process set 7"), std::string::npos) << s.reason();
}

// Roots are world ranks; the set's rank 0 is world rank 1 here.
TEST(ProcessSets, ABroadcastRootIsTheRanksPlaceInTheJob) {
  Job job(3);
  job.Add(1, {1, 2});
  std::vector<std::vector<float>> v{{}, {1, 1}, {7, 8}};
  std::vector<int64_t> hs(3);
  for (int r = 1; r < 3; ++r) ASSERT_TRUE(Submit(job.rank(r), Entry("b", 1, v[r], OpType::kBroadcast, 2), &hs[r]).ok());
  for (int r = 1; r < 3; ++r) ASSERT_TRUE(job.rank(r).handles().Wait(hs[r]).ok());
  EXPECT_EQ(v[1], (std::vector<float>{7, 8}));
  int64_t h = 0;
  Status s = Submit(job.rank(1), Entry("c", 1, v[1], OpType::kBroadcast, 0), &h);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("root_rank 0 of 'c' is not in process set 1 (ranks [1, 2])"), std::string::npos)
      << s.reason();
}

TEST(ProcessSets, AMismatchNamesTheSetAndWorldRanks) {
  Job job(3);
  job.Add(1, {1, 2});
  std::vector<float> two{1, 2}, three{1, 2, 3};
  int64_t h1 = 0, h2 = 0;
  ASSERT_TRUE(Submit(job.rank(1), Entry("m", 1, two), &h1).ok());
  ASSERT_TRUE(Submit(job.rank(2), Entry("m", 1, three), &h2).ok());
  Status s = job.rank(1).handles().Wait(h1);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.reason().find("Mismatched shape for tensor 'm' in process set 1 (ranks [1, 2]): rank 1 has [2], rank 2 "
                            "has [3]"), std::string::npos) << s.reason();
  EXPECT_FALSE(job.rank(2).handles().Wait(h2).ok());
}

TEST(ProcessSets, AStallNamesTheSetAndTheMissingWorldRanks) {
  Params p;
  p.stall_check_seconds = 0.2;
  p.stall_shutdown_seconds = 0.5;
  p.log_level = LogLevel::kFatal;  // the warnings this test provokes
  Job job(3, p);
  job.Add(1, {1, 2});
  std::vector<float> v{1};
  int64_t h = 0;
  ASSERT_TRUE(Submit(job.rank(1), Entry("alone", 1, v), &h).ok());
  Status s = job.rank(1).handles().Wait(h);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.reason().find("Stalled tensor 'alone' in process set 1 (ranks [1, 2]): submitted by ranks [1] but not "
                            "by ranks [2]"), std::string::npos) << s.reason();
}

TEST(ProcessSets, RemovingASetFailsItsPendingOpsAndRefusesLaterOnes) {
  Job job(2);
  job.Add(1, {0, 1});
  std::vector<float> v{1};
  int64_t h = 0;
  ASSERT_TRUE(Submit(job.rank(0), Entry("waits", 1, v), &h).ok());  // rank 1 never submits it
  job.Remove(1);
  Status s = job.rank(0).handles().Wait(h);
  EXPECT_EQ(s.type(), StatusType::kAborted);
  EXPECT_NE(s.reason().find("process set 1 (ranks [0, 1]) was removed"), std::string::npos) << s.reason();
  s = Submit(job.rank(0), Entry("later", 1, v), &h);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_EQ(job.rank(1).ProcessSetSize(1), -1);
  // The same ranks again, as a new set, and the same name as before: a new tensor.
  job.Add(2, {0, 1});
  std::vector<std::vector<float>> w{{2}, {3}};
  std::vector<int64_t> hs(2);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(Submit(job.rank(r), Entry("waits", 2, w[r]), &hs[r]).ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(job.rank(r).handles().Wait(hs[r]).ok());
  EXPECT_EQ(w[0], (std::vector<float>{5}));
}

}  // namespace
}  // namespace hvdz
