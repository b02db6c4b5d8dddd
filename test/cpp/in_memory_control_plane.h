// Ranks as threads: a control plane whose exchanges meet in memory, so the
// negotiation can be tested in one process without any transport.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/control_plane.h"

namespace hvdz {
namespace testing {

// Every rank deposits its bytes; once all have, each gets all of them.
class Hub {
 public:
  explicit Hub(int size) : size_(size), slots_(size) {}
  Status Exchange(int rank, std::vector<uint8_t> mine, std::vector<std::vector<uint8_t>>* all,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));
  int size() const { return size_; }

 private:
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<uint8_t>> slots_, result_;
  int arrived_ = 0, departed_ = 0;
  bool draining_ = false;
};

class InMemoryControlPlane : public ControlPlane {
 public:
  InMemoryControlPlane(Hub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size(); }
  Status Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) override;
  Status Gatherv(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* at_root) override;
  Status Broadcast(std::vector<uint8_t>* buf) override;
  const char* kind() const override { return "memory"; }
  int exchanges() const { return exchanges_; }

 private:
  Hub& hub_;
  int rank_;
  int exchanges_ = 0;
};

// Runs fn(rank) on `size` threads and joins them.
void Spawn(int size, const std::function<void(int)>& fn);

}  // namespace testing
}  // namespace hvdz
