// The dres_cuda:: torch ops: the same schemas as the dres:: custom ops of
// dres/ops/residual_norm.py (so dres.ops dispatches backend="cuda" to torch.ops.dres_cuda.<name>
// with the same arguments), implemented by the kernels of residual_norm.cu.
//
// Registered for the CUDA dispatch key, and for Autograd by the C++ Functions at the end of this file
// (an eager call pays no Python for its graph node or its backward). Fake (meta) kernels are
// registered from Python in dres/ops/csrc_backend.py, sharing the Triton ops' code; set_python_module
// below makes torch import that module whenever it needs them (e.g. under torch.compile).

#include <Python.h>

// Only c10's light CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers,
// which a minimal CUDA toolkit (as on the CI machine) does not ship.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>

#include "bias_gelu.h"
#include "residual_norm.h"

// `import dres._C` loads this library (running the TORCH_LIBRARY registrations below); the
// module itself is empty, so no pybind11 is needed.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "dres CUDA ops (torch.ops.dres_cuda)", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
}

namespace dres {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Error messages build their numbers with std::to_string, never by streaming an integer: on the
// GPU image (torch 2.11, nvcc 13.0) `stream << int64_t` inside this library (TORCH_CHECK formats
// through std::ostream) jumped into a mismatched libstdc++ instantiation and segfaulted, while
// strings and torch's own printers (Device, ScalarType) stream fine.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

int dtype_code(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, name, " has dtype ", t, "; supported: float32, bfloat16, float16");
  }
  return kF32;  // unreachable
}

// A 2-D (rows, D) view with unit column stride; copies only when no such view exists (as
// dres.ops.residual_norm.as_rows). Row strides stay as they are (a stride-0 expanded gradient
// is read in place).
Tensor as_rows(const Tensor& t) {
  const Tensor u = t.stride(-1) == 1 ? t : t.contiguous();
  return u.reshape({-1, u.size(-1)});
}

void check_tensor(const Tensor& t, const char* name, const Tensor& like) {
  TORCH_CHECK(t.defined(), name, " is an undefined tensor");
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but x is on ", like.device());
  dtype_code(t.scalar_type(), name);
}

void check_rows(const Tensor& t, const char* name, const Tensor& x) {
  check_tensor(t, name, x);
  TORCH_CHECK(t.sizes() == x.sizes(), name, " has shape ", shape(t.sizes()), " but x has ", shape(x.sizes()), "; they must match");
}

// An optional tensor argument counts as given only when it holds a defined tensor: C++ and
// autograd callers may pass an undefined Tensor in place of None, and every accessor of an
// undefined tensor (sizes, device, data_ptr) is an error or worse.
bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// Parameters (weight, bias) as contiguous (D,) tensors.
Tensor param(const OptTensor& t, const char* name, const Tensor& x) {
  if (!present(t)) return Tensor();
  check_tensor(*t, name, x);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(-1), name, " has shape ", shape(t->sizes()), "; expected (",
              num(x.size(-1)), ",) to match x's last dimension");
  return t->contiguous();
}

// alpha: a 0-dim (one element) tensor read by the kernel, so a new value costs nothing.
Tensor alpha_tensor(const OptTensor& t, const Tensor& x) {
  if (!present(t)) return Tensor();
  check_tensor(*t, "alpha", x);
  TORCH_CHECK(t->numel() == 1, "alpha must be a 0-dim tensor, got shape ", shape(t->sizes()));
  return t->contiguous();
}

// Per-sample factors (B,); returns the tensor and rows_per_sample.
Tensor sample_scale(const OptTensor& t, const char* name, const Tensor& x, int64_t rows, int64_t* rows_per_sample) {
  *rows_per_sample = 1;
  if (!present(t)) return Tensor();
  check_tensor(*t, name, x);
  TORCH_CHECK(t->dim() == 1 && t->size(0) > 0, name, " must be a non-empty 1-D tensor (B,), got shape ", shape(t->sizes()));
  TORCH_CHECK(rows % t->size(0) == 0, "x has ", num(rows), " rows, not divisible by len(", name, ") = ", num(t->size(0)));
  *rows_per_sample = rows / t->size(0);
  return t->contiguous();
}

// eps first: a scalar, so the check holds before (and without) any tensor or device access.
void check_eps(double eps) { TORCH_CHECK(std::isfinite(eps) && eps > 0, "eps must be a positive finite float"); }

void check_x(const Tensor& x, const char* name = "x") {
  TORCH_CHECK(x.defined(), name, " is an undefined tensor");
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor, got one on ", x.device());
  dtype_code(x.scalar_type(), name);
  TORCH_CHECK(x.dim() >= 2, name, " must have shape (B, T, D) or (M, D), got ", shape(x.sizes()));
  TORCH_CHECK(x.size(-1) > 0, name, " has an empty last dimension (D = 0)");
  TORCH_CHECK(x.size(-1) <= kMaxDim, name, " has D = ", num(x.size(-1)), ", above the kernels' maximum of ", num(kMaxDim));
}

const void* ptr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
int code(const Tensor& t) { return t.defined() ? dtype_code(t.scalar_type(), "tensor") : kF32; }
int64_t row_stride(const Tensor& t) { return t.defined() ? t.stride(0) : 0; }

// 16-byte accesses of 8 values need D % 8 == 0 and every row start 16-byte aligned: aligned base
// pointers and row strides that are multiples of 8 elements (any dtype: 8 x 2 or 8 x 4 bytes).
bool vectorizable(int64_t D, std::initializer_list<const Tensor*> ts) {
  if (D % 8 != 0) return false;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
    if (t->dim() == 2 && t->size(0) > 1 && t->stride(0) % 8 != 0) return false;
  }
  return true;
}

