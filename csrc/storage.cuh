// Reading and writing the kernels' storage dtypes (residual_norm.h's DType codes) as fp32 values,
// shared by residual_norm.cu and bias_gelu.cu.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "residual_norm.h"

namespace dres {

// Conversions. Raw-bit forms so they work under torch's -D__CUDA_NO_HALF/BFLOAT16_CONVERSIONS__.
// Rounding to bf16/fp16 is round-to-nearest-even, as torch's .to() and Triton's casts.

__device__ __forceinline__ float bf16_bits_to_float(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ float f16_bits_to_float(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}
__device__ __forceinline__ uint32_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
__device__ __forceinline__ uint32_t float_to_f16_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }

__device__ __forceinline__ float half_bits_to_float(uint32_t b, int dt) {
  return dt == kBF16 ? bf16_bits_to_float(b) : f16_bits_to_float(b);
}
__device__ __forceinline__ uint32_t float_to_half_bits(float f, int dt) {
  return dt == kBF16 ? float_to_bf16_bits(f) : float_to_f16_bits(f);
}

// The value a float becomes once stored in dtype dt and read back.
__device__ __forceinline__ float round_to(float f, int dt) {
  return dt == kF32 ? f : half_bits_to_float(float_to_half_bits(f, dt), dt);
}

__device__ __forceinline__ float load1(const void* base, int dt, int64_t i) {
  if (dt == kF32) return static_cast<const float*>(base)[i];
  return half_bits_to_float(static_cast<const uint16_t*>(base)[i], dt);
}

// Load VEC consecutive values starting at element i. VEC == 8: one 16-byte load (bf16/fp16) or
// two (fp32); the host only picks VEC == 8 when base, row strides and D make every such access
// 16-byte aligned. READ_ONLY: through the non-coherent cache (__ldg), for tensors no thread of the
// kernel writes; false where the kernel overwrites what it reads (an output aliasing the input).
template <int VEC, bool READ_ONLY = true>
__device__ __forceinline__ void load_vec(const void* base, int dt, int64_t i, float (&v)[VEC]) {
  if constexpr (VEC == 8) {
    if (dt == kF32) {
      const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
      const float4 a = READ_ONLY ? __ldg(q) : q[0], b = READ_ONLY ? __ldg(q + 1) : q[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
      const uint4 r = READ_ONLY ? __ldg(q) : q[0];
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // little-endian: the lower address is the low half
        v[2 * k] = half_bits_to_float(w[k] & 0xffffu, dt);
        v[2 * k + 1] = half_bits_to_float(w[k] >> 16, dt);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = load1(base, dt, i + k);
  }
}

template <int VEC>
__device__ __forceinline__ void store_vec(void* base, int dt, int64_t i, const float (&v)[VEC]) {
  if constexpr (VEC == 8) {
    if (dt == kF32) {
      float4* q = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
      q[0] = make_float4(v[0], v[1], v[2], v[3]);
      q[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = float_to_half_bits(v[2 * k], dt) | (float_to_half_bits(v[2 * k + 1], dt) << 16);
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (dt == kF32)
        static_cast<float*>(base)[i + k] = v[k];
      else
        static_cast<uint16_t*>(base)[i + k] = static_cast<uint16_t>(float_to_half_bits(v[k], dt));
    }
  }
}

}  // namespace dres
