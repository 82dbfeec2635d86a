// Parameter blocks and launchers shared by ops.cpp (host, C++) and residual_norm.cu (kernels).
//
// The storage dtype of every tensor is a run-time code rather than a template parameter: the
// forward touches 4 large tensors and the backward 6, each fp32/bf16/fp16, so templating on all
// of them would mean 81 forward and 729 backward instantiations per tile shape. The dtype test
// is uniform across the whole grid (no divergence) and costs a few instructions per 16-byte
// vector in a memory-bound kernel; the tile shape, which decides register allocation, is the
// template parameter instead.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dres {

// Storage dtypes the kernels read and write (matches dres.ops.checks.KERNEL_DTYPES).
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// The largest row length (dres.kernels.MAX_DIM): 512 threads x 32 values per thread.
constexpr int kMaxDim = 16384;

struct FwdParams {
  const void* x;          // (M, D) rows, unit column stride
  const void* h;          // nullptr: layer_norm only (out unused, the norm reads x)
  void* out;              // residual stream out, written when h != nullptr
  void* y;                // nullptr: residual_add only (no norm)
  const void* weight;     // (D,) or nullptr
  const void* bias;       // (D,) or nullptr
  const void* alpha;      // 0-dim tensor, or nullptr to use alpha_value
  const void* row_scale;  // (B,) or nullptr (= 1)
  float* mean;            // (M,) fp32, written when y != nullptr
  float* rstd;
  const int64_t* seed;    // dropout of h: the Philox seed (one value), or nullptr (no dropout)
  int64_t stride_x, stride_h, stride_out, stride_y;  // row strides in elements
  int x_dt, h_dt, out_dt, y_dt, weight_dt, bias_dt, alpha_dt, row_scale_dt;
  int64_t M;
  int D;
  int64_t rows_per_sample;
  float alpha_value;
  float eps;
  float dropout_p, dropout_scale;  // p and 1 / (1 - p), read when seed != nullptr
};

struct BwdParams {
  const void* g_out;       // (M, D) or nullptr
  const void* g_y;         // (M, D) or nullptr (no norm gradient)
  const void* normed;      // what the forward normalised (stored out, or x for layer_norm)
  const void* x;           // the forward's x, read only for dalpha
  const void* weight;      // (D,) or nullptr
  const float* mean;       // (M,)
  const float* rstd;
  const void* alpha;       // 0-dim tensor, or nullptr to use alpha_value
  const void* grad_scale;  // (B,) or nullptr (= 1)
  void* dx;                // (M, D)
  void* dh;                // (M, D) or nullptr (h needs no gradient / no h)
  float* dweight_part;     // (P, D) per-block partial sums, or nullptr
  float* dbias_part;       // (P, D) or nullptr
  float* dalpha_part;      // (P,) or nullptr
  const int64_t* seed;     // the forward's dropout seed (dh gets its mask), or nullptr
  int64_t stride_gout, stride_gy, stride_normed, stride_x, stride_dx, stride_dh;
  int g_out_dt, g_y_dt, normed_dt, x_dt, weight_dt, alpha_dt, grad_scale_dt, dx_dt, dh_dt;
  int64_t M;
  int D;
  int64_t rows_per_sample;
  float alpha_value;
  float dropout_p, dropout_scale;
};

// Launch shape for rows of length D: 8-wide vectors when every tensor allows 16-byte accesses,
// a warp per row for D <= 1024, a block per row above.
struct LaunchShape {
  int vec;      // 8 or 1 values per access
  int chunks;   // vec-wide chunks per thread (upper bound; the template parameter)
  bool warp_per_row;
  int threads;  // threads per block
};

LaunchShape choose_shape(int D, bool vectorizable);

// Forward: returns nothing; errors surface through C10_CUDA_KERNEL_LAUNCH_CHECK in ops.cpp.
void launch_forward(const FwdParams& p, const LaunchShape& s, int num_sms, cudaStream_t stream);

// Backward: `blocks` is the persistent grid size (rows of the partial buffers).
void launch_backward(const BwdParams& p, const LaunchShape& s, int blocks, cudaStream_t stream);

// Persistent grid for the backward: as many blocks as can be resident at once on the device,
// never more than there are row tiles (the occupancy query is cached per device and shape).
// `accumulate`: dweight or dbias is asked for (the kernel then keeps accumulators in shared
// memory). Returns -bytes when the kernel could not be given the shared memory it needs.
int backward_blocks(const LaunchShape& s, int device, int num_sms, int64_t M, int D, bool accumulate);

// Fixed-order column sums of the (P, D) partials (and the (P,) dalpha partials) into fp32 outputs.
void launch_finalize(const float* dweight_part, const float* dbias_part, const float* dalpha_part, int P, int D,
                     float* dweight, float* dbias, float* dalpha, cudaStream_t stream);

}  // namespace dres
