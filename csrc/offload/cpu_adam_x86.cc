// The AVX2 and AVX-512 kernels of CpuAdamStep. Each is compiled for its ISA by a
// target region rather than by file-wide -m flags: nothing outside the region
// (inline library code the linker might share with other files) gets
// instructions the running CPU may lack. CpuAdamStep calls one only after
// CpuAdamIsaSupported said yes. Built with -ffp-contract=off, as cpu_adam.cc.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "offload/cpu_adam_kernels.h"

#define HVDZ_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define HVDZ_TARGET_BEGIN(isa) HVDZ_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define HVDZ_TARGET_END HVDZ_PRAGMA(clang attribute pop)
#else
#define HVDZ_TARGET_BEGIN(isa) HVDZ_PRAGMA(GCC push_options) HVDZ_PRAGMA(GCC target(isa))
#define HVDZ_TARGET_END HVDZ_PRAGMA(GCC pop_options)
#endif

namespace hvdz {
namespace cpu_adam {

HVDZ_TARGET_BEGIN("avx2,fma,f16c")
namespace avx2 {

struct V {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F LoadGrad(const float* g) { return _mm256_loadu_ps(g); }
  static F LoadGrad(const Bf16* g) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F LoadGrad(const Half* g) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))); }
  static void StoreOut(float* o, F x) { _mm256_storeu_ps(o, x); }
  // Round to nearest even; a NaN keeps its sign and top payload, quieted, as
  // FloatToBFloat16 does (so that a tail and a vector give the same bits).
  static void StoreOut(Bf16* o, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i high = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(rounded, nan, is_nan);
    // Lanes hold values <= 0xffff, so unsigned saturation packs them exactly;
    // packs work per 128-bit half, and the permute puts the halves in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
  }
  static void StoreOut(Half* o, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#include "offload/cpu_adam_body.inc"

}  // namespace avx2

void RangeAvx2(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end) {
  const int64_t done = avx2::VectorRange(c, t, begin, end);
  if (done < end) RangeScalar(c, t, done, end);
}
HVDZ_TARGET_END

HVDZ_TARGET_BEGIN("avx512f,avx2,fma,f16c")
namespace avx512 {

struct V {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F LoadGrad(const float* g) { return _mm512_loadu_ps(g); }
  static F LoadGrad(const Bf16* g) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F LoadGrad(const Half* g) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g))); }
  static void StoreOut(float* o, F x) { _mm512_storeu_ps(o, x); }
  static void StoreOut(Bf16* o, F x) {  // as avx2's
    const __m512i u = _mm512_castps_si512(x);
    const __m512i high = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(bits));
  }
  static void StoreOut(Half* o, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#include "offload/cpu_adam_body.inc"

}  // namespace avx512

void RangeAvx512(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end) {
  const int64_t done = avx512::VectorRange(c, t, begin, end);
  if (done < end) RangeScalar(c, t, done, end);
}
HVDZ_TARGET_END

}  // namespace cpu_adam
}  // namespace hvdz

#endif  // x86
