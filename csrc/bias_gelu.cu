// CUDA kernels for the MLP activation act = gelu(pre + bias), the same math as kernels/bias_gelu.py
// (the Triton kernels), all in fp32 registers:
//   forward:  v = pre + bias; act = v * cdf(v)
//   backward: dpre = g * (cdf(v) + v * cdf'(v)), GELU recomputed from pre; act written again when
//             asked (fc2's weight gradient needs it); dbias = column sums of dpre as fp32 partials
//             per row strip, summed in a fixed order by launch_finalize (no atomics).
// cdf: Phi (erf GELU; by erfc's fit, normal_cdf), sigmoid(2u) with u = sqrt(2/pi) (v + 0.044715 v^3) (tanh GELU), or
// sigmoid(1.702 v) (QuickGELU); the sigmoids and their products from one e^-|z| (sigmoid_pair).
//
// Work split: a block is (x: columns, vec values a thread) x (y: rows in flight); blockIdx.x picks
// a column block, blockIdx.y a row strip (backward) or a starting row (forward, grid-stride).

#include "bias_gelu.h"
#include "residual_norm.h"
#include "storage.cuh"

#include <cuda_runtime.h>

#include <algorithm>

namespace dres {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float tanh_gelu_arg2(float v) { return 1.5957691216057308f * (v + 0.044715f * v * v * v); }

// The hardware's approximations, denormals flushed, as Triton's tl.math.rsqrt and tl.math.exp2 lower them.
__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (sigmoid(z), sigmoid(z) * sigmoid(-z)) as kernels/bias_gelu.py's _sigmoid_pair computes them: e = e^-|z| (never
// overflows), r = 1 / (1 + e) as a squared reciprocal square root; sigmoid r or e r, the product e r^2.
struct SigmoidPair {
  float sigmoid, product;
};

__device__ __forceinline__ SigmoidPair sigmoid_pair(float z) {
  const float e = exp2_approx(-1.4426950408889634f * fabsf(z));
  float r = rsqrt_approx(1.f + e);
  r = r * r;
  return {z >= 0.f ? r : e * r, e * r * r};
}

// Phi(v) as kernels/bias_gelu.py's _normal_cdf computes it: erfc's Chebyshev fit in base 2, no erff (whose 1 + erf
// loses Phi's digits where v is negative, and which takes twice the instructions).
__device__ __forceinline__ float normal_cdf(float v) {
  float t = rsqrt_approx(1.f + 0.35355339059327373f * fabsf(v));
  t = t * t;
  float p = -1.1861149072647095f + t * 0.24651730060577393f;
  p = 2.147474527359009f + t * p;
  p = -1.6377531290054321f + t * p;
  p = 0.40232157707214355f + t * p;
  p = -0.2687568664550781f + t * p;
  p = 0.1396300494670868f + t * p;
  p = 0.5397006273269653f + t * p;
  p = 1.4427292346954346f + t * p;
  p = -2.8257482051849365f + t * p;
  const float half_erfc = t * exp2_approx(p - 0.7213475204444817f * v * v);
  return v >= 0.f ? 1.f - half_erfc : half_erfc;
}

__device__ __forceinline__ float gelu_cdf(float v, int gelu) {
  if (gelu == kGeluTanh) return sigmoid_pair(tanh_gelu_arg2(v)).sigmoid;
  if (gelu == kGeluQuick) return sigmoid_pair(1.702f * v).sigmoid;
  return normal_cdf(v);
}

__device__ __forceinline__ float gelu_cdf_slope(float v, int gelu) {
  if (gelu == kGeluTanh) {
    // v * v overflows fp32 from |v| = 1.8e19, where the sigmoids' product is 0 already: capped
    const float du = 1.5957691216057308f * (1.f + 0.134145f * fminf(v * v, 1e4f));
    return du * sigmoid_pair(tanh_gelu_arg2(v)).product;
  }
  if (gelu == kGeluQuick) return 1.702f * sigmoid_pair(1.702f * v).product;
  return 0.3989422804014327f * exp2_approx(-0.7213475204444817f * v * v);  // e^(-v^2 / 2)
}

template <int VEC>
__device__ __forceinline__ void load_bias(const BiasGeluParams& p, int64_t col, float (&b)[VEC]) {
  if (p.bias != nullptr) {
    load_vec<VEC>(p.bias, p.bias_dt, col, b);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) b[e] = 0.f;
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads) bias_gelu_fwd_kernel(const BiasGeluParams p) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (col >= p.N) return;  // no barrier below: threads past the last column leave at once
  float b[VEC];
  load_bias<VEC>(p, col, b);
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < p.M;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    float v[VEC];
    load_vec<VEC>(p.pre, p.pre_dt, row * p.stride_pre + col, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      v[e] += b[e];
      v[e] *= gelu_cdf(v[e], p.gelu);
    }
    store_vec<VEC>(p.act, p.act_dt, row * p.stride_act + col, v);
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads) bias_gelu_bwd_kernel(const BiasGeluParams p) {
  __shared__ float sums[kThreads * 8];  // (blockDim.y, blockDim.x * VEC) dbias partials
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = col < p.N;
  float b[VEC], acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  if (active) load_bias<VEC>(p, col, b);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * p.rows_per_strip;
  const int64_t last = first + p.rows_per_strip < p.M ? first + p.rows_per_strip : p.M;
  for (int64_t row = first + threadIdx.y; active && row < last; row += blockDim.y) {
    float v[VEC], g[VEC];
    load_vec<VEC>(p.pre, p.pre_dt, row * p.stride_pre + col, v);
    load_vec<VEC, false>(p.g, p.g_dt, row * p.stride_g + col, g);  // dpre may be g itself
    float act[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      v[e] += b[e];
      const float cdf = gelu_cdf(v[e], p.gelu);
      act[e] = v[e] * cdf;
      g[e] *= cdf + v[e] * gelu_cdf_slope(v[e], p.gelu);  // dpre, fp32
      acc[e] += g[e];
    }
    store_vec<VEC>(p.dpre, p.dpre_dt, row * p.stride_dpre + col, g);
    if (p.act != nullptr) store_vec<VEC>(p.act, p.act_dt, row * p.stride_act + col, act);
  }
  if (p.dbias_part == nullptr) return;  // uniform across the grid: no thread waits at the barrier
  // The block's rows in flight summed in a fixed order (y = 0, 1, ...): one partial row per strip.
  const int width = blockDim.x * VEC;
#pragma unroll
  for (int e = 0; e < VEC; ++e) sums[threadIdx.y * width + threadIdx.x * VEC + e] = acc[e];
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float total = 0.f;
    for (int y = 0; y < static_cast<int>(blockDim.y); ++y) total += sums[y * width + threadIdx.x * VEC + e];
    if (col + e < p.N) p.dbias_part[blockIdx.y * static_cast<int64_t>(p.N) + col + e] = total;
  }
}

}  // namespace

