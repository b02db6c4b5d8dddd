// The fusion-buffer path: tensors copied into one buffer (rank-major for allgather
// and reducescatter, see [Note: rank-major layout]), one collective over it, and
// copied out. A whole group takes it, or the small tensors of a direct group.
#include <numeric>

#include "ops/executor.h"

namespace hvdz {

double Executor::InScale(const Plan& p) const {
  const Response& r = *p.group.front();
  return r.op == OpType::kAllreduce || r.op == OpType::kReducescatter ? r.prescale : 1.0;
}

double Executor::OutScale(const Plan& p) const {
  const Response& r = *p.group.front();
  return r.op == OpType::kAllreduce || r.op == OpType::kReducescatter ? p.postscale : 1.0;
}

Status Executor::Launch(Communicator& c, const Plan& p, const Call& call) {
  const Response& r = *p.group.front();
  switch (r.op) {
    case OpType::kAllreduce: return c.Allreduce(call.recv, call.count, r.out_dtype, p.op);
    case OpType::kAllgather: return c.Allgather(call.send, call.recv, call.count, r.out_dtype);
    case OpType::kReducescatter: return c.ReduceScatter(call.send, call.recv, call.count, r.out_dtype, p.op);
    case OpType::kBroadcast: return c.Broadcast(call.recv, call.count, r.out_dtype, r.root);
  }
  return Status::Error("unknown op");
}

Status Executor::PrepareFused(DeviceContext& ctx, Plan& p, const std::vector<size_t>& idx, Fused* f) {
  const Response& r = *p.group.front();
  const DataType dt = r.out_dtype;
  std::vector<const Response*> sub;
  for (auto i : idx) sub.push_back(p.group[i]);
  FusionLayout L = ComputeLayout(sub, size_);
  const int64_t S = L.segment_elems;
  f->elems = L.total_elems;
  void* buf = nullptr;
  switch (r.op) {
    case OpType::kAllgather: {
      HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(L.total_elems * DataTypeSize(dt), &buf));
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = p.entries[idx[k]];
        f->in.push_back({e.input.data, At(buf, rank_ * S + L.offset[k][rank_], dt), L.count[k][rank_]});
        int64_t dst = 0;
        for (int q = 0; q < size_; ++q) {
          f->out.push_back({At(buf, q * S + L.offset[k][q], dt), At(e.output.data, dst, dt), L.count[k][q]});
          dst += L.count[k][q];
        }
      }
      f->call = {At(buf, rank_ * S, dt), buf, S};
      return Status::OK();
    }
    case OpType::kReducescatter: {
      // size() send segments, then one receive segment.
      HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer((L.total_elems + S) * DataTypeSize(dt), &buf));
      char* recv = At(buf, L.total_elems, dt);
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = p.entries[idx[k]];
        const std::vector<int64_t>& shape = sub[k]->shape;
        for (int q = 0; q < size_; ++q) {
          const int64_t first = ScatterFirstRow(shape[0], size_, q) * RowElems(shape);
          f->in.push_back({At(e.input.data, first, r.dtype), At(buf, q * S + L.offset[k][q], dt), L.count[k][q]});
        }
        f->out.push_back({At(recv, L.offset[k][rank_], dt), e.output.data, L.count[k][rank_]});
      }
      f->call = {buf, recv, S};
      return Status::OK();
    }
    case OpType::kAllreduce:
    case OpType::kBroadcast: {
      // One tensor after another; a broadcast copies in on the root only.
      HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(L.total_elems * DataTypeSize(dt), &buf));
      const bool copy_in = r.op == OpType::kAllreduce || rank_ == r.root;
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = p.entries[idx[k]];
        char* slot = At(buf, L.offset[k][0], dt);
        if (copy_in) f->in.push_back({e.input.data, slot, L.count[k][0]});
        f->out.push_back({slot, e.output.data, L.count[k][0]});
      }
      f->call = {buf, buf, L.total_elems};
      return Status::OK();
    }
  }
  return Status::Error("unknown op");
}

Status Executor::RunFused(DeviceContext& ctx, Plan& p) {
  const Response& r = *p.group.front();
  auto t0 = Clock::now();
  std::vector<size_t> all(p.entries.size());
  std::iota(all.begin(), all.end(), 0);
  Fused f;
  HVDZ_RETURN_IF_ERROR(PrepareFused(ctx, p, all, &f));
  if (!f.in.empty()) HVDZ_RETURN_IF_ERROR(ctx.Copy(f.in, r.dtype, r.out_dtype, InScale(p), kBefore));
  Mark(p, "COPY_IN", t0);
  t0 = Clock::now();
  HVDZ_RETURN_IF_ERROR(Launch(ctx.comm(), p, f.call));
  Count(p, f.elems);
  Mark(p, "COLLECTIVE", t0);
  t0 = Clock::now();
  HVDZ_RETURN_IF_ERROR(ctx.Copy(f.out, r.out_dtype, r.out_dtype, OutScale(p), kAfter));
  Mark(p, "COPY_OUT", t0);
  return Status::OK();
}

}  // namespace hvdz
