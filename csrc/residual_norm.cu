// CUDA kernels for the fused scaled residual add + LayerNorm (docs/brief.md, "The fused operation").
//
// Same math as kernels/residual_norm.py (the Triton kernels), all in fp32 registers:
//   forward:  out = alpha*x + row_scale[b]*drop(h)  (stored rounded in out's dtype)
//             y   = (out_rounded - mean) * rstd * weight + bias
//   backward: g = g_out + LN_bwd(g_y); dx = alpha*g; dh = grad_scale[b]*drop'(g);
//             dweight/dbias as fp32 per-block partials summed in a fixed order; dalpha = sum(g*x).
//
// Work split: a "group" owns one row at a time. For D <= 1024 a group is one warp (8 rows in
// flight per 256-thread block, reductions by shuffles only); above, a group is the whole block
// (block-per-row, reductions through shared memory). Each thread holds CH chunks of VEC values of
// its row in registers: chunk c of a row belongs to thread (c % group_size), so consecutive
// threads touch consecutive 16-byte pieces (coalesced).

#include "residual_norm.h"
#include "storage.cuh"

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

namespace dres {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpRowThreads = 256;  // 8 rows per block on the warp-per-row path
constexpr int kMaxThreads = 512;      // 128 registers per thread at full residency

// ---------------------------------------------------------------------------------------------
// Reductions. The xor butterfly leaves the identical sum in every lane (each step adds the same
// two values, only commuted), so every thread of a row normalises with bit-identical statistics.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float2 warp_sum2(float2 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32
// float2; the leading barrier protects it from the previous call's readers.
__device__ __forceinline__ float2 block_sum2(float2 v, float2* scratch) {
  v = warp_sum2(v);
  const int lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? scratch[lane] : make_float2(0.f, 0.f);
  return warp_sum2(v);
}

template <bool WARP_ROW>
__device__ __forceinline__ float group_sum(float v, float2* scratch) {
  if constexpr (WARP_ROW) return warp_sum(v);
  return block_sum2(make_float2(v, 0.f), scratch).x;
}

template <bool WARP_ROW>
__device__ __forceinline__ float2 group_sum2(float2 v, float2* scratch) {
  if constexpr (WARP_ROW) return warp_sum2(v);
  return block_sum2(v, scratch);
}

// ---------------------------------------------------------------------------------------------
// Dropout of h: the stream of kernels/residual_norm.py bit for bit. Element i = r*D + c takes word i % 4 of
// Philox 4x32 with 10 rounds (Triton's tl.randint4x) at counter (i / 4 low word, high word, 0, 0), key the
// seed's halves, as a float in [0, 1) (Triton's uint_to_uniform_float), and is kept when that is >= p; so a
// seed drops the same elements on both backends and the backward redraws the forward's mask.

__device__ __forceinline__ uint4 philox4(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t a = c0, b = c2;
    c0 = __umulhi(0xCD9E8D57u, b) ^ c1 ^ k0;
    c2 = __umulhi(0xD2511F53u, a) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * b;
    c3 = 0xD2511F53u * a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ float uniform(uint32_t word) {
  int32_t v = static_cast<int32_t>(word);
  if (v < 0) v = ~v;
  return static_cast<float>(v) * 4.6566127342e-10f;
}

// keep / (1 - p) of VEC consecutive elements from flat index `index`: 0 or scale.
template <int VEC>
__device__ __forceinline__ void dropout_factors(uint64_t seed, int64_t index, float p, float scale,
                                                float (&f)[VEC]) {
  if constexpr (VEC % 4 == 0) {  // index % 4 == 0: the vector path needs D % 8 == 0 and 8-aligned columns
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      const uint4 w = philox4(seed, static_cast<uint64_t>(index / 4 + q));
      f[4 * q] = uniform(w.x) >= p ? scale : 0.f;
      f[4 * q + 1] = uniform(w.y) >= p ? scale : 0.f;
      f[4 * q + 2] = uniform(w.z) >= p ? scale : 0.f;
      f[4 * q + 3] = uniform(w.w) >= p ? scale : 0.f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const uint64_t i = static_cast<uint64_t>(index + e);
      const uint4 w = philox4(seed, i / 4);
      const uint32_t word = i % 4 == 0 ? w.x : i % 4 == 1 ? w.y : i % 4 == 2 ? w.z : w.w;
      f[e] = uniform(word) >= p ? scale : 0.f;
    }
  }
}

// Position of this thread within the row-owning group, and the group's place in the grid.
template <bool WARP_ROW>
struct Group {
  int lane, size, index, per_block;
  __device__ __forceinline__ Group() {
    lane = WARP_ROW ? static_cast<int>(threadIdx.x) % kWarp : static_cast<int>(threadIdx.x);
    size = WARP_ROW ? kWarp : static_cast<int>(blockDim.x);
    index = WARP_ROW ? static_cast<int>(threadIdx.x) / kWarp : 0;
    per_block = WARP_ROW ? static_cast<int>(blockDim.x) / kWarp : 1;
  }
};

// ---------------------------------------------------------------------------------------------
// Forward

template <int VEC, int CH, bool WARP_ROW>
__global__ void __launch_bounds__(kMaxThreads) residual_norm_fwd_kernel(const FwdParams p) {
  __shared__ float2 scratch[kWarp];
  const Group<WARP_ROW> grp;
  const int nchunks = p.D / VEC;
  const float alpha = p.alpha != nullptr ? load1(p.alpha, p.alpha_dt, 0) : p.alpha_value;
  const bool has_norm = p.y != nullptr;
  const uint64_t seed = p.seed != nullptr ? static_cast<uint64_t>(*p.seed) : 0u;

  // The row loop is uniform across a group, so the block-wide barriers inside block_sum2 are
  // reached by every thread of the block on the block-per-row path.
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * grp.per_block + grp.index; row < p.M;
       row += static_cast<int64_t>(gridDim.x) * grp.per_block) {
    float v[CH][VEC];
    float scale = 1.f;
    if (p.h != nullptr && p.row_scale != nullptr) scale = load1(p.row_scale, p.row_scale_dt, row / p.rows_per_sample);
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = grp.lane + k * grp.size;
      if (c < nchunks) {
        const int64_t col = static_cast<int64_t>(c) * VEC;
        load_vec<VEC>(p.x, p.x_dt, row * p.stride_x + col, v[k]);
        if (p.h != nullptr) {
          float hv[VEC];
          load_vec<VEC>(p.h, p.h_dt, row * p.stride_h + col, hv);
          if (p.seed != nullptr) {
            float f[VEC];
            dropout_factors<VEC>(seed, row * p.D + col, p.dropout_p, p.dropout_scale, f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) hv[e] *= f[e];
          }
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[k][e] = alpha * v[k][e] + hv[e] * scale;
          store_vec<VEC>(p.out, p.out_dt, row * p.stride_out + col, v[k]);
          // Normalise the value actually stored, so fused and unfused code agree on what the
          // next layer sees.
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[k][e] = round_to(v[k][e], p.out_dt);
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[k][e] = 0.f;
      }
    }
    if (!has_norm) continue;

    float s = 0.f;
#pragma unroll
    for (int k = 0; k < CH; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += v[k][e];  // padding chunks hold 0
    const float mean = group_sum<WARP_ROW>(s, scratch) / static_cast<float>(p.D);
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      if (grp.lane + k * grp.size < nchunks) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = v[k][e] - mean;
          q += d * d;
        }
      }
    }
    const float var = group_sum<WARP_ROW>(q, scratch) / static_cast<float>(p.D);
    const float rstd = 1.f / sqrtf(var + p.eps);
    if (grp.lane == 0) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = grp.lane + k * grp.size;
      if (c < nchunks) {
        const int64_t col = static_cast<int64_t>(c) * VEC;
        float yv[VEC], wv[VEC], bv[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) yv[e] = (v[k][e] - mean) * rstd;
        if (p.weight != nullptr) {
          load_vec<VEC>(p.weight, p.weight_dt, col, wv);
#pragma unroll
          for (int e = 0; e < VEC; ++e) yv[e] *= wv[e];
        }
        if (p.bias != nullptr) {
          load_vec<VEC>(p.bias, p.bias_dt, col, bv);
#pragma unroll
          for (int e = 0; e < VEC; ++e) yv[e] += bv[e];
        }
        store_vec<VEC>(p.y, p.y_dt, row * p.stride_y + col, yv);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: persistent grid. Block b handles row tiles b, b + P, b + 2P, ...; each thread adds
// the dweight/dbias contributions of its own columns into its group's slice of shared memory
// (no other thread touches those words, so no synchronisation and no atomics). Keeping these
// accumulators out of registers leaves room for the row itself (xhat and w*g_y, 2 x 32 values
// per thread at most): with them in registers the 32-values-per-thread shapes spilled. At the
// end the groups of a block are summed in group order and the block writes one row of partials.
// The grid size and the row -> (block, group) mapping depend only on M, D and the device, so the
// weight gradients are bit-identical from run to run.

template <int VEC>
__device__ __forceinline__ void smem_add(float* acc, int i, const float (&v)[VEC]) {
  if constexpr (VEC == 8) {  // i is a multiple of 8 floats: 32-byte aligned
    float4* q = reinterpret_cast<float4*>(acc + i);
    float4 a = q[0], b = q[1];
    a.x += v[0]; a.y += v[1]; a.z += v[2]; a.w += v[3];
    b.x += v[4]; b.y += v[5]; b.z += v[6]; b.w += v[7];
    q[0] = a;
    q[1] = b;
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[i + e] += v[e];
  }
}

template <int VEC, int CH, bool WARP_ROW>
__global__ void __launch_bounds__(kMaxThreads) residual_norm_bwd_kernel(const BwdParams p) {
  // [group][dweight | dbias][D] fp32, present only when a weight/bias gradient is asked for.
  extern __shared__ float4 acc_smem_f4[];
  float* acc_smem = reinterpret_cast<float*>(acc_smem_f4);
  __shared__ float2 scratch[kWarp];
  const Group<WARP_ROW> grp;
  const int D = p.D;
  const int nchunks = D / VEC;
  const float alpha = p.alpha != nullptr ? load1(p.alpha, p.alpha_dt, 0) : p.alpha_value;
  const bool has_gy = p.g_y != nullptr;
  const bool need_dw = p.dweight_part != nullptr, need_db = p.dbias_part != nullptr;
  const bool accumulate = need_dw || need_db;
  const uint64_t seed = p.seed != nullptr ? static_cast<uint64_t>(*p.seed) : 0u;
  float* acc_w = acc_smem + static_cast<size_t>(grp.index) * 2 * D;
  float* acc_b = acc_w + D;
  if (accumulate) {
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = grp.lane + k * grp.size;
      if (c < nchunks) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc_w[c * VEC + e] = acc_b[c * VEC + e] = 0.f;
      }
    }
  }
  float dalpha = 0.f;

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * grp.per_block + grp.index; row < p.M;
       row += static_cast<int64_t>(gridDim.x) * grp.per_block) {
    // LayerNorm backward part: xhat and w*g_y stay in registers across the row reduction.
    float xhat[CH][VEC], wgy[CH][VEC];
    float c1 = 0.f, c2 = 0.f, rstd = 0.f;
    if (has_gy) {
      const float mean = p.mean[row];
      rstd = p.rstd[row];
      float2 s = make_float2(0.f, 0.f);
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        const int c = grp.lane + k * grp.size;
        if (c < nchunks) {
          const int64_t col = static_cast<int64_t>(c) * VEC;
          float gy[VEC];
          load_vec<VEC>(p.normed, p.normed_dt, row * p.stride_normed + col, xhat[k]);
          load_vec<VEC>(p.g_y, p.g_y_dt, row * p.stride_gy + col, gy);
          if (p.weight != nullptr) {
            load_vec<VEC>(p.weight, p.weight_dt, col, wgy[k]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) wgy[k][e] = 1.f;
          }
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            xhat[k][e] = (xhat[k][e] - mean) * rstd;
            wgy[k][e] *= gy[e];
            s.x += xhat[k][e] * wgy[k][e];
            s.y += wgy[k][e];
          }
          if (accumulate) {
            float t[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) t[e] = gy[e] * xhat[k][e];
            if (need_dw) smem_add<VEC>(acc_w, c * VEC, t);
            if (need_db) smem_add<VEC>(acc_b, c * VEC, gy);
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) xhat[k][e] = wgy[k][e] = 0.f;
        }
      }
      s = group_sum2<WARP_ROW>(s, scratch);
      c1 = s.x / static_cast<float>(D);
      c2 = s.y / static_cast<float>(D);
    }
    float gscale = 1.f;
    if (p.dh != nullptr && p.grad_scale != nullptr)
      gscale = load1(p.grad_scale, p.grad_scale_dt, row / p.rows_per_sample);
    // g = g_out + LN_bwd(g_y); dx = alpha*g; dh = grad_scale[b]*g; dalpha += g*x.
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = grp.lane + k * grp.size;
      if (c >= nchunks) continue;
      const int64_t col = static_cast<int64_t>(c) * VEC;
      float g[VEC], t[VEC];
      if (p.g_out != nullptr) {
        load_vec<VEC>(p.g_out, p.g_out_dt, row * p.stride_gout + col, g);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[e] = 0.f;
      }
      if (has_gy) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[e] += (wgy[k][e] - (xhat[k][e] * c1 + c2)) * rstd;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) t[e] = alpha * g[e];
      store_vec<VEC>(p.dx, p.dx_dt, row * p.stride_dx + col, t);
      if (p.dh != nullptr) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) t[e] = g[e] * gscale;
        if (p.seed != nullptr) {
          float f[VEC];
          dropout_factors<VEC>(seed, row * D + col, p.dropout_p, p.dropout_scale, f);
#pragma unroll
          for (int e = 0; e < VEC; ++e) t[e] *= f[e];
        }
        store_vec<VEC>(p.dh, p.dh_dt, row * p.stride_dh + col, t);
      }
      if (p.dalpha_part != nullptr) {
        load_vec<VEC>(p.x, p.x_dt, row * p.stride_x + col, t);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dalpha += g[e] * t[e];
      }
    }
  }

  // Per-block partials: the groups' slices summed in group order (fixed: deterministic).
  if (accumulate) {
    __syncthreads();
    const int64_t base = static_cast<int64_t>(blockIdx.x) * D;
    for (int col = threadIdx.x; col < D; col += blockDim.x) {
      float w = 0.f, b = 0.f;
      for (int gi = 0; gi < grp.per_block; ++gi) {
        w += acc_smem[static_cast<size_t>(gi) * 2 * D + col];
        b += acc_smem[static_cast<size_t>(gi) * 2 * D + D + col];
      }
      if (need_dw) p.dweight_part[base + col] = w;
      if (need_db) p.dbias_part[base + col] = b;
    }
  }
  if (p.dalpha_part != nullptr) {
    const float total = block_sum2(make_float2(dalpha, 0.f), scratch).x;
    if (threadIdx.x == 0) p.dalpha_part[blockIdx.x] = total;
  }
}

