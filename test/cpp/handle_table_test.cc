// HandleTable's launch state: a CUDA op's handle is "launched" (its outputs ready after
// an event) before it is done, and a stream-ordered wait returns there.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "runtime/handle_table.h"

namespace hvdz {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kShort = std::chrono::milliseconds(20);

TEST(HandleTable, WaitLaunchedReturnsTheEventBeforeTheOpIsDone) {
  HandleTable t;
  int64_t h = t.Allocate();
  bool ready = true;
  std::shared_ptr<void> ev;
  ASSERT_TRUE(t.WaitLaunchedUntil(h, Clock::now() + kShort, &ready, &ev).ok());
  EXPECT_FALSE(ready);  // neither launched nor done yet
  auto event = std::make_shared<int>(7);
  std::thread launcher([&] { t.MarkLaunched(h, event); });
  ASSERT_TRUE(t.WaitLaunchedUntil(h, Clock::now() + std::chrono::seconds(5), &ready, &ev).ok());
  launcher.join();
  EXPECT_TRUE(ready);
  EXPECT_EQ(ev, event);
  bool done = true;
  ASSERT_TRUE(t.Poll(h, &done).ok());
  EXPECT_FALSE(done);  // launched is not done: synchronize still waits
  t.MarkDone(h, Status::OK(), nullptr);
  ASSERT_TRUE(t.WaitLaunchedUntil(h, Clock::now() + kShort, &ready, &ev).ok());
  EXPECT_TRUE(ready);
  EXPECT_EQ(ev, nullptr);  // done: nothing left to order after
  t.Release(h);
}

TEST(HandleTable, WaitLaunchedReportsAFailureBeforeLaunch) {
  HandleTable t;
  int64_t h = t.Allocate();
  t.MarkDone(h, Status::InvalidArgument("shapes differ"), nullptr);
  bool ready = false;
  std::shared_ptr<void> ev;
  Status s = t.WaitLaunchedUntil(h, Clock::now() + kShort, &ready, &ev);
  EXPECT_TRUE(ready);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(ev, nullptr);
  t.MarkLaunched(h, std::make_shared<int>(1));  // too late: ignored
  ASSERT_FALSE(t.WaitLaunchedUntil(h, Clock::now() + kShort, &ready, &ev).ok());
  EXPECT_EQ(ev, nullptr);
  t.Release(h);
  EXPECT_FALSE(t.WaitLaunchedUntil(h, Clock::now() + kShort, &ready, &ev).ok());  // unknown now
}

TEST(HandleTable, APollWithAPastDeadlineStillSeesALaunchedOrDoneOp) {
  // TryLetGoAll and TryWaitStream poll with the deadline `now`, which has passed by the check.
  HandleTable t;
  int64_t h = t.Allocate();
  const auto past = Clock::now() - std::chrono::seconds(1);
  bool ready = true, done = true;
  std::shared_ptr<void> ev;
  ASSERT_TRUE(t.WaitLaunchedUntil(h, past, &ready, &ev).ok());
  EXPECT_FALSE(ready);
  ASSERT_TRUE(t.WaitUntil(h, past, &done).ok());
  EXPECT_FALSE(done);
  auto event = std::make_shared<int>(5);
  t.MarkLaunched(h, event);
  ASSERT_TRUE(t.WaitLaunchedUntil(h, past, &ready, &ev).ok());
  EXPECT_TRUE(ready);
  EXPECT_EQ(ev, event);
  ASSERT_TRUE(t.WaitUntil(h, past, &done).ok());
  EXPECT_FALSE(done);
  t.MarkDone(h, Status::Aborted("peer lost"), nullptr);
  EXPECT_FALSE(t.WaitUntil(h, past, &done).ok());
  EXPECT_TRUE(done);
  t.Release(h);
}

TEST(HandleTable, TheEventLivesUntilTheHandleIsDoneOrReleased) {
  HandleTable t;
  int64_t h = t.Allocate();
  auto event = std::make_shared<int>(3);
  std::weak_ptr<int> alive = event;
  t.MarkLaunched(h, event);
  event.reset();
  EXPECT_FALSE(alive.expired());  // a stream-ordered wait may still need it
  t.MarkDone(h, Status::OK(), nullptr);
  EXPECT_TRUE(alive.expired());
  t.Release(h);
}

}  // namespace
}  // namespace hvdz
