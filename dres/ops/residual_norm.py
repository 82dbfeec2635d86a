"""The fused residual ops: ``residual_layer_norm``, ``residual_add``, ``layer_norm``.

Two backends of one contract, ``"triton"`` and ``"cuda"`` (the csrc extension)::

    residual_layer_norm(...)                      argument checks, backend choice
      triton, eager: ResidualLayerNormFn.apply(..., "triton")
           forward:  residual_layer_norm_triton(...)        -> dres.kernels.residual_norm_forward
           backward: run_residual_norm_backward("triton", ...) -> dres.kernels.residual_norm_backward
      cuda, or under torch.compile: torch.ops.dres_cuda.residual_layer_norm | torch.ops.dres.residual_layer_norm

The csrc ops carry their autograd in C++ (``csrc/ops.cpp``: the formulas of the Functions below), so
an eager call of the ``"cuda"`` backend runs no Python past its checks, forward or backward. Under
``torch.compile`` the public functions call the custom ops (``torch.ops.dres.*`` run the Triton
launches); the ``dres::`` ops' autograd is the Functions' ``save``/``backward`` with the backward
custom op, so compiled graphs trace the backward too. Eager Triton calls skip the custom ops: their
Python dispatch costs tens of microseconds per call, more than the kernels at MAE sizes.

Forward ops return (mean, rstd) too, which the backward needs; the public functions drop them.
``alpha`` travels as the pair ``(alpha, alpha_value)`` from :func:`dres.ops.utils.alpha_args` to the
kernels: a 0-dim tensor the kernel reads, or None and a Python float passed by value.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dres.ops import csrc_backend, reference
from dres.ops.checks import (check_alpha, check_dropout_p, check_dtype_arg, check_eps, check_factors_are_data,
                             check_same_device, check_tensor, check_vector, resolve_backend_by_work,
                             supported_dtypes)
from dres.ops.registration import define_op, with_inductor_fallbacks
from dres.ops.utils import alpha_args, param_grad, rows_per_sample

__all__ = ["residual_layer_norm", "residual_add", "layer_norm", "ResidualLayerNormFn", "ResidualAddFn", "LayerNormFn"]


# ---------------------------------------------------------------------------------------------
# Checks: messages name the argument, before any kernel sees it


def check_residual_norm_inputs(
    backend: str,
    x: Tensor,
    h: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    alpha=1.0,
    row_scale: Tensor | None = None,
    grad_scale: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    check_h: bool = True,
) -> None:
    """Validate the arguments of any of the three ops (``check_h=False`` for layer_norm; eps is
    :func:`check_eps`'s)."""
    dtypes = supported_dtypes(backend)
    check_tensor("x", x, dtypes)
    if x.dim() < 2:
        raise ValueError(f"x must have shape (B, T, D) or (M, D), got {tuple(x.shape)}")
    dim = x.shape[-1]
    if dim == 0:
        raise ValueError("x has an empty last dimension (D = 0)")
    if backend != "torch":
        from dres.kernels import MAX_DIM

        if dim > MAX_DIM:
            raise ValueError(f"x has D = {dim}, above the kernels' maximum of {MAX_DIM} (use backend='torch')")
    if check_h:
        check_tensor("h", h, dtypes)
        if h.shape != x.shape:
            raise ValueError(f"h has shape {tuple(h.shape)} but x has {tuple(x.shape)}; they must match")
        check_same_device("h", h, x)
    check_vector("weight", weight, dim, x, dtypes, "x's last dimension")
    check_vector("bias", bias, dim, x, dtypes, "x's last dimension")
    check_alpha(alpha, x, dtypes)
    rows = x.numel() // dim
    for name, s in (("row_scale", row_scale), ("grad_scale", grad_scale)):
        if s is None:
            continue
        check_tensor(name, s, dtypes)
        if s.dim() != 1 or s.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor of per-sample factors (B,), got {tuple(s.shape)}")
        if x.dim() == 3 and s.shape[0] != x.shape[0]:
            raise ValueError(f"{name} has length {s.shape[0]} but x has batch size {x.shape[0]}")
        if rows % s.shape[0]:
            raise ValueError(
                f"x has {rows} rows, not divisible by len({name}) = {s.shape[0]} (rows_per_sample = rows // B)"
            )
        check_same_device(name, s, x)
    if row_scale is not None and grad_scale is not None and row_scale.shape != grad_scale.shape:
        raise ValueError(f"row_scale {tuple(row_scale.shape)} and grad_scale {tuple(grad_scale.shape)} must have one length")
    check_factors_are_data(row_scale=row_scale, grad_scale=grad_scale)
    check_dtype_arg("residual_dtype", residual_dtype, dtypes)
    check_dtype_arg("out_dtype", out_dtype, dtypes)


# ---------------------------------------------------------------------------------------------
# Reference: dres.ops.reference.residual_layer_norm, .residual_add, .layer_norm (backend="torch"
# runs them; the tests compare the kernels against them)


# ---------------------------------------------------------------------------------------------
# Launches: allocate the outputs and run the kernels of dres.kernels.residual_norm; they are also
# the bodies of the dres:: custom ops, hence the full signatures.


def _stats(x: Tensor) -> tuple[Tensor, Tensor]:
    rows = x.numel() // x.shape[-1]
    return x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


def residual_layer_norm_triton(
    x: Tensor, h: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], alpha: Optional[Tensor],
    alpha_value: float, eps: float, row_scale: Optional[Tensor], grad_scale: Optional[Tensor],
    residual_dtype: Optional[torch.dtype], out_dtype: Optional[torch.dtype], dropout_p: float, seed: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from dres.kernels.residual_norm import residual_norm_forward

    out = torch.empty(x.shape, dtype=residual_dtype or x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=out_dtype or h.dtype, device=x.device)
    mean, rstd = _stats(x)
    residual_norm_forward(x, h, weight, bias, alpha, alpha_value, eps, row_scale, rows_per_sample(x, row_scale),
                          out, y, mean, rstd, dropout_p, seed)
    return out, y, mean, rstd


def residual_add_triton(
    x: Tensor, h: Tensor, alpha: Optional[Tensor], alpha_value: float,
    row_scale: Optional[Tensor], grad_scale: Optional[Tensor], residual_dtype: Optional[torch.dtype],
    dropout_p: float, seed: Optional[Tensor],
) -> Tensor:
    from dres.kernels.residual_norm import residual_norm_forward

    out = torch.empty(x.shape, dtype=residual_dtype or x.dtype, device=x.device)
    residual_norm_forward(x, h, None, None, alpha, alpha_value, 0.0, row_scale, rows_per_sample(x, row_scale),
                          out, None, None, None, dropout_p, seed)
    return out


def layer_norm_triton(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, out_dtype: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor]:
    from dres.kernels.residual_norm import residual_norm_forward

    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    mean, rstd = _stats(x)
    residual_norm_forward(x, None, weight, bias, None, 1.0, eps, None, 1, None, y, mean, rstd, 0.0, None)
    return y, mean, rstd


def _residual_norm_backward(
    g_out: Optional[Tensor], g_y: Optional[Tensor], normed: Optional[Tensor], x: Optional[Tensor],
    weight: Optional[Tensor], mean: Optional[Tensor], rstd: Optional[Tensor],
    alpha: Optional[Tensor], alpha_value: float, grad_scale: Optional[Tensor],
    x_dtype: torch.dtype, h_dtype: Optional[torch.dtype],
    need_dweight: bool, need_dbias: bool, need_dalpha: bool, dropout_p: float, seed: Optional[Tensor],
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dh, dweight fp32, dbias fp32, dalpha fp32), None where not asked for (or, for dweight and
    dbias, where no g_y came). ``h_dtype=None``: no branch input (layer_norm) or no gradient for it.
    dropout_p, seed: the forward's (dh gets the forward's mask)."""
    from dres.kernels.residual_norm import residual_norm_backward

    ref = g_out if g_out is not None else g_y
    dx = torch.empty(ref.shape, dtype=x_dtype, device=ref.device)
    dh = torch.empty(ref.shape, dtype=h_dtype, device=ref.device) if h_dtype is not None else None
    dweight, dbias, dalpha = residual_norm_backward(
        g_out, g_y, normed, x, weight, mean, rstd, alpha, alpha_value, grad_scale,
        rows_per_sample(ref, grad_scale), dx, dh, need_dweight, need_dbias, need_dalpha, dropout_p, seed)
    return dx, dh, dweight, dbias, dalpha


def residual_norm_backward_triton(
    g_out: Optional[Tensor], g_y: Optional[Tensor], normed: Optional[Tensor], x: Optional[Tensor],
    weight: Optional[Tensor], mean: Optional[Tensor], rstd: Optional[Tensor],
    alpha: Optional[Tensor], alpha_value: float, grad_scale: Optional[Tensor],
    x_dtype: torch.dtype, h_dtype: Optional[torch.dtype],
    need_dweight: bool, need_dbias: bool, need_dalpha: bool, dropout_p: float, seed: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward custom op's body: :func:`_residual_norm_backward` with the gradients not asked
    for as distinct empty tensors (an op returns tensors; distinct: no aliasing)."""
    dx, dh, dweight, dbias, dalpha = _residual_norm_backward(
        g_out, g_y, normed, x, weight, mean, rstd, alpha, alpha_value, grad_scale, x_dtype, h_dtype,
        need_dweight, need_dbias, need_dalpha, dropout_p, seed)
    empty = lambda dtype=torch.float32: dx.new_empty((0,), dtype=dtype)  # noqa: E731
    return (dx, dh if dh is not None else empty(x_dtype), dweight if dweight is not None else empty(),
            dbias if dbias is not None else empty(), dalpha if dalpha is not None else empty())


