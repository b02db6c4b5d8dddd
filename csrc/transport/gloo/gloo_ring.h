// Reduce-scatter and allgather as rings of Gloo's point-to-point sends.
//
// [Note: rings over Gloo's sends]
// torch's Gloo backend has no reduce-scatter of its own: _reduce_scatter_base
// clones the whole input, allreduces it and copies this rank's part out, so it
// moves twice the bytes a reduce-scatter needs, plus two copies. Its allgather
// gathers into a fresh flat tensor and copies that out again. Measured on 2 CPU
// ranks (one core each, 32 MiB of fp32, median ms): allreduce 42, its
// reduce_scatter 69, its allgather 54, while one send and one receive of the same
// halves take 19. So both run here as rings of sends and receives (Gloo's unbound
// buffers, the same TCP pairs): n - 1 steps, each sending one segment to the
// next rank and receiving one from the previous, (n - 1) / n of the data per
// rank, which is what a bandwidth-optimal reduce-scatter or allgather moves. The
// reduction runs on this thread with ATen, as each piece arrives, so on a machine
// with cores to spare it overlaps the receives still in flight. Several tensors
// (a direct group, Communicator::GroupStart) go through each step together:
// one wait per step for the whole group, no fusion buffer and no copy in or out.
// With 2 ranks a reduce-scatter receives straight into its output and needs no
// scratch; beyond that one segment per tensor holds the partial sums. Ops of under
// 1 MiB keep Gloo's own collectives (kRingMinBytes in gloo_transport.cc): there the
// handshake of each send (the receiver announces its buffer first) costs more than
// the bytes.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/types.h"
#include "transport/gloo/gloo_transport.h"

namespace hvdz {

// One tensor of a ring op: `send` holds size * count elements for a reduce-scatter
// and count for an allgather (which may sit in its own slot of `recv`); `recv` gets
// count elements (reduce-scatter; it may lie inside `send`) or size * count,
// rank-major (allgather).
struct RingCall {
  const void* send;
  void* recv;
  int64_t count;
};

struct RingOptions {
  std::chrono::milliseconds timeout{30000};
  // Larger tensors go as several messages of at most this many bytes, so that the
  // reduction of one overlaps the receipt of the next.
  int64_t piece_bytes = 1 << 20;
};

class GlooRing {
 public:
  GlooRing(GlooBackend backend, RingOptions options) : b_(std::move(backend)), options_(options) {}

  Status ReduceScatter(const std::vector<RingCall>& calls, DataType dtype, ReduceOp op);
  Status Allgather(const std::vector<RingCall>& calls, DataType dtype);

 private:
  GlooBackend b_;
  RingOptions options_;
};

}  // namespace hvdz