// Multiprocessors of the current device, cached (queried once per device).
int num_sms() {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  const int dev = c10::cuda::current_device();
  if (dev < kMaxDevices) {
    if (const int n = cache[dev].load(std::memory_order_relaxed)) return n;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// The dropout of h: p in [0, 1); with p > 0 the seed, one int64 on x's device, read by the kernels.
// Returns the seed to pass, undefined without dropout.
Tensor dropout_seed(double dropout_p, const OptTensor& seed, const Tensor& x) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p == 0) return Tensor();
  TORCH_CHECK(present(seed), "dropout_p > 0 needs a seed");
  TORCH_CHECK(seed->is_cuda() && seed->device() == x.device() && seed->scalar_type() == at::kLong &&
                  seed->numel() == 1,
              "seed must be one int64 on x's device (", x.device(), ")");
  return seed->contiguous();
}

void set_dropout(const Tensor& seed, double dropout_p, const int64_t** p_seed, float* p_dropout_p, float* p_scale) {
  *p_seed = seed.defined() ? seed.data_ptr<int64_t>() : nullptr;
  *p_dropout_p = static_cast<float>(dropout_p);
  *p_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
}

// Shared forward: out (when h is given) and y/mean/rstd (when norm is true).
void forward(const Tensor& x2, const Tensor& h2, const Tensor& weight, const Tensor& bias, const Tensor& alpha,
             double alpha_value, double eps, const Tensor& row_scale, int64_t rows_per_sample, const Tensor& out2,
             const Tensor& y2, const Tensor& mean, const Tensor& rstd, double dropout_p, const Tensor& seed) {
  const int64_t M = x2.size(0);
  if (M == 0) return;
  const int D = static_cast<int>(x2.size(1));
  FwdParams p{};
  p.x = x2.data_ptr();
  p.h = ptr(h2);
  p.out = h2.defined() ? out2.data_ptr() : nullptr;
  p.y = y2.defined() ? y2.data_ptr() : nullptr;
  p.weight = ptr(weight);
  p.bias = ptr(bias);
  p.alpha = ptr(alpha);
  p.row_scale = ptr(row_scale);
  p.mean = y2.defined() ? mean.data_ptr<float>() : nullptr;
  p.rstd = y2.defined() ? rstd.data_ptr<float>() : nullptr;
  p.stride_x = x2.stride(0);
  p.stride_h = row_stride(h2);
  p.stride_out = h2.defined() ? row_stride(out2) : 0;
  p.stride_y = row_stride(y2);
  p.x_dt = code(x2);
  p.h_dt = code(h2);
  p.out_dt = h2.defined() ? code(out2) : kF32;
  p.y_dt = code(y2);
  p.weight_dt = code(weight);
  p.bias_dt = code(bias);
  p.alpha_dt = code(alpha);
  p.row_scale_dt = code(row_scale);
  p.M = M;
  p.D = D;
  p.rows_per_sample = rows_per_sample;
  p.alpha_value = static_cast<float>(alpha_value);
  p.eps = static_cast<float>(eps);
  set_dropout(seed, dropout_p, &p.seed, &p.dropout_p, &p.dropout_scale);
  const Tensor none;
  const LaunchShape s =
      choose_shape(D, vectorizable(D, {&x2, &h2, h2.defined() ? &out2 : &none, &y2, &weight, &bias}));
  launch_forward(p, s, num_sms(), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Tensor stats(const Tensor& x) {
  return at::empty({x.numel() / x.size(-1)}, x.options().dtype(at::kFloat));
}

// ---------------------------------------------------------------------------------------------
// The ops (schemas in TORCH_LIBRARY below)

std::tuple<Tensor, Tensor, Tensor, Tensor> residual_layer_norm(
    const Tensor& x, const Tensor& h, const OptTensor& weight, const OptTensor& bias, const OptTensor& alpha,
    double alpha_value, double eps, const OptTensor& row_scale, const OptTensor& grad_scale,
    std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> out_dtype, double dropout_p,
    const OptTensor& seed) {
  // Every argument is checked before anything else happens (device guard, allocations).
  check_eps(eps);
  check_x(x);
  check_rows(h, "h", x);
  const Tensor sd = dropout_seed(dropout_p, seed, x);
  const int64_t rows = x.numel() / x.size(-1);
  int64_t rps = 1, unused = 1;
  const Tensor w = param(weight, "weight", x), b = param(bias, "bias", x), a = alpha_tensor(alpha, x);
  const Tensor rs = sample_scale(row_scale, "row_scale", x, rows, &rps);
  sample_scale(grad_scale, "grad_scale", x, rows, &unused);  // checked here, used by the backward
  if (residual_dtype.has_value()) dtype_code(*residual_dtype, "residual_dtype");
  if (out_dtype.has_value()) dtype_code(*out_dtype, "out_dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty(x.sizes(), x.options().dtype(residual_dtype.value_or(x.scalar_type())));
  Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype.value_or(h.scalar_type())));
  dtype_code(out.scalar_type(), "residual_dtype");
  dtype_code(y.scalar_type(), "out_dtype");
  Tensor mean = stats(x), rstd = stats(x);
  forward(as_rows(x), as_rows(h), w, b, a, alpha_value, eps, rs, rps, out.view({-1, x.size(-1)}),
          y.view({-1, x.size(-1)}), mean, rstd, dropout_p, sd);
  return {out, y, mean, rstd};
}

Tensor residual_add(const Tensor& x, const Tensor& h, const OptTensor& alpha, double alpha_value,
                    const OptTensor& row_scale, const OptTensor& grad_scale,
                    std::optional<at::ScalarType> residual_dtype, double dropout_p, const OptTensor& seed) {
  check_x(x);
  check_rows(h, "h", x);
  const Tensor sd = dropout_seed(dropout_p, seed, x);
  const int64_t rows = x.numel() / x.size(-1);
  int64_t rps = 1, unused = 1;
  const Tensor a = alpha_tensor(alpha, x);
  const Tensor rs = sample_scale(row_scale, "row_scale", x, rows, &rps);
  sample_scale(grad_scale, "grad_scale", x, rows, &unused);
  if (residual_dtype.has_value()) dtype_code(*residual_dtype, "residual_dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty(x.sizes(), x.options().dtype(residual_dtype.value_or(x.scalar_type())));
  dtype_code(out.scalar_type(), "residual_dtype");
  forward(as_rows(x), as_rows(h), Tensor(), Tensor(), a, alpha_value, 0.0, rs, rps, out.view({-1, x.size(-1)}),
          Tensor(), Tensor(), Tensor(), dropout_p, sd);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                              double eps, std::optional<at::ScalarType> out_dtype) {
  check_eps(eps);
  check_x(x);
  const Tensor w = param(weight, "weight", x), b = param(bias, "bias", x);
  if (out_dtype.has_value()) dtype_code(*out_dtype, "out_dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
  dtype_code(y.scalar_type(), "out_dtype");
  Tensor mean = stats(x), rstd = stats(x);
  forward(as_rows(x), Tensor(), w, b, Tensor(), 1.0, eps, Tensor(), 1, Tensor(), y.view({-1, x.size(-1)}), mean,
          rstd, 0.0, Tensor());
  return {y, mean, rstd};
}

// (dx, dh, dweight fp32, dbias fp32, dalpha fp32); gradients not asked for come back as empty
// (0,) tensors, exactly as dres::residual_norm_backward.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> residual_norm_backward(
    const OptTensor& g_out, const OptTensor& g_y, const OptTensor& normed, const OptTensor& x,
    const OptTensor& weight, const OptTensor& mean, const OptTensor& rstd, const OptTensor& alpha, double alpha_value,
    const OptTensor& grad_scale, at::ScalarType x_dtype, std::optional<at::ScalarType> h_dtype, bool need_dweight,
    bool need_dbias, bool need_dalpha, double dropout_p, const OptTensor& seed) {
  // Every argument is checked before anything else happens (device guard, allocations);
  // optionals holding an undefined tensor count as absent.
  const bool has_gout = present(g_out), has_gy = present(g_y);
  TORCH_CHECK(has_gout || has_gy, "residual_norm_backward needs g_out or g_y");
  const Tensor& ref = has_gout ? *g_out : *g_y;
  check_x(ref, has_gout ? "g_out" : "g_y");
  const int64_t D = ref.size(-1), M = ref.numel() / D;
  need_dweight = need_dweight && has_gy;
  need_dbias = need_dbias && has_gy;
  if (has_gout && has_gy) check_rows(*g_y, "g_y", ref);
  if (has_gy) {
    TORCH_CHECK(present(normed) && present(mean) && present(rstd),
                "residual_norm_backward: g_y needs normed, mean and rstd");
    check_rows(*normed, "normed", ref);
    for (const Tensor* s : {&*mean, &*rstd}) {
      TORCH_CHECK(s->is_cuda() && s->device() == ref.device() && s->scalar_type() == at::kFloat && s->numel() == M,
                  "mean/rstd must be fp32 CUDA tensors on g's device with one value per row (", num(M), ")");
    }
  }
  if (need_dalpha) {
    TORCH_CHECK(present(x), "residual_norm_backward: need_dalpha needs x");
    check_rows(*x, "x", ref);
  }
  const Tensor w = param(weight, "weight", ref), a = alpha_tensor(alpha, ref);
  int64_t rps = 1;
  const Tensor gs = sample_scale(grad_scale, "grad_scale", ref, M, &rps);
  const Tensor sd = dropout_seed(dropout_p, seed, ref);

  dtype_code(x_dtype, "x_dtype");
  if (h_dtype.has_value()) dtype_code(*h_dtype, "h_dtype");
  const c10::cuda::CUDAGuard guard(ref.device());
  const auto opts = ref.options();
  Tensor dx = at::empty(ref.sizes(), opts.dtype(x_dtype));
  Tensor dh = h_dtype.has_value() ? at::empty(ref.sizes(), opts.dtype(*h_dtype)) : Tensor();
  const auto f32 = opts.dtype(at::kFloat);
  // Separate empties: an op's outputs must not alias one another.
  Tensor dweight = at::empty({need_dweight ? D : 0}, f32);
  Tensor dbias = at::empty({need_dbias ? D : 0}, f32);
  Tensor dalpha = need_dalpha ? at::empty({}, f32) : at::empty({0}, f32);

  if (M == 0) {  // nothing to launch; parameter gradients of no rows are zero
    if (need_dweight) dweight.zero_();
    if (need_dbias) dbias.zero_();
    if (need_dalpha) dalpha.zero_();
    return {dx, dh.defined() ? dh : at::empty({0}, opts.dtype(x_dtype)), dweight, dbias, dalpha};
  }

  const Tensor go2 = has_gout ? as_rows(*g_out) : Tensor();
  const Tensor gy2 = has_gy ? as_rows(*g_y) : Tensor();
  const Tensor nm2 = has_gy ? as_rows(*normed) : Tensor();
  const Tensor x2 = need_dalpha ? as_rows(*x) : Tensor();
  const Tensor mean1 = has_gy ? mean->contiguous() : Tensor();
  const Tensor rstd1 = has_gy ? rstd->contiguous() : Tensor();
  const Tensor dx2 = dx.view({-1, D});
  const Tensor dh2 = dh.defined() ? dh.view({-1, D}) : Tensor();

  const LaunchShape s = choose_shape(static_cast<int>(D), vectorizable(D, {&go2, &gy2, &nm2, &x2, &w, &dx2, &dh2}));
  const int sms = num_sms();
  const int P = backward_blocks(s, ref.get_device(), sms, M, static_cast<int>(D), need_dweight || need_dbias);
  TORCH_CHECK(P > 0, "residual_norm_backward: the device refused ", num(-P),
              " bytes of shared memory for the weight-gradient accumulators (D = ", num(D), ")");
  Tensor dweight_part = need_dweight ? at::empty({P, D}, f32) : Tensor();
  Tensor dbias_part = need_dbias ? at::empty({P, D}, f32) : Tensor();
  Tensor dalpha_part = need_dalpha ? at::empty({P}, f32) : Tensor();

  BwdParams p{};
  p.g_out = ptr(go2);
  p.g_y = ptr(gy2);
  p.normed = ptr(nm2);
  p.x = ptr(x2);
  p.weight = ptr(w);
  p.mean = has_gy ? mean1.data_ptr<float>() : nullptr;
  p.rstd = has_gy ? rstd1.data_ptr<float>() : nullptr;
  p.alpha = ptr(a);
  p.grad_scale = ptr(gs);
  p.dx = dx2.data_ptr();
  p.dh = dh2.defined() ? dh2.data_ptr() : nullptr;
  p.dweight_part = need_dweight ? dweight_part.data_ptr<float>() : nullptr;
  p.dbias_part = need_dbias ? dbias_part.data_ptr<float>() : nullptr;
  p.dalpha_part = need_dalpha ? dalpha_part.data_ptr<float>() : nullptr;
  p.stride_gout = row_stride(go2);
  p.stride_gy = row_stride(gy2);
  p.stride_normed = row_stride(nm2);
  p.stride_x = row_stride(x2);
  p.stride_dx = dx2.stride(0);
  p.stride_dh = row_stride(dh2);
  p.g_out_dt = code(go2);
  p.g_y_dt = code(gy2);
  p.normed_dt = code(nm2);
  p.x_dt = code(x2);
  p.weight_dt = code(w);
  p.alpha_dt = code(a);
  p.grad_scale_dt = code(gs);
  p.dx_dt = code(dx2);
  p.dh_dt = code(dh2);
  p.M = M;
  p.D = static_cast<int>(D);
  p.rows_per_sample = rps;
  p.alpha_value = static_cast<float>(alpha_value);
  set_dropout(h_dtype.has_value() ? sd : Tensor(), dropout_p, &p.seed, &p.dropout_p, &p.dropout_scale);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  launch_backward(p, s, P, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (need_dweight || need_dbias || need_dalpha) {
    launch_finalize(p.dweight_part, p.dbias_part, p.dalpha_part, P, static_cast<int>(D),
                    need_dweight ? dweight.data_ptr<float>() : nullptr, need_dbias ? dbias.data_ptr<float>() : nullptr,
                    need_dalpha ? dalpha.data_ptr<float>() : nullptr, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, dh.defined() ? dh : at::empty({0}, opts.dtype(x_dtype)), dweight, dbias, dalpha};
}


// ---------------------------------------------------------------------------------------------
// The MLP activation: bias_gelu, bias_gelu_backward (the schemas of the dres:: ops of
// dres/ops/bias_gelu.py), the kernels of bias_gelu.cu; no autograd of their own (fused_mlp's is theirs)

int gelu_kind(c10::string_view approximate) {
  if (approximate == "none") return kGeluErf;
  if (approximate == "tanh") return kGeluTanh;
  if (approximate == "quick") return kGeluQuick;
  TORCH_CHECK(false, "approximate must be 'none', 'tanh' or 'quick', got '", std::string(approximate), "'");
  return kGeluErf;  // unreachable
}

void check_pre(const Tensor& pre, const char* name) {
  TORCH_CHECK(pre.defined(), name, " is an undefined tensor");
  TORCH_CHECK(pre.is_cuda(), name, " must be a CUDA tensor, got one on ", pre.device());
  dtype_code(pre.scalar_type(), name);
  TORCH_CHECK(pre.dim() >= 1, name, " must have at least one dimension (the hidden features, last)");
}

Tensor bias_gelu(const Tensor& pre, const OptTensor& bias, std::optional<at::ScalarType> out_dtype,
                 c10::string_view approximate) {
  const int gelu = gelu_kind(approximate);
  check_pre(pre, "pre");
  const Tensor b = param(bias, "bias", pre);  // undefined when absent
  if (out_dtype.has_value()) dtype_code(*out_dtype, "out_dtype");
  const c10::cuda::CUDAGuard guard(pre.device());
  Tensor act = at::empty(pre.sizes(), pre.options().dtype(out_dtype.value_or(pre.scalar_type())));
  const int64_t N = pre.size(-1), M = N ? pre.numel() / N : 0;
  if (M == 0) return act;
  const Tensor pre2 = as_rows(pre), act2 = act.view({-1, N});
  BiasGeluParams p{};
  p.pre = pre2.data_ptr();
  p.bias = ptr(b);
  p.act = act2.data_ptr();
  p.stride_pre = pre2.stride(0);
  p.stride_act = act2.stride(0);
  p.pre_dt = code(pre2);
  p.bias_dt = code(b);
  p.act_dt = code(act2);
  p.M = M;
  p.N = static_cast<int>(N);
  p.gelu = gelu;
  launch_bias_gelu_forward(p, choose_bias_gelu_shape(static_cast<int>(N), vectorizable(N, {&pre2, &b, &act2})),
                           num_sms(), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return act;
}

// (dpre in pre's dtype, act recomputed in act_dtype or empty, dbias fp32 or empty), as dres::bias_gelu_backward.
std::tuple<Tensor, Tensor, Tensor> bias_gelu_backward(const Tensor& g, const Tensor& pre, const OptTensor& bias,
                                                      std::optional<at::ScalarType> act_dtype, bool need_dbias,
                                                      c10::string_view approximate) {
  const int gelu = gelu_kind(approximate);
  check_pre(pre, "pre");
  check_rows(g, "g", pre);
  const Tensor b = param(bias, "bias", pre);  // undefined when absent
  if (act_dtype.has_value()) dtype_code(*act_dtype, "act_dtype");
  need_dbias = need_dbias && b.defined();
  const c10::cuda::CUDAGuard guard(pre.device());
  const int64_t N = pre.size(-1), M = N ? pre.numel() / N : 0;
  const auto f32 = pre.options().dtype(at::kFloat);
  Tensor dpre = at::empty(pre.sizes(), pre.options());
  Tensor act = at::empty(act_dtype.has_value() ? pre.sizes() : at::IntArrayRef{0},
                         pre.options().dtype(act_dtype.value_or(pre.scalar_type())));
  Tensor dbias = at::empty({need_dbias ? N : 0}, f32);
  if (M == 0) {
    if (need_dbias) dbias.zero_();
    return {dpre, act, dbias};
  }
  const Tensor g2 = as_rows(g), pre2 = as_rows(pre), dpre2 = dpre.view({-1, N});
  const Tensor act2 = act_dtype.has_value() ? act.view({-1, N}) : Tensor();
  const BiasGeluShape shape =
      choose_bias_gelu_shape(static_cast<int>(N), vectorizable(N, {&g2, &pre2, &b, &dpre2, &act2}));
  const int64_t strips = bias_gelu_strips(shape, num_sms(), M);
  Tensor partials = need_dbias ? at::empty({strips, N}, f32) : Tensor();
  BiasGeluParams p{};
  p.g = g2.data_ptr();
  p.pre = pre2.data_ptr();
  p.bias = ptr(b);
  p.act = act2.defined() ? act2.data_ptr() : nullptr;
  p.dpre = dpre2.data_ptr();
  p.dbias_part = need_dbias ? partials.data_ptr<float>() : nullptr;
  p.stride_g = g2.stride(0);
  p.stride_pre = pre2.stride(0);
  p.stride_act = row_stride(act2);
  p.stride_dpre = dpre2.stride(0);
  p.g_dt = code(g2);
  p.pre_dt = code(pre2);
  p.bias_dt = code(b);
  p.act_dt = code(act2);
  p.dpre_dt = code(dpre2);
  p.M = M;
  p.N = static_cast<int>(N);
  p.gelu = gelu;
  p.rows_per_strip = (M + strips - 1) / strips;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  launch_bias_gelu_backward(p, shape, strips, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (need_dbias) {
    launch_finalize(nullptr, p.dbias_part, nullptr, static_cast<int>(strips), static_cast<int>(N), nullptr,
                    dbias.data_ptr<float>(), nullptr, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dpre, act, dbias};
}

// ---------------------------------------------------------------------------------------------
// Autograd: the formulas of the Python Functions of dres/ops/residual_norm.py (ResidualLayerNormFn,
// ResidualAddFn, LayerNormFn). The forward reaches the kernel below autograd by redispatch and the
// backward calls the backward op through the dispatcher, so torch.compile traces both.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

OptTensor as_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }
Tensor value_or_undefined(const OptTensor& t) { return present(t) ? *t : Tensor(); }
bool requires_grad(const OptTensor& t) { return present(t) && t->requires_grad(); }

// What a forward keeps for the backward op, beside the saved tensors.
struct BackwardArgs {
  double alpha_value;
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> h_dtype;  // none: no gradient into h
  bool need_dweight, need_dbias, need_dalpha;
  double dropout_p;  // the forward's (its seed is a saved tensor)
};

void save_args(AutogradContext* ctx, const BackwardArgs& a) {
  ctx->saved_data["alpha_value"] = a.alpha_value;
  ctx->saved_data["x_dtype"] = a.x_dtype;
  ctx->saved_data["h_dtype"] = a.h_dtype.has_value() ? c10::IValue(*a.h_dtype) : c10::IValue();
  ctx->saved_data["need"] = std::vector<bool>{a.need_dweight, a.need_dbias, a.need_dalpha};
  ctx->saved_data["dropout_p"] = a.dropout_p;
}

BackwardArgs saved_args(AutogradContext* ctx) {
  const c10::IValue& h_dtype = ctx->saved_data["h_dtype"];
  const c10::List<bool> need = ctx->saved_data["need"].toBoolList();
  return {ctx->saved_data["alpha_value"].toDouble(), ctx->saved_data["x_dtype"].toScalarType(),
          h_dtype.isNone() ? std::nullopt : std::optional<at::ScalarType>(h_dtype.toScalarType()), need[0], need[1],
          need[2], ctx->saved_data["dropout_p"].toDouble()};
}

// (dx, dh, dweight fp32, dbias fp32, dalpha fp32) from residual_norm_backward.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> call_backward(const Tensor& g_out, const Tensor& g_y,
                                                                 const Tensor& normed, const Tensor& x,
                                                                 const Tensor& weight, const Tensor& mean,
                                                                 const Tensor& rstd, const Tensor& alpha,
                                                                 const Tensor& grad_scale, const Tensor& seed,
                                                                 const BackwardArgs& a) {
  static const auto op = op_handle<decltype(residual_norm_backward)>("dres_cuda::residual_norm_backward");
  return op.call(as_optional(g_out), as_optional(g_y), as_optional(normed), as_optional(x), as_optional(weight),
                 as_optional(mean), as_optional(rstd), as_optional(alpha), a.alpha_value, as_optional(grad_scale),
                 a.x_dtype, a.h_dtype, a.need_dweight, a.need_dbias, a.need_dalpha, a.dropout_p, as_optional(seed));
}

// A parameter's gradient in its dtype from the kernels' fp32 one; zeros where they had none to give
// (an empty tensor: the norm output got no gradient); undefined where none was asked for.
Tensor param_grad(const Tensor& grad, const Tensor& like, bool needed) {
  if (!needed) return Tensor();
  if (grad.numel() == 0) return at::zeros_like(like);
  return grad.to(like.scalar_type()).reshape(like.sizes());
}

Tensor alpha_grad(const Tensor& dalpha, const Tensor& alpha, bool needed) {
  return needed ? dalpha.to(alpha.scalar_type()).reshape(alpha.sizes()) : Tensor();
}

// The per-sample factors of the gradient into h: grad_scale, or row_scale where it is None.
Tensor gradient_scale(const OptTensor& row_scale, const OptTensor& grad_scale) {
  return present(grad_scale) ? *grad_scale : value_or_undefined(row_scale);
}

std::optional<at::ScalarType> h_grad_dtype(const Tensor& h) {
  return h.requires_grad() ? std::optional<at::ScalarType>(h.scalar_type()) : std::nullopt;
}

// out = alpha*x + row_scale[b]*drop(h), y = LayerNorm(out); g = g_out + LN_bwd(g_y), dx = alpha*g,
// dh = grad_scale[b]*drop'(g) (the forward's mask), dweight, dbias and dalpha = sum(g*x).
struct ResidualLayerNormFunction : torch::autograd::Function<ResidualLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h, const OptTensor& weight,
                               const OptTensor& bias, const OptTensor& alpha, double alpha_value, double eps,
                               const OptTensor& row_scale, const OptTensor& grad_scale,
                               std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> out_dtype,
                               double dropout_p, const OptTensor& seed) {
    static const auto op = op_handle<decltype(residual_layer_norm)>("dres_cuda::residual_layer_norm");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, y, mean, rstd] = op.call(x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale,
                                        residual_dtype, out_dtype, dropout_p, seed);
    const bool need_dalpha = requires_grad(alpha);
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({out, value_or_undefined(weight), value_or_undefined(bias), mean, rstd,
                            value_or_undefined(alpha), gradient_scale(row_scale, grad_scale),
                            need_dalpha ? x : Tensor(), value_or_undefined(seed)});
    save_args(ctx, {alpha_value, x.scalar_type(), h_grad_dtype(h), requires_grad(weight), requires_grad(bias),
                    need_dalpha, dropout_p});
    return {out, y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(13);  // one per forward argument; undefined: no gradient
    if (!grads[0].defined() && !grads[1].defined()) return result;
    const variable_list s = ctx->get_saved_variables();
    const Tensor &out = s[0], &weight = s[1], &bias = s[2], &mean = s[3], &rstd = s[4], &alpha = s[5];
    const BackwardArgs a = saved_args(ctx);
    auto [dx, dh, dweight, dbias, dalpha] = call_backward(grads[0], grads[1], out, s[7], weight, mean, rstd, alpha,
                                                          s[6], s[8], a);
    result[0] = dx;
    if (a.h_dtype.has_value()) result[1] = dh;
    result[2] = param_grad(dweight, weight, a.need_dweight);
    result[3] = param_grad(dbias, bias, a.need_dbias);
    result[4] = alpha_grad(dalpha, alpha, a.need_dalpha);
    return result;
  }
};

// out = alpha*x + row_scale[b]*drop(h); dx = alpha*g, dh = grad_scale[b]*drop'(g), dalpha = sum(g*x).
struct ResidualAddFunction : torch::autograd::Function<ResidualAddFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h, const OptTensor& alpha,
                               double alpha_value, const OptTensor& row_scale, const OptTensor& grad_scale,
                               std::optional<at::ScalarType> residual_dtype, double dropout_p, const OptTensor& seed) {
    static const auto op = op_handle<decltype(residual_add)>("dres_cuda::residual_add");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    Tensor out = op.call(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p, seed);
    const bool need_dalpha = requires_grad(alpha);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({value_or_undefined(alpha), gradient_scale(row_scale, grad_scale),
                            need_dalpha ? x : Tensor(), value_or_undefined(seed)});
    save_args(ctx, {alpha_value, x.scalar_type(), h_grad_dtype(h), false, false, need_dalpha, dropout_p});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(9);
    if (!grads[0].defined()) return result;
    const variable_list s = ctx->get_saved_variables();
    const BackwardArgs a = saved_args(ctx);
    auto [dx, dh, dweight, dbias, dalpha] = call_backward(grads[0], Tensor(), Tensor(), s[2], Tensor(), Tensor(),
                                                          Tensor(), s[0], s[1], s[3], a);
    result[0] = dx;
    if (a.h_dtype.has_value()) result[1] = dh;
    result[2] = alpha_grad(dalpha, s[0], a.need_dalpha);
    return result;
  }
};

// y = LayerNorm(x) * weight + bias, normalised in fp32 registers.
struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               double eps, std::optional<at::ScalarType> out_dtype) {
    static const auto op = op_handle<decltype(layer_norm)>("dres_cuda::layer_norm");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, mean, rstd] = op.call(x, weight, bias, eps, out_dtype);
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, value_or_undefined(weight), value_or_undefined(bias), mean, rstd});
    save_args(ctx, {1.0, x.scalar_type(), std::nullopt, requires_grad(weight), requires_grad(bias), false, 0.0});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);
    if (!grads[0].defined()) return result;
    const variable_list s = ctx->get_saved_variables();
    const Tensor &x = s[0], &weight = s[1], &bias = s[2];
    const BackwardArgs a = saved_args(ctx);
    auto [dx, dh, dweight, dbias, dalpha] = call_backward(Tensor(), grads[0], x, Tensor(), weight, s[3], s[4],
                                                          Tensor(), Tensor(), Tensor(), a);
    result[0] = dx;
    result[1] = param_grad(dweight, weight, a.need_dweight);
    result[2] = param_grad(dbias, bias, a.need_dbias);
    return result;
  }
};

