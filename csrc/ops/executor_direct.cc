// [Note: direct groups]
// Copying a large tensor through the fusion buffer costs a full read and write of
// it on each side of the collective. When the communicator can launch many calls
// as one (NCCL groups) and a group has a few large tensors, each tensor gets its
// own call inside one group, reading the input and writing the output where they
// are. Only a cast or a prescale still needs a copy in (into the output's own slot
// for allgather, so the gather runs in place), and a postscale one in-place pass.
//
// Each call in a group has a cost of its own, which grows with the ranks. Measured
// with NCCL 2.28 on H200s, 1 GiB in the 79 tensors of nine Llama-1B layers as one
// group of calls against one flat call: 2 ranks 0.99-1.08x the flat call's speed,
// 4 ranks 0.92-0.99x, both well ahead of the fusion buffer's copies; on 8 ranks
// (an older build) the 79 calls added 1.4 ms and the buffer won. So by default
// (HOROVOD_ZERO_DIRECT_MAX_TENSORS unset) up to 4 ranks any number of tensors goes
// direct, and beyond that at most 16; groups whose tensors average under 1 MiB use
// the buffer at every size.
#include "ops/executor.h"

#include <limits>

namespace hvdz {
namespace {

// Below this average tensor size the per-call cost inside a group outweighs the
// saved copies, and the fusion buffer wins.
constexpr int64_t kDirectMinBytesPerTensor = 1 << 20;

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

}  // namespace

int Executor::DefaultDirectMaxTensors(int size) { return size <= 4 ? std::numeric_limits<int>::max() : 16; }

bool Executor::UseDirect(DeviceContext& ctx, const Plan& p) const {
  if (!ctx.comm().SupportsGroups() || p.entries.size() < 2 ||
      static_cast<int64_t>(p.entries.size()) > direct_max_tensors_)
    return false;
  int64_t bytes = 0;
  for (size_t i = 0; i < p.entries.size(); ++i) {
    if (!EvenSplit(*p.group[i], size_)) return false;
    bytes += static_cast<int64_t>(p.entries[i].input.bytes());
  }
  return bytes / static_cast<int64_t>(p.entries.size()) >= kDirectMinBytesPerTensor;
}

Status Executor::Grouped(DeviceContext& ctx, Plan& p, const std::vector<const void*>& send) {
  const Response& r = *p.group.front();
  Communicator& c = ctx.comm();
  HVDZ_RETURN_IF_ERROR(c.GroupStart());
  Status s;
  int64_t elems = 0;
  for (size_t i = 0; i < p.entries.size() && s.ok(); ++i) {
    auto& e = p.entries[i];
    switch (r.op) {
      case OpType::kAllreduce:
        s = c.Allreduce(e.output.data, e.output.numel(), r.out_dtype, p.op);
        elems += e.output.numel();
        break;
      case OpType::kAllgather:
        s = c.Allgather(send[i], e.output.data, e.input.numel(), r.out_dtype);
        elems += e.output.numel();
        break;
      case OpType::kReducescatter:
        s = c.ReduceScatter(send[i], e.output.data, e.output.numel(), r.out_dtype, p.op);
        elems += e.input.numel();
        break;
      case OpType::kBroadcast:
        s = c.Broadcast(e.output.data, e.output.numel(), r.out_dtype, r.root);
        elems += e.output.numel();
        break;
    }
  }
  Status end = c.GroupEnd();  // always close the group, even after a failed call
  HVDZ_RETURN_IF_ERROR(s);
  HVDZ_RETURN_IF_ERROR(end);
  Count(p, elems);  // one grouped launch
  return Status::OK();
}

Status Executor::RunDirect(DeviceContext& ctx, Plan& p) {
  const Response& r = *p.group.front();
  auto t0 = Clock::now();
  std::vector<CopyDesc> in;
  std::vector<const void*> send;
  void* scratch = nullptr;
  int64_t scratch_off = 0;
  if (r.op == OpType::kReducescatter && r.prescale != 1.0) {
    int64_t total = 0;
    for (auto& e : p.entries) total += e.input.numel();
    HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(total * DataTypeSize(r.out_dtype), &scratch));
  }
  for (auto& e : p.entries) {
    const int64_t n = e.input.numel();
    switch (r.op) {
      case OpType::kAllreduce:
        if (e.input.data != e.output.data || r.prescale != 1.0) in.push_back({e.input.data, e.output.data, n});
        break;
      case OpType::kBroadcast:
        if (rank_ == r.root && e.input.data != e.output.data) in.push_back({e.input.data, e.output.data, n});
        break;
      case OpType::kAllgather:
        if (r.dtype != r.out_dtype) {
          char* slot = At(e.output.data, n * rank_, r.out_dtype);
          in.push_back({e.input.data, slot, n});
          send.push_back(slot);
        } else {
          send.push_back(e.input.data);
        }
        break;
      case OpType::kReducescatter:
        if (scratch != nullptr) {
          char* dst = At(scratch, scratch_off, r.out_dtype);
          in.push_back({e.input.data, dst, n});
          send.push_back(dst);
          scratch_off += n;
        } else {
          send.push_back(e.input.data);
        }
        break;
    }
  }
  const double in_scale = r.op == OpType::kAllgather || r.op == OpType::kBroadcast ? 1.0 : r.prescale;
  if (!in.empty()) HVDZ_RETURN_IF_ERROR(ctx.Copy(in, r.dtype, r.out_dtype, in_scale, kBefore));
  Mark(p, "COPY_IN", t0);
  t0 = Clock::now();
  HVDZ_RETURN_IF_ERROR(Grouped(ctx, p, send));
  Mark(p, "COLLECTIVE", t0);
  const bool reduces = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  if (reduces && p.postscale != 1.0) {
    t0 = Clock::now();
    std::vector<CopyDesc> out;
    for (auto& e : p.entries) out.push_back({e.output.data, e.output.data, e.output.numel()});
    HVDZ_RETURN_IF_ERROR(ctx.Copy(out, r.out_dtype, r.out_dtype, p.postscale, kAfter));
    Mark(p, "COPY_OUT", t0);
  }
  return Status::OK();
}

}  // namespace hvdz
