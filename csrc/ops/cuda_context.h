// The DeviceContext of one GPU: NCCL communicator, copy streams, stream-ordered
// fusion buffers, and a finalizer thread that reports finished ops.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "common/params.h"
#include "ops/copy_streams.h"
#include "ops/device_context.h"
#include "transport/nccl/nccl_communicator.h"

namespace hvdz {

// [Note: CUDA completion]
// The background thread only enqueues work on the GPU and records an event; this
// context's finalizer thread waits for the events in order and then runs the
// callbacks, so the negotiation loop never blocks on the GPU. A collective that has
// not finished within the transport timeout aborts the communicator, which turns a
// dead peer into an error instead of a hang.
class CudaContext : public DeviceContext {
 public:
  // Fused ops whose buffer has at least `copy_stream_bytes` (> 0) copy on side
  // streams: see [Note: copy streams]. `copies` belongs to the device and is shared
  // by the contexts of every process set on it (like the communicator's stream), so
  // that an op waits for another set's copy out to its tensors too.
  // `windows` (the device's owner's, outliving this context) counts the bytes of every
  // live context's allgather window.
  CudaContext(std::unique_ptr<NcclCommunicator> comm, CopyStreams& copies, Allocator& alloc, const Params& params,
              const Logger& log, std::atomic<int64_t>& windows);
  NcclCommunicator& nccl() { return *comm_; }
  ~CudaContext() override;

  Communicator& comm() override { return *comm_; }
  Status WaitForInputs(const std::vector<TensorEntry>& entries) override;
  Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage stage) override;
  Status FusionBuffer(size_t bytes, void** ptr) override;
  int64_t WindowBytes() const override { return comm_->window_bytes(); }
  Status WindowBuffer(void** ptr) override;
  void Finish(std::vector<TensorEntry> entries, const Status& s) override;
  // Every writer of an output (NCCL, or the copy-out stream after an event on it) is
  // ordered after earlier work on the NCCL stream.
  void* OutputStream() override { return comm_->stream(); }
  void Abort() override;

 private:
  struct InFlight {
    std::shared_ptr<void> done;  // the cudaEvent_t after the op's last write; shared with its handles
    std::vector<TensorEntry> entries;
    Status status;
    Clock::time_point launched;
    std::vector<std::shared_ptr<void>> buffers;  // held until done (copy streams only)
  };
  Status WaitFor(const InFlight& f);
  void FinalizerLoop();

  std::unique_ptr<NcclCommunicator> comm_;
  // Guards comm_'s error queries and its abort: Abort() comes from another thread
  // than the finalizer's, and an aborted communicator must not be queried again.
  std::mutex comm_mu_;
  Allocator& alloc_;
  double timeout_s_;
  int64_t copy_stream_bytes_;
  const Logger& log_;
  CopyStreams& copies_;
  std::atomic<int64_t>& windows_;
  std::vector<cudaEvent_t> ready_;                 // this op's input events
  std::vector<std::shared_ptr<void>> op_buffers_;  // this op's fusion buffers
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> q_;
  bool stop_ = false;
  Status broken_;
  std::thread finalizer_;
};

}  // namespace hvdz
