#include "ops/planner.h"

#include <numeric>

#include "fusion/fusion_plan.h"

namespace hvdz {

// [Note: scale arithmetic]
// Scales and Average compute as Horovod's do, bit for bit (horovod/common/ops:
// ScaleBuffer, its CUDA kernels, the Gloo and NCCL ops): prescale multiplies each
// rank's input in the tensor's own dtype before the sum, postscale the result after
// it. fp64 multiplies in double, fp32 by (float) factor in float, integers in double
// truncated toward zero, fp16 on the CPU in float by (float) factor with one
// rounding, fp16 on the GPU in fp16 by the factor rounded to fp16 (cpu_cast.cc,
// batched_copy.cu). Average adds 1 / size to the postscale, computed in double,
// except for an allreduce on NCCL, which Horovod runs as ncclAvg: NCCL multiplies
// each rank's input by (dtype)(1 / size) before the sum, and the postscale stays the
// user's. Horovod has no bf16: ours scales it as the CPU scales fp16, on the GPU
// too, and averages it after the sum everywhere, as (bf16)(1 / 3) would bias a
// three-rank average by 0.2%. A copy that also casts (ZeRO's fp32 shards gathered
// as bf16) computes in double if either dtype is double, else in float.

Planner::Planner(int rank, int size, int direct_max_tensors)
    : rank_(rank),
      size_(size),
      direct_max_tensors_(direct_max_tensors < 0 ? DefaultDirectMaxTensors(size) : direct_max_tensors) {}

bool EvenSplit(const Response& r, int size) {
  switch (r.op) {
    case OpType::kAllgather:
      for (auto d : r.first_dims)
        if (d != r.first_dims[0]) return false;
      return true;
    case OpType::kReducescatter:
      return r.shape[0] % size == 0 && r.dtype == r.out_dtype;
    default:
      return true;
  }
}

Status Planner::Plan(DeviceContext& ctx, const std::vector<const Response*>& group,
                     const std::vector<TensorEntry>& entries, Program* p) const {
  const Group g{group, entries};
  const Response& r = g.head();
  *p = Program();
  p->op = r.op;
  p->wire = r.out_dtype;
  p->root = r.root;
  p->on_cuda = r.on_cuda;
  // Average: see [Note: scale arithmetic].
  const bool average = r.reduce_op == ReduceOp::kAverage;
  const bool native = average && r.op == OpType::kAllreduce && r.out_dtype != DataType::kBFloat16 &&
                      ctx.comm().AveragesNatively();
  p->reduce_op = average && !native ? ReduceOp::kSum : r.reduce_op;
  const double postscale = average && !native ? r.postscale / size_ : r.postscale;
  // Only reductions scale: prescale on the way in, postscale on the way out.
  const bool reduces = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  p->in = {{}, r.dtype, r.out_dtype, reduces ? r.prescale : 1.0};
  p->out = {{}, r.out_dtype, r.out_dtype, reduces ? postscale : 1.0};
  const auto all = [&] {
    std::vector<size_t> idx(entries.size());
    std::iota(idx.begin(), idx.end(), 0);
    return idx;
  };
  // Through the window whenever it holds the whole group, ahead of the plans without
  // a buffer: see [Note: copy-engine allgather] in transport/nccl/nccl_window.cc.
  if (r.op == OpType::kAllgather && ctx.WindowBytes() > 0 &&
      ComputeLayout(group, size_).total_elems * static_cast<int64_t>(DataTypeSize(r.out_dtype)) <= ctx.WindowBytes())
    return AppendFused(ctx, g, all(), p, /*window=*/true);
  if (UseDirect(ctx, g)) return PlanDirect(ctx, g, p);
  if (LoneInPlace(g) || r.op == OpType::kAlltoall) {
    AppendInPlace(g, entries.front(), /*gather_in_place=*/true, /*scaled_send=*/nullptr, p);
    return Status::OK();
  }
  return AppendFused(ctx, g, all(), p);
}

}  // namespace hvdz