// Column sums of the partials, each column by one thread in block order: a fixed order.
__global__ void finalize_kernel(const float* __restrict__ dweight_part, const float* __restrict__ dbias_part,
                                const float* __restrict__ dalpha_part, int P, int D, float* dweight, float* dbias,
                                float* dalpha) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col < D) {
    if (dweight_part != nullptr) {
      float s = 0.f;
#pragma unroll 8
      for (int b = 0; b < P; ++b) s += dweight_part[static_cast<int64_t>(b) * D + col];
      dweight[col] = s;
    }
    if (dbias_part != nullptr) {
      float s = 0.f;
#pragma unroll 8
      for (int b = 0; b < P; ++b) s += dbias_part[static_cast<int64_t>(b) * D + col];
      dbias[col] = s;
    }
  }
  if (dalpha_part != nullptr && col == 0) {
    float s = 0.f;
    for (int b = 0; b < P; ++b) s += dalpha_part[b];
    *dalpha = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch from the run-time launch shape to the template instantiations.

using FwdKernel = void (*)(FwdParams);
using BwdKernel = void (*)(BwdParams);

template <int VEC, int CH>
FwdKernel fwd_kernel_for(bool warp) {
  return warp ? residual_norm_fwd_kernel<VEC, CH, true> : residual_norm_fwd_kernel<VEC, CH, false>;
}
template <int VEC, int CH>
BwdKernel bwd_kernel_for(bool warp) {
  return warp ? residual_norm_bwd_kernel<VEC, CH, true> : residual_norm_bwd_kernel<VEC, CH, false>;
}

// Chunk counts: VEC 8 -> 1, 2, 4 chunks (8-32 values per thread); VEC 1 -> 8, 16, 32.
FwdKernel fwd_kernel(const LaunchShape& s) {
  if (s.vec == 8) {
    switch (s.chunks) {
      case 1: return fwd_kernel_for<8, 1>(s.warp_per_row);
      case 2: return fwd_kernel_for<8, 2>(s.warp_per_row);
      default: return fwd_kernel_for<8, 4>(s.warp_per_row);
    }
  }
  switch (s.chunks) {
    case 8: return fwd_kernel_for<1, 8>(s.warp_per_row);
    case 16: return fwd_kernel_for<1, 16>(s.warp_per_row);
    default: return fwd_kernel_for<1, 32>(s.warp_per_row);
  }
}

BwdKernel bwd_kernel(const LaunchShape& s) {
  if (s.vec == 8) {
    switch (s.chunks) {
      case 1: return bwd_kernel_for<8, 1>(s.warp_per_row);
      case 2: return bwd_kernel_for<8, 2>(s.warp_per_row);
      default: return bwd_kernel_for<8, 4>(s.warp_per_row);
    }
  }
  switch (s.chunks) {
    case 8: return bwd_kernel_for<1, 8>(s.warp_per_row);
    case 16: return bwd_kernel_for<1, 16>(s.warp_per_row);
    default: return bwd_kernel_for<1, 32>(s.warp_per_row);
  }
}

int rows_per_block(const LaunchShape& s) { return s.warp_per_row ? s.threads / kWarp : 1; }

// Shared memory of the backward: each group's dweight and dbias accumulators.
size_t bwd_smem_bytes(const LaunchShape& s, int D, bool accumulate) {
  return accumulate ? static_cast<size_t>(rows_per_block(s)) * 2 * D * sizeof(float) : 0;
}

}  // namespace