// fc2(gelu(fc1(x))) with fc1's bias and the GELU one kernel (bias_gelu), the matmuls in compute_dtype on
// inputs cast once; keeps x and fc1's pre-activation, not the activation, which the backward
// recomputes (FusedMlpFn of dres/ops/bias_gelu.py, whose formulas these are).
struct MlpForward {
  Tensor out, x_c, pre, w1_c, w2_c;
};

MlpForward mlp_forward(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                       at::ScalarType compute_dtype, c10::string_view approximate) {
  static const auto gelu = op_handle<decltype(bias_gelu)>("dres_cuda::bias_gelu");
  // t itself where it has the dtype already: below autograd no op may hand back its input (aten::to would)
  const auto cast = [&](const Tensor& t) { return t.scalar_type() == compute_dtype ? t : t.to(compute_dtype); };
  MlpForward f;
  f.x_c = cast(x);
  f.w1_c = cast(w1);
  f.w2_c = cast(w2);
  f.pre = at::linear(f.x_c, f.w1_c);
  const Tensor act = gelu.call(f.pre, b1, std::nullopt, approximate);
  f.out = at::linear(act, f.w2_c, present(b2) ? OptTensor(cast(*b2)) : OptTensor());
  return f;
}

Tensor fused_mlp(const Tensor& x, const Tensor& fc1_weight, const OptTensor& fc1_bias, const Tensor& fc2_weight,
                 const OptTensor& fc2_bias, at::ScalarType compute_dtype, c10::string_view approximate) {
  return mlp_forward(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype, approximate).out;
}

