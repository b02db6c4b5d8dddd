// PinThisThread (HOROVOD_THREAD_AFFINITY), read back from the kernel for the calling thread.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <thread>
#include <vector>

#include "common/thread_affinity.h"

namespace hvdz {
namespace {

std::vector<int> MyCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

TEST(ThreadAffinity, AThreadRunsOnlyOnTheCpusItWasGiven) {
  const std::vector<int> all = MyCpus();
  ASSERT_FALSE(all.empty());
  std::vector<int> seen;
  bool pinned = false;
  std::thread t([&] {
    pinned = PinThisThread({all.back()});
    seen = MyCpus();
  });
  t.join();
  EXPECT_TRUE(pinned);
  EXPECT_EQ(seen, std::vector<int>{all.back()});
  EXPECT_EQ(MyCpus(), all);  // only the calling thread moves
}

TEST(ThreadAffinity, NoCpusLeavesTheThreadAsItIs) {
  const std::vector<int> all = MyCpus();
  std::vector<int> seen;
  std::thread t([&] {
    EXPECT_TRUE(PinThisThread({}));
    seen = MyCpus();
  });
  t.join();
  EXPECT_EQ(seen, all);
}

TEST(ThreadAffinity, ACpuTheKernelCannotGiveIsRefusedAndTheThreadStaysUnpinned) {
  const std::vector<int> all = MyCpus();
  std::vector<int> seen;
  bool pinned = true;
  std::thread t([&] {
    pinned = PinThisThread({-1}) || PinThisThread({CPU_SETSIZE - 1});
    seen = MyCpus();
  });
  t.join();
  if (all.back() != CPU_SETSIZE - 1) EXPECT_FALSE(pinned);
  EXPECT_EQ(seen, all);
}

}  // namespace
}  // namespace hvdz
