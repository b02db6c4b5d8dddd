#include "ops/planner.h"

#include <numeric>

namespace hvdz {

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
  // Communicators know Sum, not Average: Average is Sum with postscale / size.
  const bool average = r.reduce_op == ReduceOp::kAverage;
  p->reduce_op = average ? ReduceOp::kSum : r.reduce_op;
  const double postscale = average ? r.postscale / size_ : r.postscale;
  // Only reductions scale: prescale on the way in, postscale on the way out.
  const bool reduces = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  p->in = {{}, r.dtype, r.out_dtype, reduces ? r.prescale : 1.0};
  p->out = {{}, r.out_dtype, r.out_dtype, reduces ? postscale : 1.0};
  if (UseDirect(ctx, g)) return PlanDirect(ctx, g, p);
  if (LoneInPlace(g) || r.op == OpType::kAlltoall) {
    AppendInPlace(g, entries.front(), /*gather_in_place=*/true, /*scaled_send=*/nullptr, p);
    return Status::OK();
  }
  std::vector<size_t> all(entries.size());
  std::iota(all.begin(), all.end(), 0);
  return AppendFused(ctx, g, all, p);
}

}  // namespace hvdz