LaunchShape choose_shape(int D, bool vectorizable) {
  LaunchShape s;
  s.vec = vectorizable ? 8 : 1;
  const int nchunks = D / s.vec;
  const int base = s.vec == 8 ? 1 : 8;  // the smallest chunk count instantiated for this VEC
  if (nchunks <= kWarp * 4 * base) {    // D <= 1024: a warp per row
    s.warp_per_row = true;
    s.threads = kWarpRowThreads;
    s.chunks = base;
    while (kWarp * s.chunks < nchunks) s.chunks *= 2;
  } else {  // a block per row, as few values per thread as 512 threads allow
    s.warp_per_row = false;
    s.chunks = base;
    while ((nchunks + s.chunks - 1) / s.chunks > kMaxThreads) s.chunks *= 2;
    const int threads = (nchunks + s.chunks - 1) / s.chunks;
    s.threads = (threads + kWarp - 1) / kWarp * kWarp;
  }
  return s;
}

void launch_forward(const FwdParams& p, const LaunchShape& s, int num_sms, cudaStream_t stream) {
  const int64_t tiles = (p.M + rows_per_block(s) - 1) / rows_per_block(s);
  // The row loop is grid-strided, so the grid need not cover every row: cap it at many waves.
  const int64_t cap = static_cast<int64_t>(num_sms) * 64;
  const int grid = static_cast<int>(tiles < cap ? tiles : cap);
  fwd_kernel(s)<<<grid, s.threads, 0, stream>>>(p);
}

