// Fused Adam/AdamW step on the CPU, for ZeRO offload: fp32 master params and
// moments live in host memory and the gradient arrives in fp32, bf16 or fp16.
// One pass over [begin, end) reads param, exp_avg, exp_avg_sq and the gradient in
// its own dtype, and writes param, the moments and, optionally, a copy of the new
// param in bf16/fp16/fp32 for the GPU: no fp32 gradient buffer, no cast passes.
//
// [Note: CPU Adam numerics] The result is torch.optim.Adam/AdamW's default
// (single-tensor) step to fp32 rounding. Each op rounds where torch's does, fused
// where torch's CPU kernels fuse (lerp, addcmul and add-with-alpha are FMAs
// there), with the scalars computed in double and rounded to fp32 as torch does.
// torch's CPU sqrt comes from MKL and is not always correctly rounded; ours is,
// so about a fifth of the denominators differ from torch's by one ulp. Every ISA
// computes the same roundings, so the paths agree with each other bit for bit.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/types.h"

namespace hvdz {

// One step's hyperparameters, as a torch.optim.Adam param group holds them.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;          // the step being taken, from 1 (bias correction)
  bool decoupled = true;     // AdamW: param *= 1 - lr*wd; false: Adam's L2, grad += wd*param
  bool maximize = false;
  double grad_scale = 1.0;   // g = grad * grad_scale: loss-scale unscaling and clipping
};

// The tensors of one step, `numel` elements each. The fp32 state is updated in
// place; `out` (may be null) receives the new param in `out_type`.
struct AdamTensors {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  DataType grad_type = DataType::kFloat32;   // float32, bfloat16 or float16
  void* out = nullptr;
  DataType out_type = DataType::kBFloat16;   // float32, bfloat16 or float16
  int64_t numel = 0;
};

// The per-element constants of a step, rounded to fp32 where torch rounds them.
struct AdamCoeffs {
  float grad_scale;      // negative when maximizing
  bool l2;               // Adam's coupled weight decay: g = fma(param, weight_decay, g)
  float weight_decay;
  float decay;           // AdamW: param *= decay (1 when l2)
  float lerp_weight;     // exp_avg = fma(lerp_weight, g - exp_avg, from_grad ? g : exp_avg),
  bool lerp_from_grad;   //   torch's lerp: 1 - beta1, or -beta1 from g when 1 - beta1 >= 0.5
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;   // -lr / bias_correction1
};

// Refuses hyperparameters torch would refuse (and a step below 1).
Status MakeAdamCoeffs(const AdamHyper& h, AdamCoeffs* out);
// Refuses unsupported dtypes and missing pointers.
Status CheckAdamTensors(const AdamTensors& t);

enum class CpuAdamIsa { kScalar, kAvx2, kAvx512 };
const char* CpuAdamIsaName(CpuAdamIsa isa);
// Whether this CPU (and OS) can run `isa`: AVX2 needs FMA and F16C too.
bool CpuAdamIsaSupported(CpuAdamIsa isa);
// "auto" (the widest supported), "avx512", "avx2" or "scalar"; a named ISA this
// CPU lacks is refused rather than quietly replaced.
Status ResolveCpuAdamIsa(const std::string& requested, CpuAdamIsa* out);

// Updates elements [begin, end) of `t`. Disjoint ranges may run on different
// threads at once. Expects checked inputs: MakeAdamCoeffs and CheckAdamTensors
// returned OK, and `isa` is supported.
void CpuAdamStep(CpuAdamIsa isa, const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end);

}  // namespace hvdz
