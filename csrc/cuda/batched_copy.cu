#include "cuda/batched_copy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace hvdz {
namespace {

// Descriptors travel as a kernel argument: no host-to-device copy, no staging
// buffer to keep alive, one launch per kMaxCopies ranges.
constexpr int kMaxCopies = 64;
constexpr int kThreads = 256;
constexpr int kMaxBlocksPerCopy = 1024;

struct Batch {
  const void* src[kMaxCopies];
  void* dst[kMaxCopies];
  int64_t count[kMaxCopies];
  int n;
  double scale;
};

template <typename T> __device__ __forceinline__ float ToFloat(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T FromFloat(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename S, typename D>
__device__ __forceinline__ D Convert(S v, double scale) {
  if constexpr (std::is_integral<S>::value) {
    // Integers copy to their own dtype; a scale truncates toward zero, as Horovod's
    // scaling does (and as the CPU copy does, through int64).
    if (scale == 1.0) return v;
    return static_cast<D>(static_cast<long long>(static_cast<double>(v) * scale));
  } else if constexpr (std::is_same<S, double>::value || std::is_same<D, double>::value) {
    double x = std::is_same<S, double>::value ? static_cast<double>(v) : static_cast<double>(ToFloat<S>(v));
    x *= scale;
    if constexpr (std::is_same<D, double>::value) return x;
    else return FromFloat<D>(static_cast<float>(x));
  } else {
    return FromFloat<D>(static_cast<float>(scale) * ToFloat<S>(v));
  }
}

// Elements per thread per step: 16 bytes of the wider side, so that aligned
// ranges move with 16-byte loads or stores (fusion offsets are 64-byte aligned).
template <typename S, typename D>
__host__ __device__ constexpr int VecWidth() {
  return 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename S, typename D>
__global__ void BatchedCopyKernel(Batch b) {
  constexpr int N = VecWidth<S, D>();
  const int i = blockIdx.y;
  const S* __restrict__ s = static_cast<const S*>(b.src[i]);
  D* __restrict__ d = static_cast<D*>(b.dst[i]);
  const int64_t n = b.count[i];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = reinterpret_cast<uintptr_t>(s) % sizeof(Vec<S, N>) == 0 &&
                       reinterpret_cast<uintptr_t>(d) % sizeof(Vec<D, N>) == 0;
  const int64_t nvec = aligned ? n / N : 0;
  for (int64_t k = first; k < nvec; k += stride) {
    Vec<S, N> in = reinterpret_cast<const Vec<S, N>*>(s)[k];
    Vec<D, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = Convert<S, D>(in.v[j], b.scale);
    reinterpret_cast<Vec<D, N>*>(d)[k] = out;
  }
  for (int64_t k = nvec * N + first; k < n; k += stride) d[k] = Convert<S, D>(s[k], b.scale);
}

template <typename S, typename D>
cudaError_t Launch(const CopyDesc* descs, int n, double scale, cudaStream_t stream) {
  constexpr int64_t kPerBlock = static_cast<int64_t>(kThreads) * VecWidth<S, D>() * 4;
  // fp16 scales in fp16, as Horovod's kernels do ([Note: scale arithmetic]): the
  // factor rounded to fp16, the product (exact in float) rounded once.
  if constexpr (std::is_same<S, __half>::value && std::is_same<D, __half>::value)
    scale = __half2float(__float2half_rn(static_cast<float>(scale)));
  for (int base = 0; base < n; base += kMaxCopies) {
    Batch b{};
    b.n = std::min(kMaxCopies, n - base);
    b.scale = scale;
    int64_t longest = 0;
    for (int j = 0; j < b.n; ++j) {
      b.src[j] = descs[base + j].src;
      b.dst[j] = descs[base + j].dst;
      b.count[j] = descs[base + j].count;
      longest = std::max(longest, b.count[j]);
    }
    if (longest == 0) continue;
    int blocks = static_cast<int>(std::min<int64_t>((longest + kPerBlock - 1) / kPerBlock, kMaxBlocksPerCopy));
    BatchedCopyKernel<S, D><<<dim3(blocks, b.n), kThreads, 0, stream>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <typename S>
cudaError_t LaunchFromFloat(const CopyDesc* descs, int n, DataType dst, double scale, cudaStream_t st) {
  switch (dst) {
    case DataType::kFloat16: return Launch<S, __half>(descs, n, scale, st);
    case DataType::kBFloat16: return Launch<S, __nv_bfloat16>(descs, n, scale, st);
    case DataType::kFloat32: return Launch<S, float>(descs, n, scale, st);
    case DataType::kFloat64: return Launch<S, double>(descs, n, scale, st);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool BatchedCopySupported(DataType src, DataType dst) {
  return src == dst || (IsFloatingPoint(src) && IsFloatingPoint(dst));
}

cudaError_t LaunchBatchedCopy(const CopyDesc* descs, int n, DataType src, DataType dst, double scale,
                              cudaStream_t st) {
  if (!BatchedCopySupported(src, dst)) return cudaErrorInvalidValue;
  switch (src) {
    case DataType::kUInt8: return Launch<uint8_t, uint8_t>(descs, n, scale, st);
    case DataType::kInt8: return Launch<int8_t, int8_t>(descs, n, scale, st);
    case DataType::kInt16: return Launch<int16_t, int16_t>(descs, n, scale, st);
    case DataType::kInt32: return Launch<int32_t, int32_t>(descs, n, scale, st);
    case DataType::kInt64: return Launch<int64_t, int64_t>(descs, n, scale, st);
    case DataType::kFloat16: return LaunchFromFloat<__half>(descs, n, dst, scale, st);
    case DataType::kBFloat16: return LaunchFromFloat<__nv_bfloat16>(descs, n, dst, scale, st);
    case DataType::kFloat32: return LaunchFromFloat<float>(descs, n, dst, scale, st);
    case DataType::kFloat64: return LaunchFromFloat<double>(descs, n, dst, scale, st);
  }
  return cudaErrorInvalidValue;
}

}  // namespace hvdz
