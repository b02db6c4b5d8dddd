#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_stream.h"

namespace hvdz {
void* CurrentCudaStream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

std::shared_ptr<void> UseCudaStream(int device, void* stream) {
  auto s = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), static_cast<c10::DeviceIndex>(device));
  return std::make_shared<c10::cuda::CUDAStreamGuard>(s);
}

void RecordStream(const at::Tensor& t, void* stream) {
  c10::cuda::CUDACachingAllocator::recordStream(
      t.storage().data_ptr(), c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), t.device().index()));
}

void CurrentStreamWaitEvent(int device, void* event) {
  // On `device`: its default stream is the legacy one, which names the current device's.
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(),
                                     static_cast<cudaEvent_t>(event), 0));
}
}  // namespace hvdz
