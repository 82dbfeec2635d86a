"""The fused residual ops as torch custom ops with autograd, backed by the Triton kernels.

Registered with ``torch.library.custom_op`` + ``register_fake`` + ``register_autograd`` so the ops
run in eager mode, under ``torch.compile(fullgraph=True)`` (opaque to Inductor, no graph breaks),
under CUDA-graph capture and FSDP2, and pass ``torch.library.opcheck``.

Forward ops return extra outputs (mean, rstd) that the backward needs; the public functions in
:mod:`dres.ops` drop them. The backward is a custom op of its own so that compiled graphs trace
straight through it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from dres.kernels import residual_norm_backward, residual_norm_forward
from dres.ops.registration import eager_autograd_function, with_inductor_fallbacks


def as_rows(t: Tensor) -> Tensor:
    """A 2-D (rows, D) view of ``t`` with unit stride along D; copies only when no such view exists.

    Gradients may arrive with any strides (a slice of a larger tensor, an expanded tensor with row
    stride 0): those keep their strides and the kernels read them in place.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def _rows_per_sample(x: Tensor, scale: Optional[Tensor]) -> int:
    return 1 if scale is None else (x.numel() // x.shape[-1]) // scale.shape[0]


def _empty_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    rows = x.numel() // x.shape[-1]
    return (x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Forward ops


def residual_layer_norm_impl(
    x: Tensor, h: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], alpha: Optional[Tensor],
    alpha_value: float, eps: float, row_scale: Optional[Tensor], grad_scale: Optional[Tensor],
    residual_dtype: Optional[torch.dtype], out_dtype: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = torch.empty(x.shape, dtype=residual_dtype or x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=out_dtype or h.dtype, device=x.device)
    mean, rstd = _empty_stats(x)
    residual_norm_forward(
        as_rows(x), as_rows(h), weight, bias, alpha if alpha is not None else alpha_value, eps,
        row_scale, _rows_per_sample(x, row_scale), out.view(-1, x.shape[-1]), y.view(-1, x.shape[-1]), mean, rstd,
    )
    return out, y, mean, rstd


def _rln_fake(x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype, out_dtype):
    out = x.new_empty(x.shape, dtype=residual_dtype or x.dtype)
    y = x.new_empty(x.shape, dtype=out_dtype or h.dtype)
    return (out, y) + _empty_stats(x)


def residual_add_impl(
    x: Tensor, h: Tensor, alpha: Optional[Tensor], alpha_value: float,
    row_scale: Optional[Tensor], grad_scale: Optional[Tensor], residual_dtype: Optional[torch.dtype],
) -> Tensor:
    out = torch.empty(x.shape, dtype=residual_dtype or x.dtype, device=x.device)
    residual_norm_forward(
        as_rows(x), as_rows(h), None, None, alpha if alpha is not None else alpha_value, 0.0,
        row_scale, _rows_per_sample(x, row_scale), out.view(-1, x.shape[-1]), None, None, None,
    )
    return out


def _add_fake(x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype):
    return x.new_empty(x.shape, dtype=residual_dtype or x.dtype)


def layer_norm_impl(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, out_dtype: Optional[torch.dtype],
) -> tuple[Tensor, Tensor, Tensor]:
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    mean, rstd = _empty_stats(x)
    residual_norm_forward(as_rows(x), None, weight, bias, 1.0, eps, None, 1, None, y.view(-1, x.shape[-1]), mean, rstd)
    return y, mean, rstd


def _ln_fake(x, weight, bias, eps, out_dtype):
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype),) + _empty_stats(x)


# ---------------------------------------------------------------------------------------------
# The one backward op