def run_residual_norm_backward(backend: str, *args) -> tuple[Tensor, Optional[Tensor], Optional[Tensor],
                                                               Optional[Tensor], Optional[Tensor]]:
    """(dx, dh, dweight, dbias, dalpha) of the Triton kernels (``backend="triton"``, gradients not
    asked for None) or of a namespace's backward custom op (``"dres"``, the custom ops' autograd:
    gradients not asked for empty)."""
    if backend == "triton":
        return _residual_norm_backward(*args)
    return getattr(torch.ops, backend).residual_norm_backward(*args)


# ---------------------------------------------------------------------------------------------
# The autograd Functions


class ResidualLayerNormFn(torch.autograd.Function):
    """out = alpha*x + row_scale[b]*drop(h), y = LayerNorm(out); g = g_out + LN_bwd(g_y), dx = alpha*g,
    dh = grad_scale[b]*drop'(g) (grad_scale None = row_scale; drop' the forward's mask and scale), dweight,
    dbias and dalpha = sum(g*x)."""

    @staticmethod
    def forward(ctx, x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype, out_dtype,
                dropout_p, seed, backend):
        inputs = (x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype, out_dtype,
                  dropout_p, seed)
        output = residual_layer_norm_triton(*inputs)
        ResidualLayerNormFn.save(ctx, backend, inputs, output)
        return output[:2]

    @staticmethod
    def save(ctx, backend, inputs, output):
        x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype, out_dtype, dropout_p, seed = \
            inputs
        out, y, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        need_dalpha = alpha is not None and ctx.needs_input_grad[4]
        ctx.save_for_backward(out, weight, bias, mean, rstd, alpha, grad_scale if grad_scale is not None else row_scale,
                              x if need_dalpha else None, seed)
        ctx.backend, ctx.alpha_value, ctx.dropout_p = backend, alpha_value, dropout_p
        ctx.x_dtype, ctx.h_dtype = x.dtype, h.dtype
        ctx.need = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3], need_dalpha)

    @staticmethod
    def backward(ctx, g_out, g_y, *_stats_grads):
        out, weight, bias, mean, rstd, alpha, grad_scale, x, seed = ctx.saved_tensors
        need_dh, need_dweight, need_dbias, need_dalpha = ctx.need
        if g_out is None and g_y is None:
            return (None,) * 14
        dx, dh, dweight, dbias, dalpha = run_residual_norm_backward(
            ctx.backend, g_out, g_y, out, x, weight, mean, rstd, alpha, ctx.alpha_value, grad_scale,
            ctx.x_dtype, ctx.h_dtype if need_dh else None, need_dweight and weight is not None,
            need_dbias and bias is not None, need_dalpha, ctx.dropout_p, seed)
        return (dx, dh if need_dh else None, param_grad(dweight, weight, need_dweight),
                param_grad(dbias, bias, need_dbias),
                dalpha.to(alpha.dtype).reshape(alpha.shape) if need_dalpha else None,
                None, None, None, None, None, None, None, None, None)