BiasGeluShape choose_bias_gelu_shape(int N, bool vectorizable) {
  BiasGeluShape s{};
  s.vec = vectorizable ? 8 : 1;
  const int threads_for_row = (N + s.vec - 1) / s.vec;
  const int x = std::min(kThreads, std::max(32, (threads_for_row + 31) / 32 * 32));
  s.block = dim3(x, kThreads / x);
  s.col_blocks = (threads_for_row + x - 1) / x;
  return s;
}

void launch_bias_gelu_forward(const BiasGeluParams& p, const BiasGeluShape& s, int num_sms, cudaStream_t stream) {
  if (p.M == 0) return;
  const int64_t row_blocks = (p.M + s.block.y - 1) / s.block.y;
  const int64_t wanted = std::max<int64_t>(1, 8LL * num_sms / s.col_blocks);  // a grid-stride loop does the rest
  const dim3 grid(s.col_blocks, static_cast<unsigned>(std::min(row_blocks, std::min<int64_t>(wanted, 65535))));
  if (s.vec == 8)
    bias_gelu_fwd_kernel<8><<<grid, s.block, 0, stream>>>(p);
  else
    bias_gelu_fwd_kernel<1><<<grid, s.block, 0, stream>>>(p);
}

int64_t bias_gelu_strips(const BiasGeluShape& s, int num_sms, int64_t M) {
  const int64_t wanted = std::max<int64_t>(1, 4LL * num_sms / s.col_blocks);
  const int64_t most = (M + s.block.y - 1) / s.block.y;  // every strip gets rows for each row in flight
  return std::max<int64_t>(1, std::min(wanted, most));
}

void launch_bias_gelu_backward(const BiasGeluParams& p, const BiasGeluShape& s, int64_t strips, cudaStream_t stream) {
  if (p.M == 0) return;
  const dim3 grid(s.col_blocks, static_cast<unsigned>(strips));
  if (s.vec == 8)
    bias_gelu_bwd_kernel<8><<<grid, s.block, 0, stream>>>(p);
  else
    bias_gelu_bwd_kernel<1><<<grid, s.block, 0, stream>>>(p);
}

}  // namespace dres
