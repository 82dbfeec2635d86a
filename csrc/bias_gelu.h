// Parameter block and launchers of the MLP activation kernels (bias_gelu.cu), used by ops.cpp.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dres {

// The GELU of F.gelu's `approximate` ("none", "tanh") and QuickGELU ("quick"), as dres.kernels.bias_gelu.GELU_KINDS.
enum GeluKind : int { kGeluErf = 0, kGeluTanh = 1, kGeluQuick = 2 };

struct BiasGeluParams {
  const void* g;       // backward: the gradient of act, (M, N) rows; nullptr in the forward
  const void* pre;     // (M, N) rows, unit column stride
  const void* bias;    // (N,) or nullptr
  void* act;           // forward: the output; backward: act recomputed, or nullptr
  void* dpre;          // backward: (M, N), may be g itself (each element read before it is written)
  float* dbias_part;   // backward: (strips, N) fp32 partial column sums, or nullptr
  int64_t stride_g, stride_pre, stride_act, stride_dpre;  // row strides in elements
  int g_dt, pre_dt, bias_dt, act_dt, dpre_dt;
  int64_t M;
  int N;
  int gelu;            // GeluKind
  int64_t rows_per_strip;  // backward: rows a strip of blocks walks (its partial sums' extent)
};

// Threads of a block: x covers columns (vec values each), y rows in flight.
struct BiasGeluShape {
  int vec;       // 8 or 1 values per access
  dim3 block;
  int col_blocks;
};

BiasGeluShape choose_bias_gelu_shape(int N, bool vectorizable);

void launch_bias_gelu_forward(const BiasGeluParams& p, const BiasGeluShape& s, int num_sms, cudaStream_t stream);

// Row strips of the backward (the rows of its partial sums): as many as fill the device a few
// blocks an SM, never more than there are rows to give them; a function of (M, N, device) only,
// so dbias is bit-identical from run to run.
int64_t bias_gelu_strips(const BiasGeluShape& s, int num_sms, int64_t M);

void launch_bias_gelu_backward(const BiasGeluParams& p, const BiasGeluShape& s, int64_t strips, cudaStream_t stream);

}  // namespace dres
