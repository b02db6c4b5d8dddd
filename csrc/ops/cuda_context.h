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
//
// [Note: the gather lane]
// On one collective stream a gather queues behind the reductions issued before it:
// ZeRO-2's gathers of the new parameters waited for backward's last reduce-scatter
// (the tied embedding's), and stage 3's prefetches in backward for the reduce-scatters
// of the units after them. With HOROVOD_ZERO_GATHER_STREAM=1 a context has two lanes:
// CUDA allgathers run on a second communicator (a split of the first, the same ranks)
// and the device's second collective stream, and every other op on the first.
// - Agreement: the split is made with the context, only where every rank of the set
//   asked for it on a large enough GPU and every rank's split worked (agreed over the
//   control plane; a set split from another splits the parent's gather communicator),
//   so no rank runs a gather on a lane that another lacks.
// - Order between lanes: an op waits for its inputs' ready events on its own lane, as
//   before; two ops on the same bytes are ordered by the caller (synchronize, or a
//   stream wait on the first op's event before the second is enqueued), which is
//   Horovod's contract, and by the copy streams, whose siblings keep every op pending
//   for all its tensors' bytes until it is done ([Note: copy streams]).
// - Deadlock: NCCL kernels of two communicators may now run at the same time. Every
//   rank issues them in the same order, and a kernel only waits for its peers' kernel
//   of the same communicator, so both can always make progress if both fit on the
//   GPU at once; the gather lane's kernels are capped at a quarter of the SMs, which
//   leaves room beside the other lane's (at most 64 CTAs) on GPUs of 128 SMs or more.
//   Smaller GPUs keep one lane.
// - Each lane has its own copy streams, so a gather's copy in does not queue behind
//   a reduction's copy in that waits for backward. The finalizer still sees ops in
//   the order issued: an op on the faster lane is reported no earlier than the ops
//   issued before it.
class CudaContext : public DeviceContext {
 public:
  // One lane's communicator and copy streams.
  struct Lane {
    std::unique_ptr<NcclCommunicator> comm;
    CopyStreams* copies = nullptr;
  };
  // Fused ops whose buffer has at least `copy_stream_bytes` (> 0) copy on side
  // streams: see [Note: copy streams]. A lane's copies belong to the device and are
  // shared by the contexts of every process set on it (like the communicator's
  // stream), so that an op waits for another set's copy out to its tensors too.
  // `gathers` (its comm null: one lane) takes the CUDA allgathers. `lanes` (the
  // device's owner's, outliving this context) counts the live contexts with two lanes.
  // `windows` (the device's owner's, outliving this context) counts the bytes of every
  // live context's allgather window.
  CudaContext(Lane main, Lane gathers, Allocator& alloc, const Params& params, const Logger& log,
              std::atomic<int64_t>& windows, std::atomic<int>& lanes);
  NcclCommunicator& nccl() { return *lanes_[0].comm; }
  // The gather lane's communicator, or nullptr.
  NcclCommunicator* gather_nccl() { return lanes_[1].comm.get(); }
  ~CudaContext() override;

  Status BeginOp(OpType op) override {
    lane_ = op == OpType::kAllgather && lanes_[1].comm ? 1 : 0;
    return Status::OK();
  }
  Communicator& comm() override { return *lane().comm; }
  Status WaitForInputs(const std::vector<TensorEntry>& entries) override;
  Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage stage) override;
  Status FusionBuffer(size_t bytes, void** ptr) override;
  int64_t WindowBytes() const override { return lanes_[lane_].comm->window_bytes(); }
  Status WindowBuffer(void** ptr) override;
  int64_t WindowsHeld() const;  // both lanes' windows, for runtime_info()
  void Finish(std::vector<TensorEntry> entries, const Status& s) override;
  // Every writer of an output (NCCL, or the copy-out stream after an event on it) is
  // ordered after earlier work on the NCCL stream.
  void* OutputStream() override { return lane().comm->stream(); }
  void Abort() override;

 private:
  Lane& lane() { return lanes_[lane_]; }
  cudaStream_t stream() { return lane().comm->stream(); }
  struct InFlight {
    std::shared_ptr<void> done;  // the cudaEvent_t after the op's last write; shared with its handles
    NcclCommunicator* comm;      // its lane's
    std::vector<TensorEntry> entries;
    Status status;
    Clock::time_point launched;
    std::vector<std::shared_ptr<void>> buffers;  // held until done (copy streams only)
  };
  Status WaitFor(const InFlight& f);
  void AbortLanes();  // comm_mu_ held
  Status LanesAsyncError();  // comm_mu_ held
  void FinalizerLoop();

  Lane lanes_[2];
  int lane_ = 0;  // the op's, from BeginOp to Finish (background thread)
  // Guards the communicators' error queries and their abort: Abort() comes from another
  // thread than the finalizer's, and an aborted communicator must not be queried again.
  std::mutex comm_mu_;
  Allocator& alloc_;
  double timeout_s_;
  int64_t copy_stream_bytes_;
  std::vector<int> thread_cpus_;  // HOROVOD_THREAD_AFFINITY: where the finalizer runs
  const Logger& log_;
  std::atomic<int64_t>& windows_;
  std::atomic<int>& gather_lanes_;
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
