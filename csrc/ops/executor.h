// Runs one fused group: allocate outputs, copy in (cast and prescale fused), one
// collective, copy out (postscale fused), then hand the entries back.
#pragma once

#include <vector>

#include "common/timeline.h"
#include "fusion/fusion_plan.h"
#include "ops/counters.h"
#include "ops/device_context.h"

namespace hvdz {

// Address of element `elems` of a buffer of dtype `t`.
char* At(void* base, int64_t elems, DataType t);

class Executor {
 public:
  // A fusion buffer grown past `keep_buffer_bytes` (by one tensor larger than the
  // fusion threshold) is freed after its op rather than held for the whole job.
  // Fused allgathers and reducescatters over `chunk_bytes` run in chunks of at most
  // that size, pipelined where the device has a copy stream (0: never).
  Executor(int rank, int size, int direct_max_tensors, int64_t keep_buffer_bytes, int64_t chunk_bytes,
           Timeline& timeline, Counters& counters)
      : rank_(rank), size_(size), direct_max_tensors_(direct_max_tensors), keep_buffer_bytes_(keep_buffer_bytes),
        chunk_bytes_(chunk_bytes), timeline_(timeline), counters_(counters) {}

  // `entries[i]` belongs to `group[i]`.
  void Execute(DeviceContext& ctx, const std::vector<const Response*>& group,
               std::vector<TensorEntry> entries);

 private:
  struct Plan {
    const std::vector<const Response*>& group;
    std::vector<TensorEntry>& entries;
    ReduceOp op;  // Sum, Min or Max
    double postscale;
  };
  Status Run(DeviceContext& ctx, Plan& p);
  Status Allreduce(DeviceContext& ctx, Plan& p);
  Status Allgather(DeviceContext& ctx, Plan& p);
  Status Reducescatter(DeviceContext& ctx, Plan& p);
  Status Broadcast(DeviceContext& ctx, Plan& p);
  // Allreduce and broadcast through the buffer, tensors one after another.
  Status FusedFlat(DeviceContext& ctx, Plan& p, bool copy_in);
  // One rank-major collective over entries [begin, end) of a fused op, in its own
  // region of the buffer starting at element `base`.
  struct Chunk {
    size_t begin, end;
    FusionLayout layout;
    int64_t base;
  };
  // executor_chunks.cc: the chunks of a fused allgather (small_first = false) or
  // reducescatter, and the buffer elements they need in all.
  std::vector<Chunk> Chunks(const Plan& p, bool small_first, int64_t* total_elems) const;
  // executor_direct.cc: large tensors in place, one grouped communicator launch.
  bool UseDirect(DeviceContext& ctx, const Plan& p) const;
  Status RunDirect(DeviceContext& ctx, Plan& p);
  Status Grouped(DeviceContext& ctx, Plan& p, const std::vector<const void*>& send);
  Status AllocateOutputs(Plan& p);
  Status Buffer(DeviceContext& ctx, int64_t bytes, void** ptr);
  void Mark(Plan& p, const char* phase, Clock::time_point start);
  void Count(const Plan& p, int64_t elems, size_t tensors = 0);  // tensors: 0 for the whole group

  int rank_;
  int size_;
  int direct_max_tensors_;
  int64_t keep_buffer_bytes_;
  int64_t chunk_bytes_;
  bool oversize_ = false;  // this op's buffer outgrew keep_buffer_bytes_
  Timeline& timeline_;
  Counters& counters_;
};

}  // namespace hvdz