class ResidualAddFn(torch.autograd.Function):
    """out = alpha*x + row_scale[b]*drop(h); dx = alpha*g, dh = grad_scale[b]*drop'(g), dalpha = sum(g*x)."""

    @staticmethod
    def forward(ctx, x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p, seed, backend):
        inputs = (x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p, seed)
        out = residual_add_triton(*inputs)
        ResidualAddFn.save(ctx, backend, inputs, out)
        return out

    @staticmethod
    def save(ctx, backend, inputs, output):
        x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p, seed = inputs
        ctx.set_materialize_grads(False)
        need_dalpha = alpha is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(alpha, grad_scale if grad_scale is not None else row_scale, x if need_dalpha else None,
                              seed)
        ctx.backend, ctx.alpha_value, ctx.dropout_p = backend, alpha_value, dropout_p
        ctx.x_dtype, ctx.h_dtype = x.dtype, h.dtype
        ctx.need = (ctx.needs_input_grad[1], need_dalpha)

    @staticmethod
    def backward(ctx, g_out):
        alpha, grad_scale, x, seed = ctx.saved_tensors
        need_dh, need_dalpha = ctx.need
        if g_out is None:
            return (None,) * 10
        dx, dh, _, _, dalpha = run_residual_norm_backward(
            ctx.backend, g_out, None, None, x, None, None, None, alpha, ctx.alpha_value, grad_scale,
            ctx.x_dtype, ctx.h_dtype if need_dh else None, False, False, need_dalpha, ctx.dropout_p, seed)
        return (dx, dh if need_dh else None, dalpha.to(alpha.dtype).reshape(alpha.shape) if need_dalpha else None,
                None, None, None, None, None, None, None)


