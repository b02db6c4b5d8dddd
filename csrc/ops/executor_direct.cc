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
// the buffer at every size. Inside a direct group, many tensors under 4 MiB share
// one fusion buffer and one call in the group (in the same check, 4 ranks: calls
// for the 45 tensors of 4 MiB and up plus one for the rest ran 1.05x the flat call,
// against 0.92x for 79 calls): their copies are small, their calls were not.
#include "ops/executor.h"

#include <algorithm>
#include <limits>

namespace hvdz {
namespace {

// Below this average tensor size the per-call cost inside a group outweighs the
// saved copies, and the fusion buffer wins.
constexpr int64_t kDirectMinBytesPerTensor = 1 << 20;
// Inside a direct group, tensors under this size (whole tensor, input or output)
// share one fusion buffer and one call instead of a call each, when there are at
// least kMinSmallToFuse of them: the buffer has fixed costs (allocation, copy
// launches) that a few calls do not. Measured on 4 H200s, streamed 64 MiB in 6
// tensors: fusing its 2 small ones dropped allgather from 0.82 to 0.71 of torch,
// while fusing the 36 small ones of 1 GiB in 79 lifted it from 0.91 to 1.02.
constexpr int64_t kOwnCallMinBytes = 4 << 20;
constexpr size_t kMinSmallToFuse = 8;

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

Status Executor::RunDirect(DeviceContext& ctx, Plan& p) {
  const Response& r = *p.group.front();
  auto t0 = Clock::now();
  // A prescaled reducescatter sends scaled copies from one scratch buffer, so its
  // small tensors cannot have a buffer of their own: all go as calls.
  const bool scratch = r.op == OpType::kReducescatter && r.prescale != 1.0;
  std::vector<size_t> small_idx;  // ascending
  if (!scratch) {
    for (size_t i = 0; i < p.entries.size(); ++i) {
      const auto& e = p.entries[i];
      if (static_cast<int64_t>(std::max(e.input.bytes(), e.output.bytes())) < kOwnCallMinBytes) small_idx.push_back(i);
    }
    if (small_idx.size() < kMinSmallToFuse) small_idx.clear();
  }
  void* scratch_buf = nullptr;
  int64_t scratch_off = 0;
  if (scratch) {
    int64_t total = 0;
    for (auto& e : p.entries) total += e.input.numel();
    HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(total * DataTypeSize(r.out_dtype), &scratch_buf));
  }
  std::vector<CopyDesc> in, out;
  std::vector<Call> calls;
  int64_t elems = 0;
  const bool reduces = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  for (size_t i = 0, next_small = 0; i < p.entries.size(); ++i) {
    if (next_small < small_idx.size() && small_idx[next_small] == i) {
      ++next_small;  // goes through the shared buffer below
      continue;
    }
    auto& e = p.entries[i];
    const int64_t n = e.input.numel();
    switch (r.op) {
      case OpType::kAllreduce:
        if (e.input.data != e.output.data || r.prescale != 1.0) in.push_back({e.input.data, e.output.data, n});
        calls.push_back({e.output.data, e.output.data, e.output.numel()});
        elems += e.output.numel();
        break;
      case OpType::kBroadcast:
        if (rank_ == r.root && e.input.data != e.output.data) in.push_back({e.input.data, e.output.data, n});
        calls.push_back({e.output.data, e.output.data, e.output.numel()});
        elems += e.output.numel();
        break;
      case OpType::kAllgather:
        if (r.dtype != r.out_dtype) {
          char* slot = At(e.output.data, n * rank_, r.out_dtype);
          in.push_back({e.input.data, slot, n});
          calls.push_back({slot, e.output.data, n});
        } else {
          calls.push_back({e.input.data, e.output.data, n});
        }
        elems += e.output.numel();
        break;
      case OpType::kReducescatter:
        if (scratch) {
          char* dst = At(scratch_buf, scratch_off, r.out_dtype);
          in.push_back({e.input.data, dst, n});
          calls.push_back({dst, e.output.data, e.output.numel()});
          scratch_off += n;
        } else {
          calls.push_back({e.input.data, e.output.data, e.output.numel()});
        }
        elems += n;
        break;
    }
    if (reduces && p.postscale != 1.0) out.push_back({e.output.data, e.output.data, e.output.numel()});
  }
  if (!small_idx.empty()) {
    Fused f;
    HVDZ_RETURN_IF_ERROR(PrepareFused(ctx, p, small_idx, &f));
    in.insert(in.end(), f.in.begin(), f.in.end());
    out.insert(out.end(), f.out.begin(), f.out.end());
    calls.push_back(f.call);
    elems += f.elems;
  }
  // The copies in share one scale (prescale for reductions), and so do the copies
  // out (postscale): the direct tensors' in-place postscale and the buffer's copy out.
  if (!in.empty()) HVDZ_RETURN_IF_ERROR(ctx.Copy(in, r.dtype, r.out_dtype, InScale(p), kBefore));
  Mark(p, "COPY_IN", t0);
  t0 = Clock::now();
  Communicator& c = ctx.comm();
  HVDZ_RETURN_IF_ERROR(c.GroupStart());
  Status s;
  for (size_t i = 0; i < calls.size() && s.ok(); ++i) s = Launch(c, p, calls[i]);
  Status end = c.GroupEnd();  // always close the group, even after a failed call
  HVDZ_RETURN_IF_ERROR(s);
  HVDZ_RETURN_IF_ERROR(end);
  Count(p, elems);  // one grouped launch
  Mark(p, "COLLECTIVE", t0);
  if (!out.empty()) {
    t0 = Clock::now();
    HVDZ_RETURN_IF_ERROR(ctx.Copy(out, r.out_dtype, r.out_dtype, OutScale(p), kAfter));
    Mark(p, "COPY_OUT", t0);
  }
  return Status::OK();
}

}  // namespace hvdz