def residual_norm_backward_impl(
    g_out: Optional[Tensor], g_y: Optional[Tensor], normed: Optional[Tensor], x: Optional[Tensor],
    weight: Optional[Tensor], mean: Optional[Tensor], rstd: Optional[Tensor],
    alpha: Optional[Tensor], alpha_value: float, grad_scale: Optional[Tensor],
    x_dtype: torch.dtype, h_dtype: Optional[torch.dtype],
    need_dweight: bool, need_dbias: bool, need_dalpha: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dh, dweight fp32, dbias fp32, dalpha fp32); gradients not asked for come back empty.

    ``h_dtype=None`` means there is no branch input (layer_norm) or it needs no gradient.
    """
    ref = g_out if g_out is not None else g_y
    shape, dim = ref.shape, ref.shape[-1]
    dx = torch.empty(shape, dtype=x_dtype, device=ref.device)
    dh = torch.empty(shape, dtype=h_dtype, device=ref.device) if h_dtype is not None else None
    rows = lambda t: None if t is None else as_rows(t)  # noqa: E731
    dweight, dbias, dalpha = residual_norm_backward(
        rows(g_out), rows(g_y) if g_y is not None else None, rows(normed), rows(x), weight, mean, rstd,
        alpha if alpha is not None else alpha_value, grad_scale,
        1 if grad_scale is None else (ref.numel() // dim) // grad_scale.shape[0],
        dx.view(-1, dim), None if dh is None else dh.view(-1, dim), need_dweight, need_dbias, need_dalpha,
    )
    empty = lambda dtype=torch.float32: ref.new_empty((0,), dtype=dtype)  # noqa: E731  (distinct: no aliasing)
    return (
        dx, dh if dh is not None else empty(x_dtype),
        dweight if dweight is not None else empty(), dbias if dbias is not None else empty(),
        dalpha if dalpha is not None else empty(),
    )


def _bwd_fake(g_out, g_y, normed, x, weight, mean, rstd, alpha, alpha_value, grad_scale, x_dtype, h_dtype,
              need_dweight, need_dbias, need_dalpha):
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


def _param_grad(grad: Tensor, like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    """Cast an fp32 parameter gradient to the parameter's dtype; zeros when the norm got no gradient."""
    if like is None or not needed:
        return None
    if grad.numel() == 0:
        return torch.zeros_like(like)
    return grad.to(like.dtype).reshape(like.shape)


def _alpha_needs_grad(ctx, alpha_index: int, alpha: Optional[Tensor]) -> bool:
    return alpha is not None and ctx.needs_input_grad[alpha_index]


# ---------------------------------------------------------------------------------------------
# Autograd


def _rln_setup(ctx, inputs, output):
    x, h, weight, bias, alpha, alpha_value, eps, row_scale, grad_scale, residual_dtype, out_dtype = inputs
    out, y, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    need_dalpha = _alpha_needs_grad(ctx, 4, alpha)
    ctx.save_for_backward(out, weight, bias, mean, rstd, alpha, grad_scale if grad_scale is not None else row_scale,
                          x if need_dalpha else None)
    ctx.alpha_value = alpha_value
    ctx.x_dtype, ctx.h_dtype = x.dtype, h.dtype
    ctx.need = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3], need_dalpha)


def _rln_backward(backward_op, ctx, g_out, g_y, _g_mean, _g_rstd):
    out, weight, bias, mean, rstd, alpha, grad_scale, x = ctx.saved_tensors
    need_dh, need_dweight, need_dbias, need_dalpha = ctx.need
    if g_out is None and g_y is None:
        return (None,) * 11
    dx, dh, dweight, dbias, dalpha = backward_op(
        g_out, g_y, out, x, weight, mean, rstd, alpha, ctx.alpha_value, grad_scale,
        ctx.x_dtype, ctx.h_dtype if need_dh else None, need_dweight and weight is not None,
        need_dbias and bias is not None, need_dalpha,
    )
    return (
        dx, dh if need_dh else None, _param_grad(dweight, weight, need_dweight), _param_grad(dbias, bias, need_dbias),
        dalpha.to(alpha.dtype).reshape(alpha.shape) if need_dalpha else None,
        None, None, None, None, None, None,
    )



def _add_setup(ctx, inputs, output):
    x, h, alpha, alpha_value, row_scale, grad_scale, residual_dtype = inputs
    ctx.set_materialize_grads(False)
    need_dalpha = _alpha_needs_grad(ctx, 2, alpha)
    ctx.save_for_backward(alpha, grad_scale if grad_scale is not None else row_scale, x if need_dalpha else None)
    ctx.alpha_value = alpha_value
    ctx.x_dtype, ctx.h_dtype = x.dtype, h.dtype
    ctx.need = (ctx.needs_input_grad[1], need_dalpha)


def _add_backward(backward_op, ctx, g_out):
    alpha, grad_scale, x = ctx.saved_tensors
    need_dh, need_dalpha = ctx.need
    if g_out is None:
        return (None,) * 7
    dx, dh, _, _, dalpha = backward_op(
        g_out, None, None, x, None, None, None, alpha, ctx.alpha_value, grad_scale,
        ctx.x_dtype, ctx.h_dtype if need_dh else None, False, False, need_dalpha,
    )
    return (
        dx, dh if need_dh else None,
        dalpha.to(alpha.dtype).reshape(alpha.shape) if need_dalpha else None, None, None, None, None,
    )



