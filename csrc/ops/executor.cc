#include "ops/executor.h"

#include "fusion/fusion_plan.h"

namespace hvdz {
namespace {

Status Issue(Communicator& c, const Program& p, const CollectiveCall& k) {
  switch (p.op) {
    case OpType::kAllreduce: return c.Allreduce(k.recv, k.count, p.wire, p.reduce_op);
    case OpType::kAllgather: return c.Allgather(k.send, k.recv, k.count, p.wire);
    case OpType::kReducescatter: return c.ReduceScatter(k.send, k.recv, k.count, p.wire, p.reduce_op);
    case OpType::kBroadcast: return c.Broadcast(k.recv, k.count, p.wire, p.root);
    case OpType::kAlltoall: return c.Alltoall(k.send, k.recv, k.send_counts, k.recv_counts, p.wire);
    case OpType::kJoin: break;
  }
  return Status::Error("unknown op");
}

Status IssueAll(Communicator& c, const Program& p) {
  if (!p.grouped) {
    for (const auto& k : p.calls) HVDZ_RETURN_IF_ERROR(Issue(c, p, k));
    return Status::OK();
  }
  HVDZ_RETURN_IF_ERROR(c.GroupStart());
  Status s;
  for (size_t i = 0; i < p.calls.size() && s.ok(); ++i) s = Issue(c, p, p.calls[i]);
  Status end = c.GroupEnd();  // always close the group, even after a failed call
  HVDZ_RETURN_IF_ERROR(s);
  return end;
}

}  // namespace

void Executor::Mark(const std::vector<TensorEntry>& entries, const char* phase, Clock::time_point start) {
  if (!timeline_.enabled()) return;
  auto end = Clock::now();
  for (auto& e : entries) timeline_.Span(e.request.name, phase, start, end);
}

Status Executor::RunProgram(DeviceContext& ctx, const Program& p, const std::vector<TensorEntry>& entries,
                            Clock::time_point t0) {
  if (!p.in.descs.empty()) {
    HVDZ_RETURN_IF_ERROR(ctx.Copy(p.in.descs, p.in.src, p.in.dst, p.in.scale, CopyStage::kBeforeCollective));
    Mark(entries, "COPY_IN", t0);
    t0 = Clock::now();
  }
  HVDZ_RETURN_IF_ERROR(IssueAll(ctx.comm(), p));
  // Once per launch: a direct group's calls are one launch.
  counters_.Record(set_id_, p.op, p.on_cuda, p.wire, entries.size(), static_cast<uint64_t>(p.elems) * DataTypeSize(p.wire));
  Mark(entries, "COLLECTIVE", t0);
  if (!p.out.descs.empty()) {
    t0 = Clock::now();
    HVDZ_RETURN_IF_ERROR(ctx.Copy(p.out.descs, p.out.src, p.out.dst, p.out.scale, CopyStage::kAfterCollective));
    Mark(entries, "COPY_OUT", t0);
  }
  return Status::OK();
}

Status Executor::AllocateOutputs(DeviceContext& ctx, const std::vector<const Response*>& group,
                                 std::vector<TensorEntry>& entries) {
  for (size_t i = 0; i < entries.size(); ++i) {
    auto& e = entries[i];
    const Response& r = *group[i];
    if (r.op == OpType::kAlltoall && e.received_splits) e.received_splits(ReceivedSplits(r, size_, rank_));
    if (!e.allocate_output) continue;  // the caller passed the output
    std::vector<int64_t> shape = r.shape;
    if (r.op == OpType::kAllgather) {
      shape[0] = 0;
      for (auto d : r.first_dims) shape[0] += d;
    } else if (r.op == OpType::kReducescatter) {
      shape[0] = ScatterRows(shape[0], size_, rank_);  // this rank's rows only
    } else if (r.op == OpType::kAlltoall) {
      shape[0] = 0;
      for (auto d : ReceivedSplits(r, size_, rank_)) shape[0] += d;
    }
    HVDZ_RETURN_IF_ERROR(e.allocate_output(shape, ctx.OutputStream(), &e.output));
  }
  return Status::OK();
}

Status Executor::Run(DeviceContext& ctx, const std::vector<const Response*>& group,
                     std::vector<TensorEntry>& entries) {
  HVDZ_RETURN_IF_ERROR(AllocateOutputs(ctx, group, entries));
  HVDZ_RETURN_IF_ERROR(ctx.WaitForInputs(entries));
  const auto start = Clock::now();  // the first span includes taking the fusion buffer
  Program p;
  HVDZ_RETURN_IF_ERROR(planner_.Plan(ctx, group, entries, &p));
  return RunProgram(ctx, p, entries, start);
}

void Executor::Execute(DeviceContext& ctx, const std::vector<const Response*>& group,
                       std::vector<TensorEntry> entries) {
  Status s = ctx.BeginOp(group.front()->op);
  if (s.ok()) s = Run(ctx, group, entries);
  ctx.Finish(std::move(entries), s);
}

}  // namespace hvdz
