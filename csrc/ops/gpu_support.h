// The CUDA side of the runtime, behind an interface so that plain C++ files never
// see CUDA headers. CMake compiles gpu_support_cuda.cc or gpu_support_none.cc.
#pragma once

#include <cstdint>
#include <memory>

#include "common/logging.h"
#include "common/params.h"
#include "ops/device_context.h"
#include "transport/control_plane.h"

namespace hvdz {

class GpuSupport {
 public:
  virtual ~GpuSupport() = default;
  // Framework thread: an event recorded now on `stream`, which the collective
  // waits on, so it reads the input only after its producer wrote it.
  virtual Status RecordReadyEvent(int device, void* stream, std::shared_ptr<void>* event) = 0;
  // The GPUs this process sees.
  virtual int device_count() const = 0;
  // Bytes the live communicators hold in allgather windows (outside torch's allocator).
  virtual int64_t window_bytes() const = 0;
  // CUDA contexts alive with a gather lane ([Note: the gather lane] in ops/cuda_context.h).
  virtual int gather_lanes() const = 0;
  // Background thread: the context of `device`, creating its NCCL communicator.
  // Every rank reaches this for the same response, so the collective init lines up.
  virtual Status CreateContext(int device, ControlPlane& cp, Allocator& alloc,
                               std::unique_ptr<DeviceContext>* out) = 0;
  // Background thread, at a point every rank of the job reaches in the same cycle
  // (a process set's activation): a context on `parent`'s device whose communicator
  // is split from `parent`'s, the global set's. Every rank calls it; `set_rank` >= 0
  // (this rank's place in the set) gets the context in *out, -1 gets none.
  virtual Status SplitContext(DeviceContext& parent, int set_rank, Allocator& alloc,
                              std::unique_ptr<DeviceContext>* out) = 0;
};

// nullptr when built without CUDA.
std::unique_ptr<GpuSupport> MakeGpuSupport(const Params& params, const Logger& log);

}  // namespace hvdz
