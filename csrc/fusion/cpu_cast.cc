#include "fusion/cpu_cast.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace hvdz {

uint16_t FloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float BFloat16ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Subnormal or zero in half: add 0.5 (as a float) so the FPU does the
    // round-to-nearest-even shift for us, then take the low mantissa bits.
    float a;
    std::memcpy(&a, &abs, 4);
    a += 0.5f;
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  uint32_t mant_odd = (abs >> 13) & 1u;
  uint32_t v = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (v >> 13));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    out = sign;
  } else {
    float f = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&out, &f, 4);
    out |= sign;
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

namespace {

// Storage types, and their conversion to/from the compute type of a batch.
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

template <typename T> inline double Load(const T& v) { return static_cast<double>(v); }
template <> inline double Load<BF16>(const BF16& v) { return BFloat16ToFloat(v.bits); }
template <> inline double Load<F16>(const F16& v) { return HalfToFloat(v.bits); }

// Integers truncate toward zero, as Horovod's scaling does (static_cast of the
// double product); through int64 so that a value out of range wraps instead of
// being undefined.
template <typename T> inline void Store(T* p, double v) {
  if constexpr (std::is_integral<T>::value) *p = static_cast<T>(static_cast<int64_t>(v));
  else *p = static_cast<T>(v);
}
template <> inline void Store<BF16>(BF16* p, double v) { p->bits = FloatToBFloat16(static_cast<float>(v)); }
template <> inline void Store<F16>(F16* p, double v) { p->bits = FloatToHalf(static_cast<float>(v)); }

// The arithmetic of a scale is Horovod's ScaleBuffer's ([Note: scale arithmetic]):
// between floating-point types other than double, in float with the factor rounded
// to float, one rounding at the store; with a double or an integer side, in double.
template <typename S, typename D>
void CopyOne(const CopyDesc& d, double scale) {
  const S* s = static_cast<const S*>(d.src);
  D* o = static_cast<D*>(d.dst);
  constexpr bool kInFloat = !std::is_integral<S>::value && !std::is_integral<D>::value &&
                            !std::is_same<S, double>::value && !std::is_same<D, double>::value;
  if constexpr (kInFloat) {
    const float fs = static_cast<float>(scale);
    for (int64_t i = 0; i < d.count; ++i) {
      float v = static_cast<float>(Load<S>(s[i]));
      Store<D>(o + i, scale == 1.0 ? v : fs * v);
    }
    return;
  }
  if (scale == 1.0) {
    for (int64_t i = 0; i < d.count; ++i) Store<D>(o + i, Load<S>(s[i]));
  } else {
    for (int64_t i = 0; i < d.count; ++i) Store<D>(o + i, scale * Load<S>(s[i]));
  }
}

template <typename S>
void CopyFrom(const CopyDesc& d, DataType dst, double scale) {
  switch (dst) {
    case DataType::kUInt8: return CopyOne<S, uint8_t>(d, scale);
    case DataType::kInt8: return CopyOne<S, int8_t>(d, scale);
    case DataType::kInt16: return CopyOne<S, int16_t>(d, scale);
    case DataType::kInt32: return CopyOne<S, int32_t>(d, scale);
    case DataType::kInt64: return CopyOne<S, int64_t>(d, scale);
    case DataType::kFloat16: return CopyOne<S, F16>(d, scale);
    case DataType::kBFloat16: return CopyOne<S, BF16>(d, scale);
    case DataType::kFloat32: return CopyOne<S, float>(d, scale);
    case DataType::kFloat64: return CopyOne<S, double>(d, scale);
  }
}

void CopyAny(const CopyDesc& d, DataType src, DataType dst, double scale) {
  switch (src) {
    case DataType::kUInt8: return CopyFrom<uint8_t>(d, dst, scale);
    case DataType::kInt8: return CopyFrom<int8_t>(d, dst, scale);
    case DataType::kInt16: return CopyFrom<int16_t>(d, dst, scale);
    case DataType::kInt32: return CopyFrom<int32_t>(d, dst, scale);
    case DataType::kInt64: return CopyFrom<int64_t>(d, dst, scale);
    case DataType::kFloat16: return CopyFrom<F16>(d, dst, scale);
    case DataType::kBFloat16: return CopyFrom<BF16>(d, dst, scale);
    case DataType::kFloat32: return CopyFrom<float>(d, dst, scale);
    case DataType::kFloat64: return CopyFrom<double>(d, dst, scale);
  }
}

}  // namespace

void CpuBatchedCopy(const std::vector<CopyDesc>& descs, DataType src_type, DataType dst_type,
                    double scale) {
  for (const auto& d : descs) {
    if (d.count == 0) continue;
    if (src_type == dst_type && scale == 1.0) {
      if (d.src != d.dst) std::memmove(d.dst, d.src, d.count * DataTypeSize(src_type));
      continue;
    }
    CopyAny(d, src_type, dst_type, scale);
  }
}

}  // namespace hvdz
