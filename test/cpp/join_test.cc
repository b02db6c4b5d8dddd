// join(): the tracker of joined ranks, negotiation with ranks that have joined
// (ready without them, swept when they join, errors for ops other than
// allreduce, join completing everywhere in one cycle), and a runtime end to end
// whose joined rank adds zeros to the other's allreduces.
#include <gtest/gtest.h>

#include <memory>

#include "host_memory.h"
#include "negotiation/join_tracker.h"
#include "negotiation_harness.h"
#include "runtime/runtime.h"
#include "thread_communicator.h"

namespace hvdz {
namespace {

using testing::ExpectIdentical;
using testing::Find;
using testing::Req;
using testing::RunRanks;

Request Join() { return Req("hvd.join()", {}, OpType::kJoin); }

// Waits at most 10 s for a handle, so that a broken join fails instead of hanging.
Status WaitAWhile(Runtime& rt, int64_t h) {
  for (int i = 0; i < 10000; ++i) {
    bool done = false;
    HVDZ_RETURN_IF_ERROR(rt.handles().Poll(h, &done));
    if (done) return rt.handles().Wait(h);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Status::Aborted("not done within 10 s");
}

TEST(JoinTracker, CompletesOnceAllHaveJoinedWithTheLastToJoin) {
  JoinTracker t(3);
  EXPECT_FALSE(t.Observe({false, false, false}).grew);
  auto u = t.Observe({false, true, false});
  EXPECT_TRUE(u.grew);
  EXPECT_FALSE(u.all);
  EXPECT_FALSE(t.Observe({false, true, false}).grew);
  EXPECT_TRUE(t.Observe({true, true, false}).grew);
  u = t.Observe({true, true, true});
  EXPECT_TRUE(u.all);
  EXPECT_EQ(u.last, 2);
  // A second round starts afresh; ranks joining in the same cycle: the highest is last.
  EXPECT_FALSE(t.Observe({false, false, false}).grew);
  EXPECT_TRUE(t.Observe({true, false, true}).grew);
  u = t.Observe({true, true, true});
  EXPECT_EQ(u.last, 1);
  u = t.Observe({true, true, true});
  EXPECT_TRUE(u.all);
  EXPECT_EQ(u.last, 2) << "all three joined in one cycle";
}

TEST(JoinNegotiation, AnAllreduceIsReadyOnceEveryRankNotJoinedSubmittedIt) {
  Params p;
  auto t = RunRanks(3, p, 3, [](int rank, int cycle) {
    if (rank == 1) return cycle == 0 ? std::vector<Request>{Join()} : std::vector<Request>{};
    return cycle == 1 ? std::vector<Request>{Req("a", {4})} : std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (int r = 0; r < 3; ++r) {
    int cycle = -1;
    const Response* a = Find(t[r], "a", &cycle);
    ASSERT_NE(a, nullptr) << "rank " << r;
    EXPECT_TRUE(a->ok()) << a->error;
    EXPECT_EQ(cycle, 1);
    EXPECT_EQ(t[r].results[1].self_joined, r == 1);
    EXPECT_FALSE(t[r].results[2].join_done);
  }
}

TEST(JoinNegotiation, ATensorWaitingOnlyOnARankThatJoinsIsSweptOut) {
  Params p;
  auto t = RunRanks(3, p, 4, [](int rank, int cycle) {
    if (rank == 1) return cycle == 2 ? std::vector<Request>{Join()} : std::vector<Request>{};
    return cycle == 0 ? std::vector<Request>{Req("w", {2})} : std::vector<Request>{};
  });
  ExpectIdentical(t);
  int cycle = -1;
  const Response* w = Find(t[1], "w", &cycle);
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->ok()) << w->error;
  EXPECT_EQ(cycle, 2);
  EXPECT_TRUE(t[1].slow[2]) << "a new join takes the slow path";
}

TEST(JoinNegotiation, ACachedAllreduceIsReadyWithoutTheJoinedRank) {
  Params p;
  auto t = RunRanks(2, p, 5, [](int rank, int cycle) {
    if (cycle == 0) return std::vector<Request>{Req("c", {3})};
    if (rank == 1 && cycle == 2) return std::vector<Request>{Join()};
    if (rank == 0 && cycle == 3) return std::vector<Request>{Req("c", {3})};
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (const auto& tr : t) {
    ASSERT_EQ(tr.cycles[3].size(), 1u);
    EXPECT_TRUE(tr.cycles[3][0].ok()) << tr.cycles[3][0].error;
    EXPECT_FALSE(tr.slow[3]) << "served from the cache";
  }
}

TEST(JoinNegotiation, OtherOpsThatAJoinedRankLacksFailNamingTheTensorAndRank) {
  Params p;
  auto t = RunRanks(3, p, 5, [](int rank, int cycle) {
    if (cycle == 0) return std::vector<Request>{Req("b", {2}, OpType::kBroadcast)};
    if (rank == 2) return cycle == 1 ? std::vector<Request>{Join()} : std::vector<Request>{};
    if (cycle == 2) {  // uncached
      Request a2a = Req("t", {3}, OpType::kAlltoall);
      a2a.splits = {1, 1, 1};
      return std::vector<Request>{Req("g", {rank + 1, 2}, OpType::kAllgather), a2a};
    }
    if (cycle == 3) return std::vector<Request>{Req("b", {2}, OpType::kBroadcast)};             // cached
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (const char* name : {"g", "t", "b"}) {
    for (int r : {0, 1}) {
      const Response* resp = nullptr;
      for (size_t k = 1; k < t[r].cycles.size(); ++k)
        for (const auto& x : t[r].cycles[k])
          if (x.name == name) resp = &x;
      ASSERT_NE(resp, nullptr) << name;
      EXPECT_FALSE(resp->ok()) << name;
      EXPECT_NE(resp->error.find(std::string("'") + name + "'"), std::string::npos) << resp->error;
      EXPECT_NE(resp->error.find("ranks [2]"), std::string::npos) << resp->error;
      EXPECT_NE(resp->error.find("hvd.join()"), std::string::npos) << resp->error;
    }
  }
}

TEST(JoinNegotiation, ATensorSentWithTheJoinInOneCycleIsNotMissing) {
  Params p;
  auto t = RunRanks(2, p, 2, [](int rank, int cycle) {
    if (cycle != 0) return std::vector<Request>{};
    // Rank 0's list reaches the coordinator first: rank 1's request must still count.
    Request g = Req("g", {1, 2}, OpType::kAllgather);
    return rank == 0 ? std::vector<Request>{g} : std::vector<Request>{g, Join()};
  });
  ExpectIdentical(t);
  for (const auto& tr : t) {
    const Response* g = Find(tr, "g");
    ASSERT_NE(g, nullptr);
    EXPECT_TRUE(g->ok()) << g->error;
    EXPECT_EQ(g->first_dims, (std::vector<int64_t>{1, 1}));
  }
}

TEST(JoinNegotiation, JoinCompletesOnEveryRankInOneCycleWithTheLastToJoin) {
  Params p;
  auto t = RunRanks(3, p, 9, [](int rank, int cycle) {
    const int joins_at[] = {0, 3, 1};
    if (cycle == joins_at[rank] || cycle == 7) return std::vector<Request>{Join()};
    if (cycle == 5) return std::vector<Request>{Req("after", {2})};
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (int r = 0; r < 3; ++r) {
    for (int k = 0; k < 9; ++k) {
      const CycleResult& res = t[r].results[k];
      EXPECT_EQ(res.join_done, k == 3 || k == 7) << "rank " << r << " cycle " << k;
      if (k == 3) {
        EXPECT_EQ(res.last_joined, 1);
      }
      if (k == 7) {
        EXPECT_EQ(res.last_joined, 2) << "all joined in one cycle: the highest rank";
      }
    }
    EXPECT_TRUE(t[r].results[2].self_joined == (r != 1));
    EXPECT_FALSE(t[r].results[5].self_joined) << "join has returned";
    const Response* after = Find(t[r], "after");
    ASSERT_NE(after, nullptr);
    EXPECT_TRUE(after->ok());
  }
}

TEST(JoinNegotiation, ATensorOfAJoinedRankRunsWhenTheLastRankJoins) {
  Params p;
  auto t = RunRanks(2, p, 4, [](int rank, int cycle) {
    if (rank == 0 && cycle == 0) return std::vector<Request>{Req("x", {2}), Join()};
    if (rank == 1 && cycle == 2) return std::vector<Request>{Join()};
    return std::vector<Request>{};
  });
  ExpectIdentical(t);
  for (const auto& tr : t) {
    int cycle = -1;
    const Response* x = Find(tr, "x", &cycle);
    ASSERT_NE(x, nullptr);
    EXPECT_TRUE(x->ok()) << x->error;
    EXPECT_EQ(cycle, 2);
    EXPECT_TRUE(tr.results[2].join_done);
  }
}

TEST(JoinNegotiation, AJoinThatOthersNeverMatchStallsLikeATensor) {
  Params p;
  p.stall_check_seconds = 0.01;
  p.stall_shutdown_seconds = 0.05;
  auto t = RunRanks(2, p, 20, [](int rank, int cycle) {
    if (rank == 0 && cycle == 0) return std::vector<Request>{Join()};
    if (cycle == 15) return std::vector<Request>{Req("later", {2})};
    return std::vector<Request>{};
  }, 10);
  ExpectIdentical(t);
  for (const auto& tr : t) {
    int cycle = -1;
    const Response* j = Find(tr, "hvd.join()", &cycle);
    ASSERT_NE(j, nullptr);
    EXPECT_NE(j->error.find("not by ranks [1]"), std::string::npos) << j->error;
    ASSERT_LT(cycle, 15);
    EXPECT_FALSE(tr.results[cycle + 1].self_joined) << "a failed join stands in no more";
    const Response* later = Find(tr, "later");
    ASSERT_NE(later, nullptr) << "both ranks take part again";
    EXPECT_TRUE(later->ok());
  }
}

// Two runtimes as threads: rank 1 has one batch, rank 0 three. Rank 1 joins after
// its step and adds zeros to rank 0's other two; both get rank 0 from join().
TEST(JoinRuntime, AJoinedRankAddsZerosToTheOthersAllreduces) {
  testing::Hub hub(2);
  testing::CollectiveHub data(2);
  std::vector<std::vector<float>> results(2);
  std::vector<int32_t> last(2, -1);
  testing::Spawn(2, [&](int rank) {
    Params p;
    WorldInfo w;
    w.rank = rank;
    w.size = 2;
    Runtime rt(w, p, std::make_unique<testing::InMemoryControlPlane>(hub, rank),
               std::make_unique<testing::ThreadCommunicator>(data, rank, false),
               std::make_unique<testing::MallocAllocator>());
    ASSERT_TRUE(rt.Start().ok());
    const int steps = rank == 0 ? 3 : 1;
    for (int i = 0; i < steps; ++i) {
      std::vector<float> v{static_cast<float>(rank + 1), 10.0f * (i + 1)};
      TensorEntry e;
      e.request.name = "step";
      e.request.reduce_op = i == 2 ? ReduceOp::kAverage : ReduceOp::kSum;
      e.request.shape = {2};
      e.input = {v.data(), DataType::kFloat32, {2}, kCpuDevice};
      e.output = e.input;
      std::vector<TensorEntry> es;
      es.push_back(std::move(e));
      std::vector<int64_t> hs;
      ASSERT_TRUE(rt.Enqueue(std::move(es), nullptr, &hs).ok());
      Status s = WaitAWhile(rt, hs[0]);
      ASSERT_TRUE(s.ok()) << s.reason();
      rt.handles().Release(hs[0]);
      results[rank].insert(results[rank].end(), v.begin(), v.end());
    }
    int64_t h = 0;
    ASSERT_TRUE(rt.EnqueueJoin(-1, {&last[rank], DataType::kInt32, {}, kCpuDevice}, nullptr, &h).ok());
    Status s = WaitAWhile(rt, h);
    EXPECT_TRUE(s.ok()) << s.reason();
  });
  // Step 0 both ranks; steps 1 and 2 rank 0 and rank 1's zeros; step 2 averages over both.
  EXPECT_EQ(results[0], (std::vector<float>{3, 20, 1, 20, 0.5, 15}));
  EXPECT_EQ(results[1], (std::vector<float>{3, 20}));
  EXPECT_EQ(last, (std::vector<int32_t>{0, 0}));
}

}  // namespace
}  // namespace hvdz
