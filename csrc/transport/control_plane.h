// The byte exchanges negotiation needs, and the NCCL transport for its unique id.
// Implemented over Gloo (transport/gloo), over shared memory (negotiation/) and in
// memory (ranks as threads) in the C++ tests. It lives here, below negotiation,
// because transports implement and use it.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace hvdz {

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes `mine` of the same length; `all` gets size() * length bytes, rank-major.
  virtual Status Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) = 0;
  // Variable-length gather to rank 0; `at_root` is filled on rank 0 only.
  virtual Status Gatherv(const std::vector<uint8_t>& mine,
                         std::vector<std::vector<uint8_t>>* at_root) = 0;
  // Rank 0's `buf` (any length) replaces everyone's.
  virtual Status Broadcast(std::vector<uint8_t>* buf) = 0;
  virtual const char* kind() const = 0;
};

}  // namespace hvdz
