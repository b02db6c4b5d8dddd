// One submitted tensor, from enqueue until its callback fires, and the allocator
// for its memory: what the runtime queues and the executor runs, so it lives below
// both.
#pragma once

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "common/message.h"
#include "common/status.h"
#include "common/timeline.h"
#include "common/types.h"

namespace hvdz {

// Allocates the output once its shape is known (allgather: after negotiation). On
// CUDA `stream` is the runtime's stream that first writes it; see [Note: output memory].
using OutputAllocator = std::function<Status(const std::vector<int64_t>& shape, void* stream, TensorDesc* out)>;
// Receives the entry's keepalive, so that the framework objects are dropped on a
// framework thread (Python tensors: with the GIL) instead of the background thread.
using DoneCallback = std::function<void(const Status&, std::shared_ptr<void> keepalive)>;
// Alltoall: told, once negotiated, how many rows this rank receives from each rank.
using SplitsCallback = std::function<void(const std::vector<int64_t>& received)>;
// CUDA: told once the entry's work is queued on the GPU; its outputs are ready once
// `event` (a cudaEvent_t, kept alive by the pointer) has completed.
using LaunchedCallback = std::function<void(std::shared_ptr<void> event)>;

struct TensorEntry {
  Request request;
  TensorDesc input;
  TensorDesc output;                // set by the caller, or by allocate_output
  OutputAllocator allocate_output;  // set when the caller passed no output
  SplitsCallback received_splits;   // alltoall
  std::shared_ptr<void> ready_event;  // CUDA: recorded on the producer's stream at enqueue
  std::shared_ptr<void> keepalive;    // framework objects that must outlive the collective
  DoneCallback callback;             // set by Runtime::Enqueue: marks the entry's handle done
  LaunchedCallback launched;         // set by Runtime::Enqueue for CUDA entries
  Clock::time_point enqueued;
};

// Reports `s` for `e` once its work is finished, handing over its keepalive.
inline void Complete(TensorEntry& e, const Status& s) {
  if (e.callback) e.callback(s, std::move(e.keepalive));
}

// Memory for outputs and fusion buffers, provided by the framework adapter so that
// device memory is accounted where the user looks for it.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Status Allocate(int device, DataType dtype, const std::vector<int64_t>& shape,
                          TensorDesc* out, std::shared_ptr<void>* holder) = 0;
  // `bytes` of device scratch tied to `stream`: once `holder` is dropped the memory may
  // go only to later work on that stream, so it can be dropped as soon as the work
  // using it is queued, without waiting for it to run.
  virtual Status AllocateOnStream(int device, int64_t bytes, void* stream, TensorDesc* out,
                                  std::shared_ptr<void>* holder) = 0;
  // Zero-filled memory; on CUDA allocated and filled in order on `stream`. This
  // default serves host memory only.
  virtual Status AllocateZeros(int device, DataType dtype, const std::vector<int64_t>& shape, void* stream,
                               TensorDesc* out, std::shared_ptr<void>* holder) {
    (void)stream;
    if (device != kCpuDevice) return Status::Error("This allocator cannot zero device memory.");
    HVDZ_RETURN_IF_ERROR(Allocate(device, dtype, shape, out, holder));
    if (out->bytes() > 0) std::memset(out->data, 0, out->bytes());
    return Status::OK();
  }
};

}  // namespace hvdz