struct FusedMlpFunction : torch::autograd::Function<FusedMlpFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& fc1_weight,
                               const OptTensor& fc1_bias, const Tensor& fc2_weight, const OptTensor& fc2_bias,
                               at::ScalarType compute_dtype, c10::string_view approximate) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    MlpForward f = mlp_forward(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype, approximate);
    ctx->set_materialize_grads(false);
    // The cast weights are what the backward multiplies by, as plain autograd under autocast keeps them.
    ctx->save_for_backward({f.x_c, f.pre, f.w1_c, value_or_undefined(fc1_bias), f.w2_c});
    ctx->saved_data["dtypes"] = std::vector<int64_t>{
        static_cast<int64_t>(x.scalar_type()), static_cast<int64_t>(fc1_weight.scalar_type()),
        static_cast<int64_t>(fc2_weight.scalar_type()),
        present(fc2_bias) ? static_cast<int64_t>(fc2_bias->scalar_type()) : -1};
    ctx->saved_data["need"] = std::vector<bool>{x.requires_grad(), fc1_weight.requires_grad(),
                                                requires_grad(fc1_bias), fc2_weight.requires_grad(),
                                                requires_grad(fc2_bias)};
    ctx->saved_data["approximate"] = std::string(approximate);
    return {f.out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto gelu_backward = op_handle<decltype(bias_gelu_backward)>("dres_cuda::bias_gelu_backward");
    variable_list result(7);  // one per forward argument; undefined: no gradient
    if (!grads[0].defined()) return result;
    const variable_list s = ctx->get_saved_variables();
    const Tensor &x_c = s[0], &pre = s[1], &w1 = s[2], &fc1_bias = s[3], &w2 = s[4];
    const c10::List<int64_t> dtypes = ctx->saved_data["dtypes"].toIntList();
    const c10::List<bool> need = ctx->saved_data["need"].toBoolList();
    const auto dtype = [&](int i) { return static_cast<at::ScalarType>(dtypes[i]); };
    const bool need_x = need[0], need_w1 = need[1], need_b1 = need[2] && fc1_bias.defined(), need_w2 = need[3];
    const int64_t hidden = w1.size(0), dim = w1.size(1);
    Tensor g = grads[0].reshape({-1, w2.size(0)}).to(w2.scalar_type());  // copies only where g's strides demand it
    if (need[4] && dtypes[3] >= 0) result[4] = g.sum(0, false, at::kFloat).to(dtype(3));
    if (!(need_x || need_w1 || need_b1 || need_w2)) return result;
    Tensor dact = at::matmul(g, w2);
    auto [dpre, act, dbias] =
        gelu_backward.call(dact, pre.view({-1, hidden}), as_optional(fc1_bias),
                           need_w2 ? std::optional<at::ScalarType>(w2.scalar_type()) : std::nullopt, need_b1,
                           ctx->saved_data["approximate"].toStringRef());
    dact.reset();  // freed before the matmuls that follow, as the recomputed activation after its one use
    if (need_w2) result[3] = at::matmul(g.t(), act).to(dtype(2));
    act.reset();
    if (need_b1) result[2] = dbias.to(fc1_bias.scalar_type());
    if (need_w1) result[1] = at::matmul(dpre.t(), x_c.reshape({-1, dim})).to(dtype(1));
    if (need_x) result[0] = at::matmul(dpre, w1).view(x_c.sizes()).to(dtype(0));
    return result;
  }
};

