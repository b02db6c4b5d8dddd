#include <c10/cuda/CUDAStream.h>

#include "cuda_stream.h"

namespace hvdz {
void* CurrentCudaStream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}
}  // namespace hvdz
