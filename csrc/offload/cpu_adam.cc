// CpuAdamStep: the step's constants, the choice of ISA, and the portable kernel.
// Built with -ffp-contract=off (csrc/CMakeLists.txt): every FMA is one written
// here, where torch has one, never one the compiler chose.
#include "offload/cpu_adam.h"

#include <cmath>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "fusion/cpu_cast.h"
#include "offload/cpu_adam_kernels.h"

namespace hvdz {

Status MakeAdamCoeffs(const AdamHyper& h, AdamCoeffs* out) {
  if (h.step < 1) return Status::InvalidArgument("Adam step " + std::to_string(h.step) + ": steps count from 1.");
  if (!(h.lr >= 0) || !(h.eps >= 0) || !(h.weight_decay >= 0))
    return Status::InvalidArgument("Adam needs lr, eps and weight_decay >= 0 (got " + std::to_string(h.lr) + ", " +
                                   std::to_string(h.eps) + ", " + std::to_string(h.weight_decay) + ").");
  if (!(h.beta1 >= 0 && h.beta1 < 1) || !(h.beta2 >= 0 && h.beta2 < 1))
    return Status::InvalidArgument("Adam needs betas in [0, 1) (got " + std::to_string(h.beta1) + ", " +
                                   std::to_string(h.beta2) + ").");
  if (!std::isfinite(h.grad_scale)) return Status::InvalidArgument("Adam grad_scale must be finite.");
  // Double, as torch's Python scalars are; rounded to fp32 where its kernels take them.
  const double step = static_cast<double>(h.step);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  AdamCoeffs& c = *out;
  c.grad_scale = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);
  c.l2 = !h.decoupled && h.weight_decay != 0;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.decay = c.l2 ? 1.0f : static_cast<float>(1 - h.lr * h.weight_decay);
  // torch's lerp: start + w*(end - start) for |w| < 0.5, else end - (end - start)*(1 - w).
  const float w = static_cast<float>(1 - h.beta1);
  c.lerp_from_grad = !(std::fabs(w) < 0.5f);
  c.lerp_weight = c.lerp_from_grad ? w - 1.0f : w;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));  // Python's ** 0.5
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  return Status::OK();
}

namespace {

bool IsFloatType(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kBFloat16 || t == DataType::kFloat16;
}

}  // namespace

Status CheckAdamTensors(const AdamTensors& t) {
  if (!IsFloatType(t.grad_type)) return Status::InvalidArgument("Adam gradients must be float32, bfloat16 or float16.");
  if (t.out != nullptr && !IsFloatType(t.out_type))
    return Status::InvalidArgument("Adam param copies must be float32, bfloat16 or float16.");
  if (t.numel < 0) return Status::InvalidArgument("Adam numel is negative.");
  if (t.numel > 0 && (!t.param || !t.exp_avg || !t.exp_avg_sq || !t.grad))
    return Status::InvalidArgument("Adam needs param, exp_avg, exp_avg_sq and grad.");
  return Status::OK();
}

const char* CpuAdamIsaName(CpuAdamIsa isa) {
  switch (isa) {
    case CpuAdamIsa::kAvx512: return "avx512";
    case CpuAdamIsa::kAvx2: return "avx2";
    case CpuAdamIsa::kScalar: break;
  }
  return "scalar";
}

bool CpuAdamIsaSupported(CpuAdamIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case CpuAdamIsa::kAvx512: return __builtin_cpu_supports("avx512f");
    case CpuAdamIsa::kAvx2: {
      // __builtin_cpu_supports checks that the OS saves the AVX state; F16C is
      // asked of cpuid because not every compiler's builtin knows it.
      unsigned a = 0, b = 0, c = 0, d = 0;
      const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
      return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    case CpuAdamIsa::kScalar: return true;
  }
  return false;
#else
  return isa == CpuAdamIsa::kScalar;
#endif
}

Status ResolveCpuAdamIsa(const std::string& requested, CpuAdamIsa* out) {
  static const CpuAdamIsa kWidestFirst[] = {CpuAdamIsa::kAvx512, CpuAdamIsa::kAvx2, CpuAdamIsa::kScalar};
  for (CpuAdamIsa isa : kWidestFirst) {
    if (requested == "auto" && CpuAdamIsaSupported(isa)) {
      *out = isa;
      return Status::OK();
    }
    if (requested == CpuAdamIsaName(isa)) {
      if (!CpuAdamIsaSupported(isa))
        return Status::InvalidArgument("The CPU Adam ISA '" + requested +
                                       "' is not supported by this CPU; use auto, or one it has.");
      *out = isa;
      return Status::OK();
    }
  }
  return Status::InvalidArgument("Unknown CPU Adam ISA '" + requested + "'; use auto, avx512, avx2 or scalar.");
}

namespace cpu_adam {
namespace scalar {

struct V {
  using F = float;
  static constexpr int kWidth = 1;
  static F Set(float x) { return x; }
  static F Load(const float* p) { return *p; }
  static void Store(float* p, F x) { *p = x; }
  static F Sqrt(F a) { return std::sqrt(a); }
  static F Fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F LoadGrad(const float* g) { return *g; }
  static F LoadGrad(const Bf16* g) { return BFloat16ToFloat(g->bits); }
  static F LoadGrad(const Half* g) { return HalfToFloat(g->bits); }
  static void StoreOut(float* o, F x) { *o = x; }
  static void StoreOut(Bf16* o, F x) { o->bits = FloatToBFloat16(x); }
  static void StoreOut(Half* o, F x) { o->bits = FloatToHalf(x); }
};

#include "offload/cpu_adam_body.inc"

}  // namespace scalar

void RangeScalar(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end) {
  scalar::VectorRange(c, t, begin, end);
}

}  // namespace cpu_adam

void CpuAdamStep(CpuAdamIsa isa, const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__) || defined(__i386__)
    case CpuAdamIsa::kAvx512: return cpu_adam::RangeAvx512(c, t, begin, end);
    case CpuAdamIsa::kAvx2: return cpu_adam::RangeAvx2(c, t, begin, end);
#endif
    default: return cpu_adam::RangeScalar(c, t, begin, end);
  }
}

}  // namespace hvdz
