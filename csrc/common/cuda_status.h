// A CUDA runtime result as a Status naming the call that failed. In common/
// because both the NCCL transport and ops' CUDA context check CUDA calls; only
// files compiled for the CUDA path include it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"

namespace hvdz {

inline Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::OK();
  // Clear the thread's last error, or the framework's next CUDA call reports ours as its own.
  cudaGetLastError();
  return Status::Error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

}  // namespace hvdz