class LayerNormFn(torch.autograd.Function):
    """y = LayerNorm(x) * weight + bias, normalised in fp32 registers."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype, backend):
        inputs = (x, weight, bias, eps, out_dtype)
        output = layer_norm_triton(*inputs)
        LayerNormFn.save(ctx, backend, inputs, output)
        return output[0]

    @staticmethod
    def save(ctx, backend, inputs, output):
        x, weight, bias, eps, out_dtype = inputs
        y, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.backend, ctx.x_dtype = backend, x.dtype
        ctx.need = (ctx.needs_input_grad[1], ctx.needs_input_grad[2])

    @staticmethod
    def backward(ctx, g_y, *_stats_grads):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need_dweight, need_dbias = ctx.need
        if g_y is None:
            return (None,) * 6
        dx, _, dweight, dbias, _ = run_residual_norm_backward(
            ctx.backend, None, g_y, x, None, weight, mean, rstd, None, 1.0, None, ctx.x_dtype, None,
            need_dweight and weight is not None, need_dbias and bias is not None, False, 0.0, None)
        return dx, param_grad(dweight, weight, need_dweight), param_grad(dbias, bias, need_dbias), None, None, None


# ---------------------------------------------------------------------------------------------
# The custom ops (what torch.compile, opcheck and the dispatcher see). dres:: runs the Triton
# launches; dres_cuda:: (the csrc extension, defined in C++ with the same schemas and autograd) gets
# the same fake kernels (registered through dres.ops.csrc_backend).


def _residual_layer_norm_fake(x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype,
                              out_dtype, dropout_p, seed):
    out = x.new_empty(x.shape, dtype=residual_dtype or x.dtype)
    y = x.new_empty(x.shape, dtype=out_dtype or h.dtype)
    return (out, y) + _stats(x)


def _residual_add_fake(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, dropout_p, seed):
    return x.new_empty(x.shape, dtype=residual_dtype or x.dtype)


def _layer_norm_fake(x, weight, bias, eps, out_dtype):
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype),) + _stats(x)


def _residual_norm_backward_fake(g_out, g_y, normed, x, weight, mean, rstd, alpha, alpha_value, grad_scale, x_dtype,
                                 h_dtype, need_dweight, need_dbias, need_dalpha, dropout_p, seed):
    ref = g_out if g_out is not None else g_y
    dim = ref.shape[-1]
    f32 = lambda shape: ref.new_empty(shape, dtype=torch.float32)  # noqa: E731
    dx = ref.new_empty(ref.shape, dtype=x_dtype)
    dh = ref.new_empty(ref.shape, dtype=h_dtype) if h_dtype is not None else ref.new_empty((0,), dtype=x_dtype)
    has_norm_grads = g_y is not None
    dweight = f32((dim,) if need_dweight and has_norm_grads else (0,))
    dbias = f32((dim,) if need_dbias and has_norm_grads else (0,))
    dalpha = f32(() if need_dalpha else (0,))
    return dx, dh, dweight, dbias, dalpha


FAKE_IMPLS = {"residual_layer_norm": _residual_layer_norm_fake, "residual_add": _residual_add_fake,
              "layer_norm": _layer_norm_fake, "residual_norm_backward": _residual_norm_backward_fake}


def fakes_registering_fallbacks(namespace: str) -> dict:
    """FAKE_IMPLS for ``torch.ops.<namespace>``, each first registering the namespace's Inductor fallbacks."""
    qualnames = [f"{namespace}::{name}" for name in FAKE_IMPLS]
    return {name: with_inductor_fallbacks(qualnames, fake) for name, fake in FAKE_IMPLS.items()}


