#include "ops/cuda_context.h"

#include <algorithm>

#include "common/cuda_status.h"
#include "common/thread_affinity.h"
#include "common/thread_timing.h"
#include "cuda/batched_copy.h"

namespace hvdz {

CudaContext::CudaContext(Lane main, Lane gathers, Allocator& alloc, const Params& params, const Logger& log,
                         std::atomic<int64_t>& windows, std::atomic<int>& lanes)
    : lanes_{std::move(main), std::move(gathers)},
      alloc_(alloc),
      timeout_s_(params.transport_timeout_seconds),
      copy_stream_bytes_(params.copy_stream_bytes),
      thread_cpus_(params.thread_cpus),
      log_(log),
      windows_(windows),
      gather_lanes_(lanes) {
  windows_ += WindowsHeld();
  if (lanes_[1].comm) ++gather_lanes_;
  finalizer_ = std::thread([this] {
    UseFineTimerSlack();
    WarnIfUnpinned(PinThisThread(thread_cpus_), "hvdz-finalize", thread_cpus_, log_);
    NameThisThread("hvdz-finalize");
    FinalizerLoop();
  });
}

CudaContext::~CudaContext() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  finalizer_.join();  // every queued op has finished (or failed) by now
  windows_ -= WindowsHeld();
  if (lanes_[1].comm) --gather_lanes_;
}

int64_t CudaContext::WindowsHeld() const {
  return lanes_[0].comm->window_bytes() + (lanes_[1].comm ? lanes_[1].comm->window_bytes() : 0);
}

Status CudaContext::WaitForInputs(const std::vector<TensorEntry>& entries) {
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(lane().comm->device()), "cudaSetDevice"));
  HVDZ_RETURN_IF_ERROR(lane().copies->OrderAfterPendingWrites(entries));
  ready_.clear();
  for (const auto& e : entries) {
    auto ev = static_cast<cudaEvent_t>(e.ready_event.get());
    if (ev == nullptr || std::find(ready_.begin(), ready_.end(), ev) != ready_.end()) continue;
    ready_.push_back(ev);
    HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream(), ev, 0), "cudaStreamWaitEvent"));
  }
  return Status::OK();
}

Status CudaContext::Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale,
                         CopyStage stage) {
  if (!BatchedCopySupported(src, dst))
    return Status::InvalidArgument(std::string("No CUDA cast from ") + DataTypeName(src) + " to " + DataTypeName(dst) + ".");
  cudaStream_t s = stream();
  CopyStreams& copies = *lane().copies;
  const bool before = stage == CopyStage::kBeforeCollective;
  if (copies.active()) {
    HVDZ_RETURN_IF_ERROR(before ? copies.BeforeStream(ready_, &s) : copies.AfterStream(descs, DataTypeSize(dst), &s));
  }
  HVDZ_RETURN_IF_ERROR(CudaStatus(LaunchBatchedCopy(descs.data(), static_cast<int>(descs.size()), src, dst, scale, s),
                                  "batched copy kernel"));
  return copies.active() && before ? copies.BeforeLaunched() : Status::OK();
}

// [Note: stream-ordered fusion buffer]
// An op on the NCCL stream alone takes its buffer from torch's caching allocator,
// tied to that stream, and drops it once its work is queued: later work on the
// stream is ordered after it, so nothing waits. The memory stays cached (no cudaMalloc per
// op) but counts as allocated only while an op is in flight, as FSDP2's
// communication buffers do, instead of adding a buffer's size to every peak.
Status CudaContext::FusionBuffer(size_t bytes, void** ptr) {
  cudaStream_t stream;
  const bool side = copy_stream_bytes_ > 0 && static_cast<int64_t>(bytes) >= copy_stream_bytes_;
  HVDZ_RETURN_IF_ERROR(lane().copies->Begin(side, &stream));
  TensorDesc d;
  std::shared_ptr<void> holder;
  HVDZ_RETURN_IF_ERROR(
      alloc_.AllocateOnStream(lane().comm->device(), static_cast<int64_t>(bytes), stream, &d, &holder));
  op_buffers_.push_back(std::move(holder));
  *ptr = d.data;
  return Status::OK();
}

