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
  // One collective call of the plan's op. count: per rank for allgather (sent) and
  // reducescatter (received), the whole tensor otherwise; allreduce and broadcast
  // work in `recv`.
  struct Call {
    const void* send;
    void* recv;
    int64_t count;
  };
  // Some of a plan's entries through one fusion buffer: its copies and its call.
  struct Fused {
    std::vector<CopyDesc> in, out;
    Call call;
    int64_t elems = 0;  // buffer elements, for the counters
  };
  double InScale(const Plan& p) const;   // of copies in: prescale for reductions
  double OutScale(const Plan& p) const;  // of copies out: postscale for reductions
  Status Launch(Communicator& c, const Plan& p, const Call& call);
  // executor_fused.cc: the fusion-buffer path, for entries `idx` or for all of them.
  Status PrepareFused(DeviceContext& ctx, Plan& p, const std::vector<size_t>& idx, Fused* f);
  Status RunFused(DeviceContext& ctx, Plan& p);
  // executor_direct.cc: large tensors in place, one grouped communicator launch.
  bool UseDirect(DeviceContext& ctx, const Plan& p) const;
  Status RunDirect(DeviceContext& ctx, Plan& p);
  Status AllocateOutputs(DeviceContext& ctx, Plan& p);
  void Mark(Plan& p, const char* phase, Clock::time_point start);
  void Count(const Plan& p, int64_t elems);

  int rank_;
  int size_;
  int direct_max_tensors_;
  Timeline& timeline_;
  Counters& counters_;
};

}  // namespace hvdz
