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
//
// On CPU, Gloo's reducescatter and allgather are rings of sends that take a whole
// group through each step together ([Note: rings over Gloo's sends]), so a direct
// group of them is one launch with no copies. Gloo's broadcast and allreduce cannot
// be grouped, so a direct broadcast group's calls run one after another, and
// allreduce stays fused: Gloo's ring over one large buffer beats several calls by
// more than the copies cost. Measured on 2 CPU ranks of a shared 2-core machine, 8
// tensors each (median ms, fused -> direct, calls one after another, before the
// rings): allgather 4 MiB 93-109 -> 46-48, 16 MiB 511-543 -> 360-378; reducescatter
// 4 MiB 50 -> 43-44, 16 MiB 192-195 -> 129-137; broadcast 4 MiB 25 -> 16, 16 MiB
// 70-89 -> 47-48; allreduce 4 MiB 35-36 -> 44-45, 16 MiB 128-132 -> 137-169. So a
// ZeRO step on CPU holds no fusion buffer the size of its gradient buckets or of its
// initial broadcast (examples/bench_memory_cpu.py).
#include <algorithm>
#include <limits>

#include "ops/planner.h"

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

}  // namespace

int Planner::DefaultDirectMaxTensors(int size) { return size <= 4 ? std::numeric_limits<int>::max() : 16; }

bool Planner::UseDirect(DeviceContext& ctx, const Group& g) const {
  if (g.entries.size() < 2 || static_cast<int64_t>(g.entries.size()) > direct_max_tensors_) return false;
  const OpType op = g.head().op;
  if (!ctx.comm().Groups(op) && op == OpType::kAllreduce) return false;  // Gloo's ring wins, see the note
  int64_t bytes = 0;
  for (size_t i = 0; i < g.entries.size(); ++i) {
    if (!EvenSplit(*g.responses[i], size_)) return false;
    bytes += static_cast<int64_t>(g.entries[i].input.bytes());
  }
  return bytes / static_cast<int64_t>(g.entries.size()) >= kDirectMinBytesPerTensor;
}

Status Planner::PlanDirect(DeviceContext& ctx, const Group& g, Program* p) const {
  const Response& r = g.head();
  p->grouped = ctx.comm().Groups(r.op);  // else (Gloo's broadcast) the calls run one after another
  // A prescaled reducescatter sends scaled copies from one scratch buffer, so its
  // small tensors cannot have a buffer of their own: all go as calls.
  const bool scratch = r.op == OpType::kReducescatter && r.prescale != 1.0;
  std::vector<size_t> small_idx;  // ascending
  if (!scratch) {
    for (size_t i = 0; i < g.entries.size(); ++i) {
      const auto& e = g.entries[i];
      if (static_cast<int64_t>(std::max(e.input.bytes(), e.output.bytes())) < kOwnCallMinBytes) small_idx.push_back(i);
    }
    if (small_idx.size() < kMinSmallToFuse) small_idx.clear();
  }
  void* scratch_buf = nullptr;
  int64_t scratch_off = 0;
  if (scratch) {
    int64_t total = 0;
    for (auto& e : g.entries) total += e.input.numel();
    HVDZ_RETURN_IF_ERROR(ctx.FusionBuffer(total * DataTypeSize(r.out_dtype), &scratch_buf));
  }
  // The copies in share one scale (prescale for reductions), and so do the copies
  // out (postscale): the direct tensors' in-place postscale and the buffer's copy out.
  for (size_t i = 0, next_small = 0; i < g.entries.size(); ++i) {
    if (next_small < small_idx.size() && small_idx[next_small] == i) {
      ++next_small;  // goes through the shared buffer below
      continue;
    }
    const auto& e = g.entries[i];
    char* scaled_send = scratch ? At(scratch_buf, scratch_off, r.out_dtype) : nullptr;
    if (scratch) scratch_off += e.input.numel();
    AppendInPlace(g, e, /*gather_in_place=*/false, scaled_send, p);
  }
  if (!small_idx.empty()) HVDZ_RETURN_IF_ERROR(AppendFused(ctx, g, small_idx, p));
  return Status::OK();
}

}  // namespace hvdz