// One window per communicator, reused by op after op: its copy in, allgather and copy
// out all stay on the collective stream, so an op's copy in cannot overwrite what an
// earlier op has yet to copy out.
Status CudaContext::WindowBuffer(void** ptr) {
  cudaStream_t stream;
  HVDZ_RETURN_IF_ERROR(lane().copies->Begin(false, &stream));
  *ptr = lane().comm->window();
  return Status::OK();
}

void CudaContext::Finish(std::vector<TensorEntry> entries, const Status& s) {
  cudaStream_t last;
  CopyStreams& copies = *lane().copies;
  const bool side = copies.active();
  Status end = copies.End(&last);
  InFlight f{nullptr, lane().comm.get(), std::move(entries), s.ok() ? end : s, Clock::now(), {}};
  lane_ = 0;  // until the next BeginOp: a stand-in's zeros (runtime_join.cc) go on the main lane
  cudaEvent_t ev = nullptr;
  Status rec = CudaStatus(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  if (ev != nullptr) f.done = std::shared_ptr<void>(ev, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  if (rec.ok()) rec = CudaStatus(cudaEventRecord(ev, last), "cudaEventRecord");
  if (!rec.ok() && f.status.ok()) f.status = rec;
  // A caller may now order its own stream after the event instead of waiting for the op
  // to run; the handle keeps the event alive past the finalizer.
  if (f.status.ok())
    for (auto& e : f.entries)
      if (e.launched) e.launched(f.done);
  // One stream: dropped now, see [Note: stream-ordered fusion buffer]. Three streams:
  // dropped by the finalizer once the op is done, see [Note: copy streams].
  if (side) f.buffers = std::move(op_buffers_);
  op_buffers_.clear();
  {
    std::lock_guard<std::mutex> lk(mu_);
    q_.push_back(std::move(f));
  }
  cv_.notify_one();
}

void CudaContext::Abort() {
  std::lock_guard<std::mutex> lk(comm_mu_);
  AbortLanes();
}

Status CudaContext::LanesAsyncError() {
  for (auto& l : lanes_)
    if (l.comm) HVDZ_RETURN_IF_ERROR(l.comm->AsyncError());
  return Status::OK();
}

// Both lanes at once: a kernel of the other lane may be waiting for the same dead peer.
void CudaContext::AbortLanes() {
  for (auto& l : lanes_)
    if (l.comm) l.comm->Abort();
}

Status CudaContext::WaitFor(const InFlight& f) {
  if (f.done == nullptr) return Status::OK();
  cudaSetDevice(f.comm->device());
  while (true) {
    cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(f.done.get()));
    if (q == cudaSuccess) return Status::OK();
    if (q != cudaErrorNotReady) return CudaStatus(q, "cudaEventQuery");
    std::unique_lock<std::mutex> comm_lock(comm_mu_);
    if (f.comm->aborted())
      return Status::Aborted("NCCL collective for '" + f.entries.front().request.name +
                             "' was cut short: a peer failed and this rank's communicator was aborted.");
    // Either lane's: a dead peer may show on the other communicator first.
    Status async = LanesAsyncError();
    if (!async.ok()) {
      AbortLanes();
      return async;
    }
    comm_lock.unlock();
    const double waited_s = std::chrono::duration<double>(Clock::now() - f.launched).count();
    if (waited_s > timeout_s_) {
      std::lock_guard<std::mutex> again(comm_mu_);
      AbortLanes();
      return Status::Aborted("NCCL collective for '" + f.entries.front().request.name +
                             "' did not finish within HOROVOD_GLOO_TIMEOUT_SECONDS=" +
                             std::to_string(static_cast<int>(timeout_s_)) +
                             " s; a peer may have died. The NCCL communicator was aborted.");
    }
    // A small op is done within tens of microseconds of its launch: yield until then
    // rather than sleep past it; longer ones are polled every 20 us.
    if (waited_s < 50e-6) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CudaContext::FinalizerLoop() {
  while (true) {
    InFlight f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stop_ and drained
      f = std::move(q_.front());
      q_.pop_front();
    }
    Status s = f.status.ok() ? (broken_.ok() ? WaitFor(f) : broken_) : f.status;
    if (!s.ok() && s.type() == StatusType::kAborted) broken_ = s;
    f.done.reset();  // destroyed here unless a handle still holds it
    f.buffers.clear();  // before the callbacks: a synchronized op holds no buffer
    for (auto& e : f.entries) Complete(e, s);
  }
}

}  // namespace hvdz
