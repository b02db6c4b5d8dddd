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
  // `direct_max_tensors` < 0: chosen from `size`, see [Note: direct groups].
  Executor(int rank, int size, int direct_max_tensors, Timeline& timeline, Counters& counters)
      : rank_(rank),
        size_(size),
        direct_max_tensors_(direct_max_tensors < 0 ? DefaultDirectMaxTensors(size) : direct_max_tensors),
        timeline_(timeline),
        counters_(counters) {}
  static int DefaultDirectMaxTensors(int size);

  // `entries[i]` belongs to `group[i]`.
  void Execute(DeviceContext& ctx, const std::vector<const Response*>& group,
               std::vector<TensorEntry> entries);

 private:
  static constexpr CopyStage kBefore = CopyStage::kBeforeCollective;
  static constexpr CopyStage kAfter = CopyStage::kAfterCollective;

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
  // executor_direct.cc: large tensors in place, one grouped communicator launch.
  bool UseDirect(DeviceContext& ctx, const Plan& p) const;
  Status RunDirect(DeviceContext& ctx, Plan& p);
  Status Grouped(DeviceContext& ctx, Plan& p, const std::vector<const void*>& send);
  Status AllocateOutputs(Plan& p);
  void Mark(Plan& p, const char* phase, Clock::time_point start);
  void Count(const Plan& p, int64_t elems);

  int rank_;
  int size_;
  int direct_max_tensors_;
  Timeline& timeline_;
  Counters& counters_;
};

}  // namespace hvdz
