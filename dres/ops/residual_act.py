"""The convolutional residual ``out = act(alpha * x + row_scale[b] * h)`` as one fused op.

    out = residual_act(x, h, alpha, row_scale, grad_scale, act="relu")
        out = act(alpha * x + row_scale[b] * h)       act: "relu" (ResNet) or "identity"
        backward: g' = g * act'(out);  dx = alpha * g';  dh = grad_scale[b] * g'  (None = row_scale)
                  dalpha = sum(g' * x) when alpha is a tensor that requires grad

x is the shortcut (identity or downsample), h the branch; both are (B, ...) with B samples, NCHW or
channels_last or any layout whose batch dimension is outermost in memory: the kernels treat each as
B samples of C*H*W elements in physical order, so a feature map of any size is one flat 1-D launch.
h is laid out like x (copied when it is not); out is stored in x's dtype and x's layout. The ReLU
backward reads only the stored ``out``, like torch's relu, so x and h are not kept (x only for dalpha).

``ResidualActFn`` is the op's autograd.Function: eager calls (and the CUDA graphs captured from
them) run its Triton kernels. Under torch.compile the op is its PyTorch formula
(:func:`dres.ops.reference.residual_act`), which Inductor fuses with the BatchNorm that makes h, one
kernel where an opaque op made two (BENCHMARKS.md, "Your model"). ``backend``: None runs Triton on
CUDA tensors, except a plain sum (alpha 1, no per-sample factors: :func:`is_plain_sum`), which it leaves
to PyTorch's add and ReLU, and the float64-capable PyTorch reference elsewhere; "triton" forces the
kernels (on CPU under TRITON_INTERPRET=1); "torch" the reference; "cuda" (the csrc extension has no such
kernel) runs Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dres.ops import reference
from dres.ops.checks import (REFERENCE_DTYPES, check_alpha, check_factors_are_data, check_same_device, check_tensor,
                             check_vector, resolve_backend_without_csrc, supported_dtypes)
from dres.ops.utils import alpha_args

ACTS = ("relu", "identity")


# ---------------------------------------------------------------------------------------------
# Checks: messages name the argument, before any kernel sees it


def check_residual_act_inputs(backend: str, x, h, alpha, row_scale, grad_scale, act) -> None:
    dtypes = supported_dtypes(backend)
    check_tensor("x", x, dtypes)
    if x.dim() < 1:
        raise ValueError("x must have a batch dimension first: (B, C, H, W) or any (B, ...)")
    check_tensor("h", h, dtypes)
    if h.shape != x.shape:
        raise ValueError(f"h has shape {tuple(h.shape)} but x has {tuple(x.shape)}; they must match")
    check_same_device("h", h, x)
    check_alpha(alpha, x, dtypes)
    for name, s in (("row_scale", row_scale), ("grad_scale", grad_scale)):
        check_vector(name, s, x.shape[0], x, dtypes, "x's batch size")
    check_factors_are_data(row_scale=row_scale, grad_scale=grad_scale)
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")


# ---------------------------------------------------------------------------------------------
# Reference: dres.ops.reference.residual_act (backend="torch" runs it; the tests compare the kernels
# against it)


# ---------------------------------------------------------------------------------------------
# Launches. Layout: B samples of per_sample elements each, in the tensor's physical order


def sample_major_dense(t: Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps with the batch dimension outermost
    (NCHW and channels_last both do), so element e of its storage belongs to sample e // per_sample."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return True  # a ResNet's two layouts, told in C++: this runs several times a call, on the host path
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return t.shape[0] <= 1 or t.stride(0) * t.shape[0] == t.numel()


def _same_layout(strides_a, strides_b, shape) -> bool:
    return all(sa == sb for sa, sb, n in zip(strides_a, strides_b, shape) if n > 1)


def kernel_strides(t: Tensor) -> tuple[int, ...]:
    """The strides the op works in for ``t``: its own when sample-major dense, else contiguous ones."""
    if sample_major_dense(t):
        return tuple(t.stride())
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _empty_laid_out(shape, strides, dtype, device) -> tuple[Tensor, Tensor]:
    """(a tensor of ``shape`` with ``strides``, its flat 1-D storage in physical order)."""
    flat = torch.empty((torch.Size(shape).numel(),), dtype=dtype, device=device)
    return flat.as_strided(shape, strides), flat


def _flat_in(t: Tensor, strides) -> Tensor:
    """``t``'s elements as a flat 1-D tensor in the physical order of ``strides`` (for t's shape);
    copies only when t is not already laid out that way (h unlike x, a strided gradient)."""
    if (t.stride() == strides or _same_layout(t.stride(), strides, t.shape)) and sample_major_dense(t):
        return t.as_strided((t.numel(),), (1,))
    laid, flat = _empty_laid_out(t.shape, strides, t.dtype, t.device)
    laid.copy_(t)
    return flat


def _per_sample(t: Tensor) -> int:
    return t.numel() // t.shape[0] if t.shape[0] else 0


# ---------------------------------------------------------------------------------------------
# Triton launches (ResidualActFn's)


def residual_act_triton(x: Tensor, h: Tensor, alpha: Optional[Tensor], alpha_value: float,
                        row_scale: Optional[Tensor], act: str) -> Tensor:
    from dres.kernels.residual_act import residual_act_forward

    strides = kernel_strides(x)
    out, out_flat = _empty_laid_out(x.shape, strides, x.dtype, x.device)
    residual_act_forward(_flat_in(x, strides), _flat_in(h, strides), alpha, alpha_value,
                         None if row_scale is None else row_scale.contiguous(), _per_sample(x), act == "relu", out_flat)
    return out


def residual_act_backward_triton(g: Tensor, out: Optional[Tensor], x: Optional[Tensor], alpha: Optional[Tensor],
                                 alpha_value: float, grad_scale: Optional[Tensor], x_dtype: torch.dtype,
                                 h_dtype: Optional[torch.dtype],
                                 need_dalpha: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(dx, dh, dalpha fp32 0-dim) in g's layout; ``out`` given means ReLU (its act' is out > 0), x
    is read for dalpha only; dh (``h_dtype=None``) and dalpha are None when not asked for."""
    from dres.kernels.residual_act import residual_act_backward

    strides = kernel_strides(g)
    dx, dx_flat = _empty_laid_out(g.shape, strides, x_dtype, g.device)
    dh, dh_flat = _empty_laid_out(g.shape, strides, h_dtype, g.device) if h_dtype is not None else (None, None)
    flat = lambda t: None if t is None else _flat_in(t, strides)  # noqa: E731
    dalpha = residual_act_backward(flat(g), flat(out), flat(x) if need_dalpha else None, alpha, alpha_value,
                                   None if grad_scale is None else grad_scale.contiguous(), _per_sample(g),
                                   dx_flat, dh_flat)
    return dx, dh, dalpha