def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps, out_dtype = inputs
    y, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.x_dtype = x.dtype
    ctx.need = (ctx.needs_input_grad[1], ctx.needs_input_grad[2])


def _ln_backward(backward_op, ctx, g_y, _g_mean, _g_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need_dweight, need_dbias = ctx.need
    if g_y is None:
        return (None,) * 5
    dx, _, dweight, dbias, _ = backward_op(
        None, g_y, x, None, weight, mean, rstd, None, 1.0, None, ctx.x_dtype, None,
        need_dweight and weight is not None, need_dbias and bias is not None, False,
    )
    return dx, _param_grad(dweight, weight, need_dweight), _param_grad(dbias, bias, need_dbias), None, None



# ---------------------------------------------------------------------------------------------
# The custom ops (what torch.compile, opcheck and the dispatcher see)

residual_layer_norm_op = torch.library.custom_op("dres::residual_layer_norm", mutates_args=())(residual_layer_norm_impl)
residual_add_op = torch.library.custom_op("dres::residual_add", mutates_args=())(residual_add_impl)
layer_norm_op = torch.library.custom_op("dres::layer_norm", mutates_args=())(layer_norm_impl)
residual_norm_backward_op = torch.library.custom_op("dres::residual_norm_backward", mutates_args=())(
    residual_norm_backward_impl)


# ---------------------------------------------------------------------------------------------
# Registration, shared by every backend whose ops have these schemas: the Triton ops here and the
# csrc ops (torch.ops.dres_cuda, registered from dres.ops.csrc_backend). The backends differ only
# in the kernels behind the ops and in which backward op the autograd formulas call.


# Fake (meta) kernels by op name. Each backend registers them itself: torch requires the fake of
# an op defined in C++ to be registered from the module its library names (set_python_module).
FAKE_IMPLS = {"residual_layer_norm": _rln_fake, "residual_add": _add_fake, "layer_norm": _ln_fake,
              "residual_norm_backward": _bwd_fake}


def register_fakes(namespace: str) -> None:
    """Register FAKE_IMPLS for ``torch.ops.<namespace>``; torch checks the *caller's* module against
    the one a C++ library names (set_python_module), hence ``_stacklevel=2``."""
    qualnames = [f"{namespace}::{name}" for name in FAKE_IMPLS]
    for qualname, fake in zip(qualnames, FAKE_IMPLS.values()):
        torch.library.register_fake(qualname, with_inductor_fallbacks(qualnames, fake), _stacklevel=2)


def register_autograd(residual_layer_norm, residual_add, layer_norm, backward_op) -> None:
    """Autograd for one backend's forward ops; ``backward_op`` is that backend's backward op."""
    for op, backward, setup in ((residual_layer_norm, _rln_backward, _rln_setup),
                                (residual_add, _add_backward, _add_setup),
                                (layer_norm, _ln_backward, _ln_setup)):
        torch.library.register_autograd(op, functools.partial(backward, backward_op), setup_context=setup)


register_fakes("dres")
register_autograd(residual_layer_norm_op, residual_add_op, layer_norm_op, residual_norm_backward_op)


# ---------------------------------------------------------------------------------------------
# Eager fast path. Outside torch.compile the ops run through plain autograd.Functions built from
# the same bodies and the same setup/backward formulas: the custom-op machinery (dispatcher,
# schema checks, aliasing checks) costs tens of microseconds per call, which at MAE-sized tensors
# is more than the kernels themselves. torch.compile traces the custom ops instead.


def eager_functions(prefix: str, backward_body, **bodies) -> dict:
    """``{op name: autograd.Function.apply}`` for one backend's forward bodies and backward body."""
    formulas = {"residual_layer_norm": (_rln_setup, _rln_backward), "residual_add": (_add_setup, _add_backward),
                "layer_norm": (_ln_setup, _ln_backward)}
    functions = {}
    for name, body in bodies.items():
        setup, backward = formulas[name]
        functions[name] = eager_autograd_function(f"{prefix}_{name}", body, setup,
                                                  functools.partial(backward, backward_body)).apply
    return functions


EAGER = eager_functions("Triton", residual_norm_backward_impl, residual_layer_norm=residual_layer_norm_impl,
                        residual_add=residual_add_impl, layer_norm=layer_norm_impl)
