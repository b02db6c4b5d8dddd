#include "ops/executor.h"

namespace hvdz {

char* At(void* base, int64_t elems, DataType t) {
  return static_cast<char*>(base) + elems * static_cast<int64_t>(DataTypeSize(t));
}

void Executor::Mark(Plan& p, const char* phase, Clock::time_point start) {
  if (!timeline_.enabled()) return;
  auto end = Clock::now();
  for (auto& e : p.entries) timeline_.Span(e.request.name, phase, start, end);
}

void Executor::Count(const Plan& p, int64_t elems) {
  const Response& r = *p.group.front();
  counters_.Record(r.op, r.on_cuda, r.out_dtype, p.group.size(),
                   static_cast<uint64_t>(elems) * DataTypeSize(r.out_dtype));
}

Status Executor::AllocateOutputs(DeviceContext& ctx, Plan& p) {
  for (size_t i = 0; i < p.entries.size(); ++i) {
    auto& e = p.entries[i];
    if (!e.allocate_output) continue;  // the caller passed the output
    std::vector<int64_t> shape = p.group[i]->shape;
    if (p.group[i]->op == OpType::kAllgather) {
      shape[0] = 0;
      for (auto d : p.group[i]->first_dims) shape[0] += d;
    }
    HVDZ_RETURN_IF_ERROR(e.allocate_output(shape, ctx.OutputStream(), &e.output));
  }
  return Status::OK();
}

Status Executor::Allreduce(DeviceContext& ctx, Plan& p) {
  if (p.entries.size() != 1) return RunFused(ctx, p);
  // A lone tensor is reduced in its output, copied there first unless in place.
  const Response& r = *p.group.front();
  auto& e = p.entries[0];
  auto t0 = Clock::now();
  if (e.input.data != e.output.data || r.prescale != 1.0 || r.dtype != r.out_dtype) {
    HVDZ_RETURN_IF_ERROR(ctx.Copy({{e.input.data, e.output.data, e.output.numel()}}, r.dtype, r.out_dtype, r.prescale, kBefore));
    Mark(p, "COPY_IN", t0);
    t0 = Clock::now();
  }
  HVDZ_RETURN_IF_ERROR(ctx.comm().Allreduce(e.output.data, e.output.numel(), r.out_dtype, p.op));
  Count(p, e.output.numel());
  Mark(p, "COLLECTIVE", t0);
  if (p.postscale != 1.0) {
    t0 = Clock::now();
    HVDZ_RETURN_IF_ERROR(
        ctx.Copy({{e.output.data, e.output.data, e.output.numel()}}, r.out_dtype, r.out_dtype, p.postscale, kAfter));
    Mark(p, "COPY_OUT", t0);
  }
  return Status::OK();
}

Status Executor::Broadcast(DeviceContext& ctx, Plan& p) {
  if (p.entries.size() != 1) return RunFused(ctx, p);
  // A lone tensor is broadcast in its output (the root copies its input there first).
  const Response& r = *p.group.front();
  const bool root = rank_ == r.root;
  auto& e = p.entries[0];
  auto t0 = Clock::now();
  if (root && (e.input.data != e.output.data || r.dtype != r.out_dtype)) {
    HVDZ_RETURN_IF_ERROR(ctx.Copy({{e.input.data, e.output.data, e.output.numel()}}, r.dtype, r.out_dtype, 1.0, kBefore));
    Mark(p, "COPY_IN", t0);
    t0 = Clock::now();
  }
  HVDZ_RETURN_IF_ERROR(ctx.comm().Broadcast(e.output.data, e.output.numel(), r.out_dtype, r.root));
  Count(p, e.output.numel());
  Mark(p, "COLLECTIVE", t0);
  return Status::OK();
}

Status Executor::Allgather(DeviceContext& ctx, Plan& p) {
  const Response& r = *p.group.front();
  auto t0 = Clock::now();
  bool even = true;
  for (auto d : r.first_dims) even = even && d == r.first_dims[0];
  if (p.entries.size() == 1 && even) {
    // In place: the input lands in its own slot of the output, which is gathered.
    auto& e = p.entries[0];
    const int64_t n = e.input.numel();
    char* mine = At(e.output.data, n * rank_, r.out_dtype);
    HVDZ_RETURN_IF_ERROR(ctx.Copy({{e.input.data, mine, n}}, r.dtype, r.out_dtype, 1.0, kBefore));
    Mark(p, "COPY_IN", t0);
    t0 = Clock::now();
    HVDZ_RETURN_IF_ERROR(ctx.comm().Allgather(mine, e.output.data, n, r.out_dtype));
    Count(p, n * size_);
    Mark(p, "COLLECTIVE", t0);
    return Status::OK();
  }
  return RunFused(ctx, p);
}

Status Executor::Reducescatter(DeviceContext& ctx, Plan& p) {
  const Response& r = *p.group.front();
  auto t0 = Clock::now();
  if (p.entries.size() == 1 && r.shape[0] % size_ == 0 && r.prescale == 1.0 && r.dtype == r.out_dtype) {
    auto& e = p.entries[0];
    const int64_t n = e.output.numel();
    HVDZ_RETURN_IF_ERROR(ctx.comm().ReduceScatter(e.input.data, e.output.data, n, r.out_dtype, p.op));
    Count(p, n * size_);
    Mark(p, "COLLECTIVE", t0);
    t0 = Clock::now();
    if (p.postscale != 1.0)
      HVDZ_RETURN_IF_ERROR(ctx.Copy({{e.output.data, e.output.data, n}}, r.out_dtype, r.out_dtype, p.postscale, kAfter));
    Mark(p, "COPY_OUT", t0);
    return Status::OK();
  }
  return RunFused(ctx, p);
}

Status Executor::Run(DeviceContext& ctx, Plan& p) {
  HVDZ_RETURN_IF_ERROR(AllocateOutputs(ctx, p));
  HVDZ_RETURN_IF_ERROR(ctx.WaitForInputs(p.entries));
  if (UseDirect(ctx, p)) return RunDirect(ctx, p);
  switch (p.group.front()->op) {
    case OpType::kAllreduce: return Allreduce(ctx, p);
    case OpType::kAllgather: return Allgather(ctx, p);
    case OpType::kReducescatter: return Reducescatter(ctx, p);
    case OpType::kBroadcast: return Broadcast(ctx, p);
  }
  return Status::Error("unknown op");
}

void Executor::Execute(DeviceContext& ctx, const std::vector<const Response*>& group,
                       std::vector<TensorEntry> entries) {
  const Response& r = *group.front();
  Plan p{group, entries, r.reduce_op, r.postscale};
  if (r.reduce_op == ReduceOp::kAverage) {
    p.op = ReduceOp::kSum;
    p.postscale = r.postscale / size_;
  }
  Status s = Run(ctx, p);
  ctx.Finish(std::move(entries), s);
}

}  // namespace hvdz
