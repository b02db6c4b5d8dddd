// Collective counts and bytes, by process set, op, device kind and wire dtype: how
// tests prove fusion and the wire dtype, and how benchmarks report bytes on the wire
// (per set: what crossed nodes, with hybrid sharding).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "common/types.h"

namespace hvdz {

struct OpStats {
  uint64_t collectives = 0;  // calls into the communicator
  uint64_t tensors = 0;      // tensors those calls carried
  uint64_t bytes = 0;        // bytes of the collective's full buffer (all ranks' segments)
};

class Counters {
 public:
  using Key = std::tuple<int /*process set*/, OpType, bool /*cuda*/, DataType /*wire*/>;
  void Record(int set_id, OpType op, bool cuda, DataType wire, uint64_t tensors, uint64_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& s = stats_[Key{set_id, op, cuda, wire}];
    s.collectives += 1;
    s.tensors += tensors;
    s.bytes += bytes;
  }
  std::map<Key, OpStats> Snapshot() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
  }
  void Reset() {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::map<Key, OpStats> stats_;
};

}  // namespace hvdz