Tensor fused_mlp_autograd(const Tensor& x, const Tensor& fc1_weight, const OptTensor& fc1_bias,
                          const Tensor& fc2_weight, const OptTensor& fc2_bias, at::ScalarType compute_dtype,
                          c10::string_view approximate) {
  return FusedMlpFunction::apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype, approximate)[0];
}

std::tuple<Tensor, Tensor, Tensor, Tensor> residual_layer_norm_autograd(
    const Tensor& x, const Tensor& h, const OptTensor& weight, const OptTensor& bias, const OptTensor& alpha,
    double alpha_value, double eps, const OptTensor& row_scale, const OptTensor& grad_scale,
    std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> out_dtype, double dropout_p,
    const OptTensor& seed) {
  const variable_list r = ResidualLayerNormFunction::apply(x, h, weight, bias, alpha, alpha_value, eps, row_scale,
                                                           grad_scale, residual_dtype, out_dtype, dropout_p, seed);
  return {r[0], r[1], r[2], r[3]};
}

Tensor residual_add_autograd(const Tensor& x, const Tensor& h, const OptTensor& alpha, double alpha_value,
                             const OptTensor& row_scale, const OptTensor& grad_scale,
                             std::optional<at::ScalarType> residual_dtype, double dropout_p, const OptTensor& seed) {
  return ResidualAddFunction::apply(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p,
                                    seed)[0];
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_autograd(const Tensor& x, const OptTensor& weight,
                                                       const OptTensor& bias, double eps,
                                                       std::optional<at::ScalarType> out_dtype) {
  const variable_list r = LayerNormFunction::apply(x, weight, bias, eps, out_dtype);
  return {r[0], r[1], r[2]};
}

}  // namespace
}  // namespace dres

