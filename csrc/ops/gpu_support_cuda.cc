#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "common/cuda_status.h"
#include "ops/cuda_context.h"
#include "ops/gpu_support.h"

namespace hvdz {
namespace {

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
    out->reset(new CudaContext(std::move(comm), alloc, params_, log_));
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
