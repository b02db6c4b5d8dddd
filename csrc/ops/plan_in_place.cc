// One tensor without a fusion buffer: allreduce and broadcast run in its output,
// allgather gathers into its output, reducescatter and alltoall read its input and
// write its output. A copy in only where the input is not already what the call needs, a
// postscale as one in-place pass. Used by a lone tensor and by each large tensor
// of a direct group (see [Note: direct groups]).
#include "fusion/fusion_plan.h"
#include "ops/planner.h"

namespace hvdz {

bool Planner::LoneInPlace(const Group& g) const {
  const Response& r = g.head();
  // A prescaled reducescatter would need a scaled copy of its input: the fusion
  // buffer is that copy.
  return g.entries.size() == 1 && EvenSplit(r, size_) && !(r.op == OpType::kReducescatter && r.prescale != 1.0);
}

void Planner::AppendInPlace(const Group& g, const TensorEntry& e, bool gather_in_place, char* scaled_send,
                            Program* p) const {
  const Response& r = g.head();
  const int64_t n = e.input.numel();
  const bool cast = r.dtype != r.out_dtype;
  void* const out = e.output.data;
  switch (r.op) {
    case OpType::kAllreduce:
      if (e.input.data != out || r.prescale != 1.0 || cast) p->in.descs.push_back({e.input.data, out, n});
      p->calls.push_back({out, out, e.output.numel()});
      p->elems += e.output.numel();
      break;
    case OpType::kBroadcast:
      // Only the root's input matters: the others receive into their output.
      if (rank_ == r.root && (e.input.data != out || cast)) p->in.descs.push_back({e.input.data, out, n});
      p->calls.push_back({out, out, e.output.numel()});
      p->elems += e.output.numel();
      break;
    case OpType::kAllgather:
      if (cast || gather_in_place) {
        // The input lands in its own slot of the output, which is gathered in place; an
        // input that is that slot already (ZeRO's step writes it there) needs no copy.
        char* slot = At(out, n * rank_, r.out_dtype);
        if (cast || e.input.data != slot) p->in.descs.push_back({e.input.data, slot, n});
        p->calls.push_back({slot, out, n});
      } else {
        p->calls.push_back({e.input.data, out, n});
      }
      p->elems += n * size_;
      break;
    case OpType::kReducescatter:
      if (scaled_send != nullptr) {
        p->in.descs.push_back({e.input.data, scaled_send, n});
        p->calls.push_back({scaled_send, out, e.output.numel()});
      } else {
        p->calls.push_back({e.input.data, out, e.output.numel()});
      }
      p->elems += e.output.numel() * size_;
      break;
    case OpType::kAlltoall: {
      const int64_t row = RowElems(r.shape);
      CollectiveCall k{e.input.data, out, 0};
      for (auto rows : SentSplits(r, size_, rank_)) k.send_counts.push_back(rows * row);
      for (auto rows : ReceivedSplits(r, size_, rank_)) k.recv_counts.push_back(rows * row);
      for (auto rows : r.splits) p->elems += rows * row;  // every rank's part, as for the other ops
      p->calls.push_back(std::move(k));
      break;
    }
    case OpType::kJoin:
      break;
  }
  // Plan() gave the copies out a scale other than 1 only for a reduction's postscale.
  if (p->out.scale != 1.0) p->out.descs.push_back({out, out, e.output.numel()});
}

}  // namespace hvdz
