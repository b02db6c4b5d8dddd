#include "cuda/master_adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace hvdz {
namespace {

// Descriptors travel as a kernel argument, as in batched_copy.cu: one launch per
// kMaxTensors shards, no staging buffer.
constexpr int kMaxTensors = 32;
constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per thread per step: a 16-byte load of each fp32 tensor
constexpr int kMaxBlocksPerTensor = 1024;

struct Batch {
  MasterAdamDesc d[kMaxTensors];
  int n;
  MasterAdamHyper h;
};

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// As the gather's cast (batched_copy.cu): round to nearest even.
template <typename C> __device__ __forceinline__ C FromFloat(float v);
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename G, int N>
struct alignas(sizeof(G) * N) GradVec {
  G v[N];
};

// One element's update, in fp32, in the order of torch's fused Adam.
__device__ __forceinline__ void Update(float& p, float g, float& m, float& v, const MasterAdamHyper& h,
                                       float step_size, float bias_correction2_sqrt) {
  g *= h.grad_scale;
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) {  // as torch: with no decay an inf parameter stays inf, not NaN
    if (h.decoupled) p -= h.lr * h.weight_decay * p;
    else g += p * h.weight_decay;
  }
  m = h.beta1 * m + (1.f - h.beta1) * g;
  v = h.beta2 * v + (1.f - h.beta2) * g * g;
  const float denom = (sqrtf(v) / bias_correction2_sqrt) + h.eps;
  p -= step_size * m / denom;
}

template <typename G, typename C>
__global__ void MasterAdamKernel(Batch b) {
  const MasterAdamDesc& d = b.d[blockIdx.y];
  const MasterAdamHyper& h = b.h;
  const float step = *d.step;
  const float bias_correction1 = 1.f - powf(h.beta1, step);
  const float step_size = h.lr / bias_correction1;
  const float bias_correction2_sqrt = sqrtf(1.f - powf(h.beta2, step));
  float* __restrict__ p = d.param;
  const G* __restrict__ g = static_cast<const G*>(d.grad);
  float* __restrict__ m = d.exp_avg;
  float* __restrict__ v = d.exp_avg_sq;
  C* __restrict__ c = static_cast<C*>(d.copy);
  const int64_t n = d.count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(m) |
                        reinterpret_cast<uintptr_t>(v)) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(g) % sizeof(GradVec<G, kVec>) == 0 &&
                       reinterpret_cast<uintptr_t>(c) % sizeof(GradVec<C, kVec>) == 0;
  const int64_t nvec = aligned ? n / kVec : 0;
  for (int64_t k = first; k < nvec; k += stride) {
    float4 pv = reinterpret_cast<float4*>(p)[k];
    float4 mv = reinterpret_cast<float4*>(m)[k];
    float4 vv = reinterpret_cast<float4*>(v)[k];
    const GradVec<G, kVec> gv = reinterpret_cast<const GradVec<G, kVec>*>(g)[k];
    Update(pv.x, ToFloat(gv.v[0]), mv.x, vv.x, h, step_size, bias_correction2_sqrt);
    Update(pv.y, ToFloat(gv.v[1]), mv.y, vv.y, h, step_size, bias_correction2_sqrt);
    Update(pv.z, ToFloat(gv.v[2]), mv.z, vv.z, h, step_size, bias_correction2_sqrt);
    Update(pv.w, ToFloat(gv.v[3]), mv.w, vv.w, h, step_size, bias_correction2_sqrt);
    reinterpret_cast<float4*>(p)[k] = pv;
    reinterpret_cast<float4*>(m)[k] = mv;
    reinterpret_cast<float4*>(v)[k] = vv;
    if (c != nullptr) {
      GradVec<C, kVec> cv;
      cv.v[0] = FromFloat<C>(pv.x);
      cv.v[1] = FromFloat<C>(pv.y);
      cv.v[2] = FromFloat<C>(pv.z);
      cv.v[3] = FromFloat<C>(pv.w);
      reinterpret_cast<GradVec<C, kVec>*>(c)[k] = cv;
    }
  }
  for (int64_t k = nvec * kVec + first; k < n; k += stride) {
    float pk = p[k], mk = m[k], vk = v[k];
    Update(pk, ToFloat(g[k]), mk, vk, h, step_size, bias_correction2_sqrt);
    p[k] = pk;
    m[k] = mk;
    v[k] = vk;
    if (c != nullptr) c[k] = FromFloat<C>(pk);
  }
}

template <typename G, typename C>
cudaError_t Launch(const MasterAdamDesc* descs, int n, const MasterAdamHyper& h, cudaStream_t stream) {
  constexpr int64_t kPerBlock = static_cast<int64_t>(kThreads) * kVec * 4;
  for (int base = 0; base < n; base += kMaxTensors) {
    Batch b{};
    b.n = std::min(kMaxTensors, n - base);
    b.h = h;
    int64_t longest = 0;
    for (int j = 0; j < b.n; ++j) {
      b.d[j] = descs[base + j];
      longest = std::max(longest, b.d[j].count);
    }
    if (longest == 0) continue;
    const int blocks = static_cast<int>(std::min<int64_t>((longest + kPerBlock - 1) / kPerBlock, kMaxBlocksPerTensor));
    MasterAdamKernel<G, C><<<dim3(blocks, b.n), kThreads, 0, stream>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <typename C>
cudaError_t LaunchFor(const MasterAdamDesc* descs, int n, DataType grad, const MasterAdamHyper& h,
                      cudaStream_t stream) {
  switch (grad) {
    case DataType::kFloat16: return Launch<__half, C>(descs, n, h, stream);
    case DataType::kBFloat16: return Launch<__nv_bfloat16, C>(descs, n, h, stream);
    case DataType::kFloat32: return Launch<float, C>(descs, n, h, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchMasterAdam(const MasterAdamDesc* descs, int n, DataType grad, const MasterAdamHyper& h,
                             cudaStream_t stream, DataType copy) {
  switch (copy) {
    case DataType::kFloat16: return LaunchFor<__half>(descs, n, grad, h, stream);
    case DataType::kBFloat16: return LaunchFor<__nv_bfloat16>(descs, n, grad, h, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace hvdz
