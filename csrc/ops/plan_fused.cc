// The fusion-buffer path: tensors copied into one buffer (rank-major for allgather
// and reducescatter, see [Note: rank-major layout]), one collective over it, and
// copied out. A whole group takes it, or the small tensors of a direct group.
#include "fusion/fusion_plan.h"
#include "ops/planner.h"

namespace hvdz {

Status Planner::AppendFused(DeviceContext& ctx, const Group& g, const std::vector<size_t>& idx, Program* p,
                            bool window) const {
  const Response& r = g.head();
  const DataType dt = r.out_dtype;
  std::vector<const Response*> sub;
  for (auto i : idx) sub.push_back(g.responses[i]);
  FusionLayout L = ComputeLayout(sub, size_);
  const int64_t S = L.segment_elems;
  p->elems += L.total_elems;
  void* buf = nullptr;
  switch (r.op) {
    case OpType::kAllgather: {
      HVDZ_RETURN_IF_ERROR(window ? ctx.WindowBuffer(&buf) : ctx.FusionBuffer(L.total_elems * DataTypeSize(dt), &buf));
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = g.entries[idx[k]];
        p->in.descs.push_back({e.input.data, At(buf, rank_ * S + L.offset[k][rank_], dt), L.count[k][rank_]});
        int64_t dst = 0;
        for (int q = 0; q < size_; ++q) {
          p->out.descs.push_back({At(buf, q * S + L.offset[k][q], dt), At(e.output.data, dst, dt), L.count[k][q]});
          dst += L.count[k][q];
        }
      }
      p->calls.push_back({At(buf, rank_ * S, dt), buf, S});
      return Status::OK();
    }
    case OpType::kReducescatter: {
      // size() send segments, then one receive segment.
      HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer((L.total_elems + S) * DataTypeSize(dt), &buf));
      char* recv = At(buf, L.total_elems, dt);
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = g.entries[idx[k]];
        const std::vector<int64_t>& shape = sub[k]->shape;
        for (int q = 0; q < size_; ++q) {
          const int64_t first = ScatterFirstRow(shape[0], size_, q) * RowElems(shape);
          p->in.descs.push_back({At(e.input.data, first, r.dtype), At(buf, q * S + L.offset[k][q], dt), L.count[k][q]});
        }
        p->out.descs.push_back({At(recv, L.offset[k][rank_], dt), e.output.data, L.count[k][rank_]});
      }
      p->calls.push_back({buf, recv, S});
      return Status::OK();
    }
    case OpType::kAllreduce:
    case OpType::kBroadcast: {
      // One tensor after another; a broadcast copies in on the root only.
      HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(L.total_elems * DataTypeSize(dt), &buf));
      const bool copy_in = r.op == OpType::kAllreduce || rank_ == r.root;
      for (size_t k = 0; k < idx.size(); ++k) {
        const TensorEntry& e = g.entries[idx[k]];
        char* slot = At(buf, L.offset[k][0], dt);
        if (copy_in) p->in.descs.push_back({e.input.data, slot, L.count[k][0]});
        p->out.descs.push_back({slot, e.output.data, L.count[k][0]});
      }
      p->calls.push_back({buf, buf, L.total_elems});
      return Status::OK();
    }
    case OpType::kAlltoall:
    case OpType::kJoin:
      break;  // never fused
  }
  return Status::Error(std::string("no fused plan for ") + OpTypeName(r.op));
}

}  // namespace hvdz
