// Handles returned to the framework: an id per submitted tensor, done once its
// callback reports a status. A done handle holds its entry's keepalive until
// Release hands it back, so the framework drops its objects on its own thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common/status.h"

namespace hvdz {

class HandleTable {
 public:
  // `keepalive`: the entry's objects, held from the start so that the last reference is
  // always dropped by Release, on the framework's thread, and so that LetGo can reach them.
  int64_t Allocate(std::shared_ptr<void> keepalive = nullptr);
  void MarkDone(int64_t handle, const Status& s, std::shared_ptr<void> keepalive);
  // CUDA: the handle's op is queued on the GPU, and its outputs are ready after `event`.
  void MarkLaunched(int64_t handle, std::shared_ptr<void> event);
  // Returns InvalidArgument for an unknown (or already released) handle.
  Status Poll(int64_t handle, bool* done);
  // Blocks until done; the handle stays valid until Release.
  Status Wait(int64_t handle);
  // Waits until `deadline` at most: *done tells whether it finished (or is unknown,
  // which the returned status says); the handle stays valid until Release either way.
  Status WaitUntil(int64_t handle, std::chrono::steady_clock::time_point deadline, bool* done);
  // Waits until `deadline` at most for the op to be launched or done (*ready tells
  // which). *event is its launch event while it may still run on the GPU; null once
  // it is done, or when it failed before launching (the returned status says why).
  Status WaitLaunchedUntil(int64_t handle, std::chrono::steady_clock::time_point deadline, bool* ready,
                           std::shared_ptr<void>* event);
  // The handle's keepalive while it is valid (null otherwise); the handle keeps it too.
  std::shared_ptr<void> Keepalive(int64_t handle);
  // Forgets the handle; returns its keepalive (null for an unknown handle).
  std::shared_ptr<void> Release(int64_t handle);

 private:
  // cv_.wait_until, except that a deadline already past only checks `ready`: a timed wait
  // sleeps for the kernel's timer slack (50 us) even then, and a poll (deadline now) of an
  // op not launched yet cost that per handle.
  template <class Ready>
  bool WaitFor(std::unique_lock<std::mutex>& lk, std::chrono::steady_clock::time_point deadline, Ready ready) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    return cv_.wait_until(lk, deadline, ready);
  }

  struct State {
    bool done = false;
    Status status;
    std::shared_ptr<void> keepalive;
    std::shared_ptr<void> event;  // set once launched (CUDA)
  };
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, State> states_;
};

}  // namespace hvdz