// Schemas identical to those torch infers for the dres:: custom ops (tests/test_csrc.py checks).
TORCH_LIBRARY(dres_cuda, m) {
  m.set_python_module("dres.ops.csrc_backend");
  m.def(
      "residual_layer_norm(Tensor x, Tensor h, Tensor? weight, Tensor? bias, Tensor? alpha, float alpha_value, "
      "float eps, Tensor? row_scale, Tensor? grad_scale, ScalarType? residual_dtype, ScalarType? out_dtype, "
      "float dropout_p, Tensor? seed) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "residual_add(Tensor x, Tensor h, Tensor? alpha, float alpha_value, Tensor? row_scale, Tensor? grad_scale, "
      "ScalarType? residual_dtype, float dropout_p, Tensor? seed) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) -> (Tensor, Tensor, Tensor)");
  m.def(
      "residual_norm_backward(Tensor? g_out, Tensor? g_y, Tensor? normed, Tensor? x, Tensor? weight, Tensor? mean, "
      "Tensor? rstd, Tensor? alpha, float alpha_value, Tensor? grad_scale, ScalarType x_dtype, ScalarType? h_dtype, "
      "bool need_dweight, bool need_dbias, bool need_dalpha, float dropout_p, Tensor? seed) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("bias_gelu(Tensor pre, Tensor? bias, ScalarType? out_dtype, str approximate) -> Tensor");
  m.def(
      "bias_gelu_backward(Tensor g, Tensor pre, Tensor? bias, ScalarType? act_dtype, bool need_dbias, str approximate) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_mlp(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, "
      "ScalarType compute_dtype, str approximate) -> Tensor");
}

TORCH_LIBRARY_IMPL(dres_cuda, CUDA, m) {
  m.impl("residual_layer_norm", &dres::residual_layer_norm);
  m.impl("residual_add", &dres::residual_add);
  m.impl("layer_norm", &dres::layer_norm);
  m.impl("residual_norm_backward", &dres::residual_norm_backward);
  m.impl("bias_gelu", &dres::bias_gelu);
  m.impl("bias_gelu_backward", &dres::bias_gelu_backward);
  m.impl("fused_mlp", &dres::fused_mlp);
}

TORCH_LIBRARY_IMPL(dres_cuda, Autograd, m) {
  m.impl("residual_layer_norm", &dres::residual_layer_norm_autograd);
  m.impl("residual_add", &dres::residual_add_autograd);
  m.impl("layer_norm", &dres::layer_norm_autograd);
  m.impl("fused_mlp", &dres::fused_mlp_autograd);
}
