// The dres_cuda:: torch ops: the same schemas as the dres:: custom ops of
// dres/ops/residual_norm.py (so dres.ops dispatches backend="cuda" to torch.ops.dres_cuda.<name>
// with the same arguments), implemented by the kernels of residual_norm.cu.
//
// Registered for the CUDA dispatch key only. Fake (meta) kernels and autograd are registered from
// Python in dres/ops/csrc_backend.py, sharing the Triton ops' code; set_python_module below makes
// torch import that module whenever it needs the fake kernels (e.g. under torch.compile).

#include <Python.h>

// Only c10's light CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers,
// which a minimal CUDA toolkit (as on the CI machine) does not ship.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>

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

// Shared forward: out (when h is given) and y/mean/rstd (when norm is true).
void forward(const Tensor& x2, const Tensor& h2, const Tensor& weight, const Tensor& bias, const Tensor& alpha,
             double alpha_value, double eps, const Tensor& row_scale, int64_t rows_per_sample, const Tensor& out2,
             const Tensor& y2, const Tensor& mean, const Tensor& rstd) {
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
    std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> out_dtype) {
  // Every argument is checked before anything else happens (device guard, allocations).
  check_eps(eps);
  check_x(x);
  check_rows(h, "h", x);
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
          y.view({-1, x.size(-1)}), mean, rstd);
  return {out, y, mean, rstd};
}

Tensor residual_add(const Tensor& x, const Tensor& h, const OptTensor& alpha, double alpha_value,
                    const OptTensor& row_scale, const OptTensor& grad_scale,
                    std::optional<at::ScalarType> residual_dtype) {
  check_x(x);
  check_rows(h, "h", x);
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
          Tensor(), Tensor(), Tensor());
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
          rstd);
  return {y, mean, rstd};
}

// (dx, dh, dweight fp32, dbias fp32, dalpha fp32); gradients not asked for come back as empty
// (0,) tensors, exactly as dres::residual_norm_backward.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> residual_norm_backward(
    const OptTensor& g_out, const OptTensor& g_y, const OptTensor& normed, const OptTensor& x,
    const OptTensor& weight, const OptTensor& mean, const OptTensor& rstd, const OptTensor& alpha, double alpha_value,
    const OptTensor& grad_scale, at::ScalarType x_dtype, std::optional<at::ScalarType> h_dtype, bool need_dweight,
    bool need_dbias, bool need_dalpha) {
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

}  // namespace
}  // namespace dres

// Schemas identical to those torch infers for the dres:: custom ops (tests/test_csrc.py checks).
TORCH_LIBRARY(dres_cuda, m) {
  m.set_python_module("dres.ops.csrc_backend");
  m.def(
      "residual_layer_norm(Tensor x, Tensor h, Tensor? weight, Tensor? bias, Tensor? alpha, float alpha_value, "
      "float eps, Tensor? row_scale, Tensor? grad_scale, ScalarType? residual_dtype, ScalarType? out_dtype) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "residual_add(Tensor x, Tensor h, Tensor? alpha, float alpha_value, Tensor? row_scale, Tensor? grad_scale, "
      "ScalarType? residual_dtype) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) -> (Tensor, Tensor, Tensor)");
  m.def(
      "residual_norm_backward(Tensor? g_out, Tensor? g_y, Tensor? normed, Tensor? x, Tensor? weight, Tensor? mean, "
      "Tensor? rstd, Tensor? alpha, float alpha_value, Tensor? grad_scale, ScalarType x_dtype, ScalarType? h_dtype, "
      "bool need_dweight, bool need_dbias, bool need_dalpha) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dres_cuda, CUDA, m) {
  m.impl("residual_layer_norm", &dres::residual_layer_norm);
  m.impl("residual_add", &dres::residual_add);
  m.impl("layer_norm", &dres::layer_norm);
  m.impl("residual_norm_backward", &dres::residual_norm_backward);
}
