#include <cuda_runtime.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "cuda/batched_copy.h"
#include "ops/gpu_support.h"
#include "transport/nccl/nccl_communicator.h"

namespace hvdz {
namespace {

cudaEvent_t AsEvent(const std::shared_ptr<void>& p) { return static_cast<cudaEvent_t>(p.get()); }

// Sets the calling thread's device for the lifetime of the guard.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    changed_ = prev_ != device;
    if (changed_) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);  // on the enqueue path: skip the call when nothing changed
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// [Note: CUDA completion]
// The background thread only enqueues work on the NCCL stream and records an
// event; this context's finalizer thread waits for the events in order and then
// runs the callbacks, so the negotiation loop never blocks on the GPU. A
// collective that has not finished within the transport timeout aborts the
// communicator, which turns a dead peer into an error instead of a hang.
class CudaContext : public DeviceContext {
 public:
  CudaContext(std::unique_ptr<NcclCommunicator> comm, Allocator& alloc, double timeout_s, const Logger& log)
      : comm_(std::move(comm)), alloc_(alloc), timeout_s_(timeout_s), log_(log) {
    finalizer_ = std::thread([this] { FinalizerLoop(); });
  }

  ~CudaContext() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    finalizer_.join();
  }

  Communicator& comm() override { return *comm_; }

  Status WaitForInputs(const std::vector<TensorEntry>& entries) override {
    HVDZ_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(comm_->device()), "cudaSetDevice"));
    std::unordered_set<void*> seen;
    for (const auto& e : entries) {
      if (!e.ready_event || !seen.insert(e.ready_event.get()).second) continue;
      HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(comm_->stream(), AsEvent(e.ready_event), 0),
                                      "cudaStreamWaitEvent"));
    }
    return Status::OK();
  }

  Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale) override {
    if (!BatchedCopySupported(src, dst))
      return Status::InvalidArgument(std::string("No CUDA cast from ") + DataTypeName(src) + " to " + DataTypeName(dst) + ".");
    return CudaStatus(LaunchBatchedCopy(descs.data(), static_cast<int>(descs.size()), src, dst, scale, comm_->stream()),
                      "batched copy kernel");
  }

  // [Note: stream-ordered fusion buffer]
  // Each op takes its buffer from torch's caching allocator, tied to the NCCL stream,
  // and drops it once its work is queued: later work on that stream is ordered after
  // it, so nothing waits. The memory stays cached (no cudaMalloc per op) but counts as
  // allocated only while an op is in flight, as FSDP2's communication buffers do,
  // instead of adding a buffer's size to every peak of the job.
  Status FusionBuffer(size_t bytes, void** ptr) override {
    TensorDesc d;
    std::shared_ptr<void> holder;
    HVDZ_RETURN_IF_ERROR(alloc_.AllocateOnStream(comm_->device(), static_cast<int64_t>(bytes), comm_->stream(), &d, &holder));
    op_buffers_.push_back(std::move(holder));
    *ptr = d.data;
    return Status::OK();
  }

  void Finish(std::vector<TensorEntry> entries, const Status& s) override {
    InFlight f{nullptr, std::move(entries), s, Clock::now()};
    Status rec = CudaStatus(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming), "cudaEventCreate");
    if (rec.ok()) rec = CudaStatus(cudaEventRecord(f.done, comm_->stream()), "cudaEventRecord");
    if (!rec.ok() && f.status.ok()) f.status = rec;
    op_buffers_.clear();  // the op's work is queued: see [Note: stream-ordered fusion buffer]
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }

 private:
  struct InFlight {
    cudaEvent_t done;
    std::vector<TensorEntry> entries;
    Status status;
    Clock::time_point launched;
  };

  Status WaitFor(const InFlight& f) {
    if (f.done == nullptr) return Status::OK();
    cudaSetDevice(comm_->device());
    while (true) {
      cudaError_t q = cudaEventQuery(f.done);
      if (q == cudaSuccess) return Status::OK();
      if (q != cudaErrorNotReady) return CudaStatus(q, "cudaEventQuery");
      Status async = comm_->AsyncError();
      if (!async.ok()) {
        comm_->Abort();
        return async;
      }
      if (std::chrono::duration<double>(Clock::now() - f.launched).count() > timeout_s_) {
        comm_->Abort();
        return Status::Aborted("NCCL collective for '" + f.entries.front().request.name +
                               "' did not finish within HOROVOD_GLOO_TIMEOUT_SECONDS=" +
                               std::to_string(static_cast<int>(timeout_s_)) +
                               " s; a peer may have died. The NCCL communicator was aborted.");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  void FinalizerLoop() {
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
      if (f.done) cudaEventDestroy(f.done);
      for (auto& e : f.entries)
        if (e.callback) e.callback(s);
    }
  }

  std::unique_ptr<NcclCommunicator> comm_;
  Allocator& alloc_;
  double timeout_s_;
  const Logger& log_;
  std::vector<std::shared_ptr<void>> op_buffers_;  // this op's fusion buffers
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> q_;
  bool stop_ = false;
  Status broken_;
  std::thread finalizer_;
};

class CudaSupport : public GpuSupport {
 public:
  CudaSupport(const Params& p, const Logger& log) : params_(p), log_(log) {}

  ~CudaSupport() override {
    for (auto ev : free_events_) cudaEventDestroy(ev);
  }

  Status RecordReadyEvent(int device, void* stream, std::shared_ptr<void>* event) override {
    DeviceGuard g(device);
    cudaEvent_t ev = TakeEvent();
    if (ev == nullptr)
      HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"));
    // Back to the pool when the last entry using it is done: creating an event
    // per enqueue would cost microseconds on the framework thread.
    std::shared_ptr<void> holder(ev, [this](void* e) { ReturnEvent(static_cast<cudaEvent_t>(e)); });
    HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), "cudaEventRecord"));
    *event = std::move(holder);
    return Status::OK();
  }

  Status CreateContext(int device, ControlPlane& cp, Allocator& alloc, std::unique_ptr<DeviceContext>* out) override {
    std::unique_ptr<NcclCommunicator> comm;
    HVDZ_RETURN_IF_ERROR(NcclCommunicator::Create(device, cp, &comm));
    out->reset(new CudaContext(std::move(comm), alloc, params_.transport_timeout_seconds, log_));
    return Status::OK();
  }

 private:
  cudaEvent_t TakeEvent() {
    std::lock_guard<std::mutex> lk(pool_mu_);
    if (free_events_.empty()) return nullptr;
    cudaEvent_t ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  void ReturnEvent(cudaEvent_t ev) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    free_events_.push_back(ev);
  }

  Params params_;
  const Logger& log_;
  std::mutex pool_mu_;
  std::vector<cudaEvent_t> free_events_;  // one device per process, so one pool
};

}  // namespace

std::unique_ptr<GpuSupport> MakeGpuSupport(const Params& params, const Logger& log) {
  int n = 0;
  // A CUDA build on a machine without GPUs still runs CPU collectives.
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return nullptr;
  }
  return std::unique_ptr<GpuSupport>(new CudaSupport(params, log));
}

}  // namespace hvdz
