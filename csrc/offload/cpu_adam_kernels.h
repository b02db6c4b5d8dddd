// Internal to csrc/offload: the per-ISA kernels behind CpuAdamStep, and the
// storage types they read and write.
#pragma once

#include <cstdint>

#include "offload/cpu_adam.h"

namespace hvdz {
namespace cpu_adam {

struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };
struct NoOut {};  // the step writes no param copy

// Each updates [begin, end). The vector ones finish a tail shorter than a vector
// with RangeScalar, which rounds identically.
void RangeScalar(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end);
#if defined(__x86_64__) || defined(__i386__)
void RangeAvx2(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end);
void RangeAvx512(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end);
#endif

}  // namespace cpu_adam
}  // namespace hvdz
