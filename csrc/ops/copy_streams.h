// [Note: copy streams]
// A fused op copies into its buffer, runs the collective, and copies out of it. On
// one stream those three run in line, and the NCCL stream idles during every copy.
// A fused op with a large buffer instead copies in on one side stream and out on
// another, with event waits around the collective, so the NCCL stream runs one
// collective after another: while op k+1's collective runs, op k's copy out and
// op k+2's copy in run beside it.
//
// What that changes, and how it is kept safe:
// - The buffer comes from the copy-in stream's pool and is dropped only once the
//   op is done (the finalizer sees its event), so no stream can still be using it
//   when the caching allocator hands it out again, and torch's memory statistics
//   count it for as long as it is in use. Two such ops in flight hold two buffers,
//   where one stream reused one.
// - A copy out may still be writing an op's outputs when a later op starts. A later
//   op that reads or writes any of those bytes (an in-place op on the same tensor)
//   first waits for that copy out; one stream gave that order for free.
// - Small ops stay on the NCCL stream: the event waits would cost more than the
//   copies they overlap.
// - With a second collective stream (the gather lane, [Note: the gather lane] in
//   ops/cuda_context.h) the two streams' copy streams are siblings: every op, fused or
//   not, is pending on its stream until it is done, for all the bytes of its tensors,
//   and an op on the other stream that touches any of them waits for it, as one
//   stream would have ordered them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "common/copy_desc.h"
#include "common/status.h"
#include "common/tensor_entry.h"

namespace hvdz {

class CopyStreams {
 public:
  // `collective`: the NCCL stream. The side streams are created on first use, on
  // the device current then (the caller's).
  explicit CopyStreams(cudaStream_t collective) : collective_(collective) {}
  ~CopyStreams();  // the caller has waited for all queued work
  // The copy streams of the device's other collective stream (the gather lane's, see
  // [Note: the gather lane] in ops/cuda_context.h), whose copies out this one's ops
  // also wait for; it outlives this object or is unset first.
  void set_sibling(const CopyStreams* other) { sibling_ = other; }

  // Start of every op: the collective stream (and this op's copy in, if it has one)
  // waits for earlier copies out still writing any of the op's tensors, its sibling's too.
  Status OrderAfterPendingWrites(const std::vector<TensorEntry>& entries);
  // For an op with a fusion buffer: `use` says whether it takes the side streams
  // (false: everything stays on the collective stream); returns the stream the
  // buffer must come from.
  Status Begin(bool use, cudaStream_t* buffer_stream);
  bool active() const { return active_; }
  // The stream for a copy before the collective; `ready` are the inputs' events.
  Status BeforeStream(const std::vector<cudaEvent_t>& ready, cudaStream_t* s);
  // After the launch on BeforeStream: the collective waits for it.
  Status BeforeLaunched();
  // The stream for a copy after the collective, which writes `written`.
  Status AfterStream(const std::vector<CopyDesc>& written, size_t elem_bytes, cudaStream_t* s);
  // End of the op: the stream whose completion means the op is done.
  Status End(cudaStream_t* last);

 private:
  using Range = std::pair<uintptr_t, uintptr_t>;
  struct PendingWrites {
    cudaEvent_t done;
    std::vector<Range> ranges;
  };
  Status Open();
  void Prune();

  Status WaitForOverlapping(const std::deque<PendingWrites>& pending, const std::vector<TensorEntry>& entries);

  cudaStream_t collective_;
  const CopyStreams* sibling_ = nullptr;
  cudaStream_t in_ = nullptr;
  cudaStream_t out_ = nullptr;
  cudaEvent_t in_done_ = nullptr;
  cudaEvent_t coll_done_ = nullptr;
  bool active_ = false;
  bool wrote_after_ = false;
  std::vector<cudaEvent_t> waits_;  // pending writes this op's copy in must wait for
  std::vector<Range> written_;      // this op's copies out
  std::vector<Range> touched_;      // with a sibling: every tensor of this op
  std::deque<PendingWrites> pending_;
};

}  // namespace hvdz
