// Which responses share one collective, and where each tensor sits in the fused
// buffer.
//
// [Note: rank-major layout]
// Allgather and reducescatter buffers hold one segment per rank, rank 0 first.
// Within a segment the tensors follow in response order, each at an aligned
// offset; every segment is padded to the longest one, so the collective moves
// size() equal segments even when dim 0 splits unevenly. Allreduce and broadcast
// buffers hold the tensors one after another.
#pragma once

#include <cstdint>
#include <vector>

#include "common/message.h"

namespace hvdz {

// Tensor offsets are aligned to this many bytes so that device copies vectorise.
constexpr int64_t kFusionAlignBytes = 64;

// Rows of dim 0 that rank r receives in a reducescatter: the first dim0 % size
// ranks get one extra row.
int64_t ScatterRows(int64_t dim0, int size, int rank);
int64_t ScatterFirstRow(int64_t dim0, int size, int rank);

// Alltoall: rows this rank sends to each rank, and receives from each rank (its
// column of the negotiated splits).
std::vector<int64_t> SentSplits(const Response& r, int size, int rank);
std::vector<int64_t> ReceivedSplits(const Response& r, int size, int rank);

// Groups of indices into `resps` (error responses excluded): each group is
// compatible (op, dtypes, device kind, reduce op, scales, root; never alltoall) and at most
// `threshold_bytes` on the wire unless it is a single tensor. Deterministic, so
// every rank computes the same groups from the same response list.
std::vector<std::vector<size_t>> PlanFusion(const std::vector<Response>& resps,
                                            int64_t threshold_bytes);

struct FusionLayout {
  // Elements of one rank's segment (allgather/reducescatter) or of the whole
  // buffer (allreduce/broadcast).
  int64_t segment_elems = 0;
  int64_t total_elems = 0;
  // [tensor][rank]: element offset inside rank's segment, and element count.
  // Allreduce/broadcast use rank index 0 only.
  std::vector<std::vector<int64_t>> offset;
  std::vector<std::vector<int64_t>> count;
};

FusionLayout ComputeLayout(const std::vector<const Response*>& group, int size);

// Elements per row past dim 0.
int64_t RowElems(const std::vector<int64_t>& shape);

}  // namespace hvdz