# ---------------------------------------------------------------------------------------------
# The autograd Function (eager calls; under torch.compile the op is its PyTorch formula, below)


class ResidualActFn(torch.autograd.Function):
    """out = act(alpha*x + row_scale[b]*h); g' = g * act'(out), dx = alpha*g', dh = grad_scale[b]*g'
    (grad_scale None = row_scale), dalpha = sum(g'*x). The ReLU backward reads only the stored out."""

    @staticmethod
    def forward(ctx, x, h, alpha, alpha_value, row_scale, grad_scale, act):
        out = residual_act_triton(x, h, alpha, alpha_value, row_scale, act)
        ctx.set_materialize_grads(False)
        need_dalpha = alpha is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(out if act == "relu" else None, x if need_dalpha else None, alpha,
                              grad_scale if grad_scale is not None else row_scale)
        ctx.alpha_value, ctx.x_dtype, ctx.h_dtype = alpha_value, x.dtype, h.dtype
        ctx.need = (ctx.needs_input_grad[1], need_dalpha)
        return out

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return (None,) * 7
        out, x, alpha, grad_scale = ctx.saved_tensors
        need_dh, need_dalpha = ctx.need
        dx, dh, dalpha = residual_act_backward_triton(g, out, x, alpha, ctx.alpha_value, grad_scale, ctx.x_dtype,
                                                      ctx.h_dtype if need_dh else None, need_dalpha)
        return (dx, dh, None if dalpha is None else dalpha.to(alpha.dtype).reshape(alpha.shape),
                None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Public function


def residual_act(x: Tensor, h: Tensor, alpha=1.0, row_scale: Optional[Tensor] = None,
                 grad_scale: Optional[Tensor] = None, act: str = "relu", backend: Optional[str] = None) -> Tensor:
    """Fused ``act(alpha*x + row_scale[b]*h)`` for a ResNet block: x the shortcut, h the branch.

    x, h: (B, ...) of one shape (NCHW, channels_last or any batch-outermost layout). row_scale,
    grad_scale: (B,) per-sample factors or None (grad_scale None = row_scale; docs/ops.md's table).
    alpha: float or 0-dim tensor (gets a gradient if it requires one). out: x's dtype and layout. Under
    torch.compile the formula (:func:`dres.ops.reference.residual_act`), for Inductor to fuse.
    """
    check_tensor("x", x, REFERENCE_DTYPES)  # before the backend looks at x's device
    chosen = backend is None
    backend = resolve_backend_without_csrc(backend, x)
    check_residual_act_inputs(backend, x, h, alpha, row_scale, grad_scale, act)
    # compiled, the formula: Inductor fuses it with the BatchNorm that makes h (one kernel where an opaque op made two)
    if backend == "torch" or torch.compiler.is_compiling():
        return reference.residual_act(x, h, alpha, row_scale, grad_scale, act)
    if chosen and is_plain_sum(x, h, alpha, row_scale, grad_scale):
        out = x + h  # torch's add rounds its fp32 sum once, as the kernel does: the same values
        return torch.relu(out) if act == "relu" else out
    return ResidualActFn.apply(x, h, *alpha_args(alpha), row_scale, grad_scale, act)


def is_plain_sum(x: Tensor, h: Tensor, alpha, row_scale: Optional[Tensor], grad_scale: Optional[Tensor]) -> bool:
    """Whether ``backend=None`` leaves an eager call to PyTorch's add and ReLU: nothing to scale, one dtype and
    layout. There the kernel saves one pass over the feature map but costs more host time than two launches
    from C++, and its backward writes dx and dh where autograd hands one gradient to both (BENCHMARKS.md,
    "Your model": the converted ResNet50d at 0.99x its original at 224 px, 0.61-0.71x at 32 px)."""
    return (row_scale is None and grad_scale is None and not isinstance(alpha, Tensor) and alpha == 1.0
            and x.dtype == h.dtype and same_layout(x, h))


def same_layout(x: Tensor, h: Tensor) -> bool:
    """Whether x and h (of one shape) lie alike in memory: their strides agree wherever a dimension has more than
    one element (a size-1 dimension's stride is never read: a 1 x 1 feature map is NCHW and NHWC alike, and
    libraries give it either)."""
    return all(a == b for a, b, n in zip(x.stride(), h.stride(), x.shape) if n > 1)