_QUALNAMES = [f"dres::{name}" for name in FAKE_IMPLS]
residual_layer_norm_op = define_op("dres::residual_layer_norm", residual_layer_norm_triton, _residual_layer_norm_fake,
                                   _QUALNAMES, autograd=ResidualLayerNormFn)
residual_add_op = define_op("dres::residual_add", residual_add_triton, _residual_add_fake, _QUALNAMES,
                            autograd=ResidualAddFn)
layer_norm_op = define_op("dres::layer_norm", layer_norm_triton, _layer_norm_fake, _QUALNAMES, autograd=LayerNormFn)
residual_norm_backward_op = define_op("dres::residual_norm_backward", residual_norm_backward_triton,
                                      _residual_norm_backward_fake, _QUALNAMES)
# The csrc ops (defined in C++ with the same schemas and their autograd) take the same fakes.
if csrc_backend.available():
    csrc_backend.register_fakes(fakes_registering_fallbacks("dres_cuda"))


def _custom_op(backend: str, name: str):
    """The op of ``backend`` with its autograd: dres:: for Triton (what torch.compile traces), dres_cuda::
    for csrc (compiled and eager alike)."""
    return getattr(torch.ops.dres_cuda if backend == "cuda" else torch.ops.dres, name).default


# ---------------------------------------------------------------------------------------------
# Public functions


def _dropout_seed(x: Tensor, dropout_p: float) -> Optional[Tensor]:
    """The Philox seed of one dropout call, None without dropout: drawn from torch's generator of x's
    device into a tensor the kernels read, so a compiled or captured graph draws afresh at every run."""
    return torch.randint(1 << 62, (), device=x.device) if dropout_p > 0 else None


