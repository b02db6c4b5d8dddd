#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
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

// See [Note: the gather lane] in ops/cuda_context.h: a quarter of the SMs for the gather
// lane's kernels plus NCCL's most CTAs (64) for the other lane's, with room to spare.
constexpr int kGatherLaneMinSms = 128;

class CudaSupport : public GpuSupport {
 public:
  CudaSupport(const Params& p, const Logger& log, int count) : params_(p), log_(log), count_(count) {}

  // After every context: the runtime drops its process sets first.
  ~CudaSupport() override {
    for (auto& kv : free_events_)
      for (auto ev : kv.second) cudaEventDestroy(ev);
    for (auto& kv : devices_) {
      kv.second.gather_copies.reset();  // holds a pointer to the other
      kv.second.copies.reset();
      cudaStreamDestroy(kv.second.stream);
      if (kv.second.gather_stream) cudaStreamDestroy(kv.second.gather_stream);
    }
  }

  Status RecordReadyEvent(int device, void* stream, std::shared_ptr<void>* event) override {
    DeviceGuard g(device);
    cudaEvent_t ev = TakeEvent(device);
    if (ev == nullptr)
      HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"));
    // Back to the pool when the last entry using it is done: creating an event
    // per enqueue would cost microseconds on the framework thread.
    std::shared_ptr<void> holder(ev, [this, device](void* e) { ReturnEvent(device, static_cast<cudaEvent_t>(e)); });
    HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), "cudaEventRecord"));
    *event = std::move(holder);
    return Status::OK();
  }

  int device_count() const override { return count_; }
  int64_t window_bytes() const override { return window_bytes_.load(); }
  int gather_lanes() const override { return gather_lanes_.load(); }

  Status CreateContext(int device, ControlPlane& cp, Allocator& alloc, std::unique_ptr<DeviceContext>* out) override {
    Device* d = nullptr;
    HVDZ_RETURN_IF_ERROR(DeviceOf(device, &d));
    std::unique_ptr<NcclCommunicator> comm;
    HVDZ_RETURN_IF_ERROR(NcclCommunicator::Create(device, cp, d->stream, params_.ce_allgather_bytes, &comm));
    std::unique_ptr<NcclCommunicator> gathers;
    HVDZ_RETURN_IF_ERROR(OpenGatherComm(*d, cp, *comm, &gathers));
    // The window belongs to the communicator that runs the allgathers: the gather lane's
    // where every rank has one, else the main one. Every rank takes the same branch. The
    // main one asks for no CTAs either way: the lane is settled only after it is made.
    NcclCommunicator& owner = gathers ? *gathers : *comm;
    if (comm->agreed_window() > 0) HVDZ_RETURN_IF_ERROR(owner.OpenWindow(cp, comm->agreed_window()));
    if (params_.ce_allgather_bytes > 0 && owner.window() == nullptr)
      HVDZ_LOG(log_, kWarning) << "HOROVOD_ZERO_CE_ALLGATHER_BYTES is set, but allgathers on cuda:" << device
                               << " keep NCCL's kernels: "
                               << (owner.window_note().empty() ? comm->window_note() : owner.window_note()) << ".";
    *out = NewContext(*d, std::move(comm), std::move(gathers), alloc);
    return Status::OK();
  }

  Status SplitContext(DeviceContext& parent, int set_rank, Allocator& alloc,
                      std::unique_ptr<DeviceContext>* out) override {
    auto& from = static_cast<CudaContext&>(parent);  // every CUDA context is made here
    Device* d = nullptr;
    HVDZ_RETURN_IF_ERROR(DeviceOf(from.nccl().device(), &d));
    std::unique_ptr<NcclCommunicator> comm;
    HVDZ_RETURN_IF_ERROR(NcclCommunicator::Split(from.nccl(), set_rank, &comm));
    // Every rank of the parent has its gather lane, or none has: each splits it too.
    std::unique_ptr<NcclCommunicator> gathers;
    if (from.gather_nccl() != nullptr)
      HVDZ_RETURN_IF_ERROR(
          NcclCommunicator::Split(*from.gather_nccl(), set_rank, &gathers, d->gather_stream, d->gather_ctas));
    if (comm) *out = NewContext(*d, std::move(comm), std::move(gathers), alloc);
    return Status::OK();
  }

 private:
  // What every context of one device shares: see [Note: process sets].
  struct Device {
    cudaStream_t stream = nullptr;  // the collective stream of every communicator
    std::unique_ptr<CopyStreams> copies;
    // The gather lane's ([Note: the gather lane] in ops/cuda_context.h); null: one lane.
    cudaStream_t gather_stream = nullptr;
    std::unique_ptr<CopyStreams> gather_copies;
    int gather_ctas = 0;  // the cap on its kernels' CTAs
  };

  // Background thread only (contexts are made there).
  Status DeviceOf(int device, Device** out) {
    auto it = devices_.find(device);
    if (it == devices_.end()) {
      // No guard: this thread is ours, and each context sets its device before it works
      // (model parallelism: see [Note: model parallelism] in runtime/device_maps.h). Setting
      // the previous device back (device 0 on a new thread) would make a CUDA context there,
      // on CUDA 12 and later: every rank would then hold about 500 MiB of GPU 0.
      HVDZ_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
      // High priority: collectives should not queue behind the compute they overlap.
      int lo = 0, hi = 0;
      cudaDeviceGetStreamPriorityRange(&lo, &hi);
      Device d;
      HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithPriority(&d.stream, cudaStreamNonBlocking, hi),
                                      "cudaStreamCreateWithPriority"));
      d.copies = std::make_unique<CopyStreams>(d.stream);
      if (params_.gather_stream) HVDZ_RETURN_IF_ERROR(OpenGatherLane(device, hi, &d));
      it = devices_.emplace(device, std::move(d)).first;
    }
    *out = &it->second;
    return Status::OK();
  }

  std::unique_ptr<DeviceContext> NewContext(Device& d, std::unique_ptr<NcclCommunicator> comm,
                                            std::unique_ptr<NcclCommunicator> gathers, Allocator& alloc) {
    return std::make_unique<CudaContext>(CudaContext::Lane{std::move(comm), d.copies.get()},
                                         CudaContext::Lane{std::move(gathers), d.gather_copies.get()}, alloc, params_,
                                         log_, window_bytes_, gather_lanes_);
  }

  // [Note: the gather lane] in ops/cuda_context.h: a split of `comm` on the device's
  // gather stream, made only where every rank of `cp` can and all splits worked. Every
  // rank takes part in both rounds, also one that did not ask for the lane.
  Status OpenGatherComm(const Device& d, ControlPlane& cp, NcclCommunicator& comm,
                        std::unique_ptr<NcclCommunicator>* out) {
    bool all = false;
    HVDZ_RETURN_IF_ERROR(AllSay(cp, d.gather_stream != nullptr, &all));
    if (!all) {
      if (d.gather_stream != nullptr)
        HVDZ_LOG(log_, kWarning) << "HOROVOD_ZERO_GATHER_STREAM=1 is ignored for a set of " << cp.size()
                                 << " ranks: not every rank asked for it on a GPU of " << kGatherLaneMinSms
                                 << " SMs or more. Set it alike on every rank.";
      return Status::OK();
    }
    Status s = NcclCommunicator::Split(comm, cp.rank(), out, d.gather_stream, d.gather_ctas,
                                       /*for_window=*/comm.agreed_window() > 0);
    HVDZ_RETURN_IF_ERROR(AllSay(cp, s.ok(), &all));
    if (all) return Status::OK();
    if (*out) (*out)->Abort();  // no collective teardown with ranks whose split failed
    out->reset();
    HVDZ_LOG(log_, kWarning) << "HOROVOD_ZERO_GATHER_STREAM=1: the gather stream's communicator could not be made on "
                             << "every rank" << (s.ok() ? "" : " (here: " + s.reason() + ")")
                             << "; allgathers share the other collectives' stream.";
    return Status::OK();
  }

  // Whether every rank of `cp` says yes.
  static Status AllSay(ControlPlane& cp, bool mine, bool* all) {
    std::vector<uint8_t> says;
    HVDZ_RETURN_IF_ERROR(cp.Allgather({static_cast<uint8_t>(mine ? 1 : 0)}, &says));
    *all = std::all_of(says.begin(), says.end(), [](uint8_t b) { return b == 1; });
    return Status::OK();
  }

  // Leaves `d` with one lane on a GPU too small for two NCCL kernels side by side, or
  // where the stream cannot be made; the ranks of a set then agree (OpenGatherComm).
  Status OpenGatherLane(int device, int priority, Device* d) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      sms = 0;
    }
    if (sms < kGatherLaneMinSms) {
      HVDZ_LOG(log_, kWarning) << "HOROVOD_ZERO_GATHER_STREAM=1 is ignored on cuda:" << device << ": its " << sms
                               << " SMs are too few to run two NCCL kernels side by side safely (at least "
                               << kGatherLaneMinSms << ").";
      return Status::OK();
    }
    Status s = CudaStatus(cudaStreamCreateWithPriority(&d->gather_stream, cudaStreamNonBlocking, priority),
                          "cudaStreamCreateWithPriority");
    if (!s.ok()) {
      d->gather_stream = nullptr;
      HVDZ_LOG(log_, kWarning) << "HOROVOD_ZERO_GATHER_STREAM=1 is ignored on cuda:" << device << ": " << s.reason();
      return Status::OK();
    }
    d->gather_copies = std::make_unique<CopyStreams>(d->gather_stream);
    d->gather_copies->set_sibling(d->copies.get());
    d->copies->set_sibling(d->gather_copies.get());
    d->gather_ctas = sms / 4;
    return Status::OK();
  }

  // An event records only on a stream of the device it was made on: a pool per device.
  cudaEvent_t TakeEvent(int device) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    auto& pool = free_events_[device];
    if (pool.empty()) return nullptr;
    cudaEvent_t ev = pool.back();
    pool.pop_back();
    return ev;
  }
  void ReturnEvent(int device, cudaEvent_t ev) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    free_events_[device].push_back(ev);
  }

  Params params_;
  const Logger& log_;
  const int count_;
  std::atomic<int64_t> window_bytes_{0};
  std::atomic<int> gather_lanes_{0};
  std::mutex pool_mu_;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_events_;
  std::unordered_map<int, Device> devices_;
};

}  // namespace

std::unique_ptr<GpuSupport> MakeGpuSupport(const Params& params, const Logger& log) {
  int n = 0;
  // A CUDA build on a machine without GPUs still runs CPU collectives.
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return nullptr;
  }
  return std::unique_ptr<GpuSupport>(new CudaSupport(params, log, n));
}

}  // namespace hvdz
