// The data plane: one collective over one contiguous buffer. Gloo runs it to
// completion on the calling thread; NCCL enqueues it on the context's stream.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace hvdz {

// What an op that only moves data (allgather, broadcast, alltoall) sends for dtype
// `t`: neither NCCL nor Gloo knows int16, so it travels as twice as many bytes.
struct MovedAs {
  DataType dtype;
  int64_t per_element;
};
inline MovedAs MoveAs(DataType t) {
  return t == DataType::kInt16 ? MovedAs{DataType::kUInt8, 2} : MovedAs{t, 1};
}

// Sum, Min, Max and Product reach every communicator. Average reaches only an
// allreduce of one that AveragesNatively(); elsewhere it is Sum with a postscale
// (see [Note: scale arithmetic]).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) = 0;
  // `out` receives size * count elements, rank-major; `in` may alias out + rank * count.
  virtual Status Allgather(const void* in, void* out, int64_t count, DataType dtype) = 0;
  // `in` holds size * count elements; `out` gets this rank's reduced count elements.
  virtual Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                               ReduceOp op) = 0;
  virtual Status Broadcast(void* buf, int64_t count, DataType dtype, int root) = 0;
  // Both buffers rank-major: `send_counts[q]` elements of `in` go to rank q, and
  // `recv_counts[q]` elements from rank q land in `out`. `in` and `out` do not overlap.
  virtual Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& recv_counts, DataType dtype) = 0;

  // Whether calls of `op` issued between GroupStart and GroupEnd run as one launch
  // (NCCL: every op; Gloo: reducescatter and allgather, see [Note: rings over
  // Gloo's sends]). A direct group of such an op goes inside one group; otherwise
  // its calls run one after another (see [Note: direct groups]).
  virtual bool Groups(OpType) const { return false; }
  // Whether Allreduce takes ReduceOp::kAverage, as NCCL's ncclAvg does: each rank's
  // input times (dtype)(1 / size), then the sum.
  virtual bool AveragesNatively() const { return false; }
  virtual Status GroupStart() { return Status::OK(); }
  virtual Status GroupEnd() { return Status::OK(); }
};

}  // namespace hvdz
