// Adam/AdamW on fp32 master shards whose gradients are still in the reduction's dtype:
// one pass reads the bf16/fp16 gradient where torch's fused kernel needs an fp32 copy
// made first (a cast kernel that reads 2 and writes 4 bytes per element, then the step
// reads those 4 again). The update is torch's fused Adam's, in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace hvdz {

struct MasterAdamDesc {
  float* param;
  const void* grad;  // the dtype given to LaunchMasterAdam
  float* exp_avg;
  float* exp_avg_sq;
  const float* step;  // the step count, already incremented for this step
  int64_t count;
  // Where the new parameter is also written in the copy dtype given to LaunchMasterAdam
  // (rounded to nearest even, as the gather's cast), or null: the gather then reads it
  // as it is instead of casting the fp32 master again.
  void* copy = nullptr;
};

struct MasterAdamHyper {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // AdamW's weight decay (on the parameter), else Adam's (on the gradient)
  bool maximize;
  float grad_scale;  // each gradient is multiplied by it first (unscaling, clipping)
};

// Gradient dtypes: float16, bfloat16, float32; `copy`, the dtype of every desc's non-null
// copy: float16, bfloat16. Any other returns cudaErrorInvalidValue.
cudaError_t LaunchMasterAdam(const MasterAdamDesc* descs, int n, DataType grad, const MasterAdamHyper& h,
                             cudaStream_t stream, DataType copy = DataType::kBFloat16);

}  // namespace hvdz