void launch_backward(const BwdParams& p, const LaunchShape& s, int blocks, cudaStream_t stream) {
  const bool accumulate = p.dweight_part != nullptr || p.dbias_part != nullptr;
  bwd_kernel(s)<<<blocks, s.threads, bwd_smem_bytes(s, p.D, accumulate), stream>>>(p);
}

int backward_blocks(const LaunchShape& s, int device, int num_sms, int64_t M, int D, bool accumulate) {
  // Resident blocks per SM of this kernel with this much shared memory, cached per device; the
  // first query for a kernel also raises its dynamic shared memory limit to the most any D of
  // its shape needs (above the 48 KB default from D = 768 on the warp path, D = 6144 per block).
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  const void* kernel = reinterpret_cast<const void*>(bwd_kernel(s));
  const size_t smem = bwd_smem_bytes(s, D, accumulate);
  const auto key = std::make_tuple(device, kernel, s.threads, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const int max_dim = s.warp_per_row ? kWarp * s.chunks * s.vec : kMaxDim;
    const size_t max_smem = bwd_smem_bytes(s, max_dim, true);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return -static_cast<int>(max_smem);  // ops.cpp reports it
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, s.threads, smem) != cudaSuccess || n < 1) {
      (void)cudaGetLastError();
      n = 1;  // a one-block-per-SM grid is still correct
    }
    it = cache.emplace(key, n).first;
  }
  const int64_t tiles = (M + rows_per_block(s) - 1) / rows_per_block(s);
  const int64_t slots = static_cast<int64_t>(it->second) * num_sms;
  const int64_t blocks = tiles < slots ? tiles : slots;
  return static_cast<int>(blocks > 0 ? blocks : 1);
}

void launch_finalize(const float* dweight_part, const float* dbias_part, const float* dalpha_part, int P, int D,
                     float* dweight, float* dbias, float* dalpha, cudaStream_t stream) {
  const int threads = 256;
  const int grid = (D + threads - 1) / threads;
  finalize_kernel<<<grid > 0 ? grid : 1, threads, 0, stream>>>(dweight_part, dbias_part, dalpha_part, P, D, dweight,
                                                                dbias, dalpha);
}

}  // namespace dres