def residual_layer_norm(x, h, weight, bias, alpha=1.0, eps=1e-6, row_scale=None, grad_scale=None,
                        residual_dtype=None, out_dtype=None, dropout_p=0.0, backend=None):
    """Fused ``out = alpha*x + row_scale[b]*dropout(h)`` and ``y = LayerNorm(out)``; returns ``(out, y)``.

    x, h: (B, T, D) or (M, D). row_scale, grad_scale: (B,) per-sample factors or None
    (grad_scale None = row_scale), data: refused if they require grad. alpha: float or 0-dim tensor
    (gets a gradient if it requires one). eps: a positive float. out has ``residual_dtype``
    (default x.dtype); y has ``out_dtype`` (default h.dtype). dropout_p: torch's dropout of h (kept
    elements scaled by 1 / (1 - p)), its mask drawn in the kernel and drawn again in the backward,
    never stored; the caller passes 0 outside training, as for ``F.dropout(h, p, training)``.
    """
    backend = resolve_backend_by_work(backend, x)
    check_residual_norm_inputs(backend, x, h, weight, bias, alpha, row_scale, grad_scale, residual_dtype, out_dtype)
    check_eps(eps)
    check_dropout_p(dropout_p)
    if backend == "torch":
        return reference.residual_layer_norm(x, reference.dropout(h, dropout_p), weight, bias, alpha, eps, row_scale,
                                             grad_scale, residual_dtype, out_dtype)
    alpha, alpha_value = alpha_args(alpha)
    seed = _dropout_seed(x, dropout_p)
    if backend == "cuda" or torch.compiler.is_compiling():
        out, y, _, _ = _custom_op(backend, "residual_layer_norm")(
            x, h, weight, bias, alpha, alpha_value, float(eps), row_scale, grad_scale, residual_dtype, out_dtype,
            float(dropout_p), seed)
        return out, y
    return ResidualLayerNormFn.apply(x, h, weight, bias, alpha, alpha_value, float(eps), row_scale, grad_scale,
                                     residual_dtype, out_dtype, float(dropout_p), seed, backend)


def residual_add(x, h, alpha=1.0, row_scale=None, grad_scale=None, residual_dtype=None, dropout_p=0.0, backend=None):
    """``out = alpha*x + row_scale[b]*dropout(h)`` with gradient ``grad_scale[b]*g`` (through the same
    mask) into h (no norm); dropout_p as :func:`residual_layer_norm`'s."""
    backend = resolve_backend_by_work(backend, x)
    check_residual_norm_inputs(backend, x, h, None, None, alpha, row_scale, grad_scale, residual_dtype)
    check_dropout_p(dropout_p)
    if backend == "torch":
        return reference.residual_add(x, reference.dropout(h, dropout_p), alpha, row_scale, grad_scale, residual_dtype)
    alpha, alpha_value = alpha_args(alpha)
    seed = _dropout_seed(x, dropout_p)
    if backend == "cuda" or torch.compiler.is_compiling():
        return _custom_op(backend, "residual_add")(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype,
                                                   float(dropout_p), seed)
    return ResidualAddFn.apply(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype, float(dropout_p), seed,
                               backend)


def layer_norm(x, weight, bias, eps=1e-6, out_dtype=None, backend=None):
    """LayerNorm over the last dimension in fp32; y has ``out_dtype`` (default x.dtype)."""
    backend = resolve_backend_by_work(backend, x)
    check_residual_norm_inputs(backend, x, None, weight, bias, out_dtype=out_dtype, check_h=False)
    check_eps(eps)
    if backend == "torch":
        return reference.layer_norm(x, weight, bias, eps, out_dtype)
    if backend == "cuda" or torch.compiler.is_compiling():
        y, _, _ = _custom_op(backend, "layer_norm")(x, weight, bias, float(eps), out_dtype)
        return y
    return LayerNormFn.apply(x, weight, bias, float(eps), out_dtype, backend)
