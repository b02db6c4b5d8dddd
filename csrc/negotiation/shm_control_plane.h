// Negotiation through shared memory, for jobs whose ranks all share one host.
//
// [Note: why not Gloo for negotiation]
// Every cycle exchanges one small header among all ranks. Over Gloo's TCP pairs
// that costs a ring of round trips: 1.1 ms for 8 ranks on an 8-GPU H200 host,
// which bounded every CUDA collective at ~2.7 ms however small. Here a rank
// writes its bytes into its slot and publishes a sequence number; the round is
// complete once every rank's number has reached it. Slots are double-buffered
// by round parity (a rank can be at most one round ahead of the slowest reader),
// and payloads longer than a slot travel in several rounds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/control_plane.h"

namespace hvdz {

class ShmControlPlane : public ControlPlane {
 public:
  // Rank 0 creates the segment `name` (a POSIX shm name, "/..."); the others
  // attach, waiting for it up to `timeout_s`. The name is unlinked once all are in.
  static Status Create(const std::string& name, int rank, int size, double timeout_s,
                       std::unique_ptr<ShmControlPlane>* out);
  ~ShmControlPlane() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) override;
  Status Gatherv(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* at_root) override;
  Status Broadcast(std::vector<uint8_t>* buf) override;
  const char* kind() const override { return "shm"; }

  static constexpr size_t kSlotBytes = 64 * 1024;

 private:
  ShmControlPlane(int rank, int size, double timeout_s, void* base, size_t bytes);
  // Every rank's bytes, in rank order.
  Status Exchange(const uint8_t* data, size_t n, std::vector<std::vector<uint8_t>>* all);
  Status Arrive();  // publish this round and wait for every rank to reach it
  bool AllReached(uint64_t target);
  void Sleep(uint64_t target, std::chrono::nanoseconds at_most);
  Status CheckPeers(uint64_t target, double waited_us);
  std::atomic<uint64_t>& Seq(int r);
  std::atomic<int64_t>& Pid(int r);
  std::atomic<uint32_t>& Arrivals();  // bumped by every arrival; the futex sleepers wait on
  std::atomic<uint32_t>& Sleepers();  // ranks asleep (or about to be) in a round
  std::string DeadPeers(uint64_t target);
  uint8_t* Slot(int parity, int r);

  int rank_;
  int size_;
  double timeout_s_;
  void* base_;
  size_t bytes_;
  uint64_t round_ = 0;
  bool pids_visible_ = true;
};

}  // namespace hvdz
