// The shared-memory control plane, ranks as threads attached to one segment:
// exchanges, payloads longer than a slot, the controller on top, and a missing
// rank turning into an error that names it.
#include <gtest/gtest.h>

#include <unistd.h>

#include "in_memory_control_plane.h"
#include "negotiation/controller.h"
#include "negotiation/shm_control_plane.h"

namespace hvdz {
namespace {

std::string UniqueName(const char* tag) { return std::string("/hvdz_test_") + tag + "_" + std::to_string(getpid()); }

TEST(ShmControlPlane, AllgatherGathervAndBroadcastAcrossManyRounds) {
  const int n = 4;
  const std::string name = UniqueName("ops");
  testing::Spawn(n, [&](int rank) {
    std::unique_ptr<ShmControlPlane> cp;
    ASSERT_TRUE(ShmControlPlane::Create(name, rank, n, 10, &cp).ok());
    for (int round = 0; round < 50; ++round) {
      std::vector<uint8_t> mine(3, static_cast<uint8_t>(rank * 10 + round % 7)), all;
      ASSERT_TRUE(cp->Allgather(mine, &all).ok());
      ASSERT_EQ(all.size(), 12u);
      for (int r = 0; r < n; ++r) EXPECT_EQ(all[3 * r], r * 10 + round % 7);
    }
    // Longer than a slot, and a different length on every rank.
    std::vector<uint8_t> big(ShmControlPlane::kSlotBytes * 2 + 17 * rank, static_cast<uint8_t>(rank + 1));
    std::vector<std::vector<uint8_t>> at_root;
    ASSERT_TRUE(cp->Gatherv(big, &at_root).ok());
    if (rank == 0) {
      ASSERT_EQ(at_root.size(), 4u);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(at_root[r].size(), ShmControlPlane::kSlotBytes * 2 + 17 * r);
        EXPECT_EQ(at_root[r].back(), r + 1);
      }
    }
    std::vector<uint8_t> b = rank == 0 ? std::vector<uint8_t>(100000, 7) : std::vector<uint8_t>{};
    ASSERT_TRUE(cp->Broadcast(&b).ok());
    EXPECT_EQ(b.size(), 100000u);
    EXPECT_EQ(b[99999], 7);
  });
}

TEST(ShmControlPlane, ControllerNegotiatesOverIt) {
  const int n = 3;
  const std::string name = UniqueName("ctl");
  std::vector<std::vector<std::string>> seen(n);
  testing::Spawn(n, [&](int rank) {
    std::unique_ptr<ShmControlPlane> cp;
    ASSERT_TRUE(ShmControlPlane::Create(name, rank, n, 10, &cp).ok());
    Params p;
    Logger log(LogLevel::kFatal, rank);
    Controller c(*cp, p, log);
    for (int cycle = 0; cycle < 4; ++cycle) {
      std::vector<Request> reqs;
      if (cycle == rank) {  // each rank submits in a different cycle
        Request q;
        q.name = "t";
        q.rank = rank;
        q.shape = {4};
        reqs.push_back(q);
      }
      CycleResult res;
      ASSERT_TRUE(c.RunCycle(reqs, false, &res).ok());
      for (auto& r : res.responses) seen[rank].push_back(r.name + "@" + std::to_string(cycle));
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen[r], (std::vector<std::string>{"t@2"}));
}

TEST(ShmControlPlane, AMissingRankIsAnErrorNamingIt) {
  const int n = 3;
  const std::string name = UniqueName("dead");
  std::vector<std::string> errors(n);
  testing::Spawn(n, [&](int rank) {
    std::unique_ptr<ShmControlPlane> cp;
    ASSERT_TRUE(ShmControlPlane::Create(name, rank, n, 0.5, &cp).ok());
    if (rank == 2) return;  // "dies" after attaching
    std::vector<uint8_t> all;
    Status s = cp->Allgather({1, 2, 3}, &all);
    errors[rank] = s.reason();
  });
  EXPECT_NE(errors[0].find("ranks [2] did not reach"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("ranks [2] did not reach"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace hvdz
