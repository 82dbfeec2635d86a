"""dres.ops: the fused residual operations (the contract of DESIGN.md, "The fused operation").

    out, y = residual_layer_norm(x, h, weight, bias, alpha, eps, row_scale, grad_scale)
        out = alpha * x + row_scale[b] * h          (the new residual stream)
        y   = LayerNorm(out) * weight + bias        (normalising the stored, rounded out)
        backward: g = g_out + LN_bwd(g_y); dx = alpha * g; dh = grad_scale[b] * g
    out = residual_add(x, h, alpha, row_scale, grad_scale)
    y   = layer_norm(x, weight, bias, eps)

``backend``: None picks Triton for CUDA tensors and the PyTorch reference otherwise; "triton" forces
the kernels (on CPU only under ``TRITON_INTERPRET=1``); "torch" the reference
(:mod:`dres.ops.reference`, float64-capable); "cuda" the csrc extension when built.
"""

from __future__ import annotations

import torch

from dres.ops import reference
from dres.ops.bias_gelu import fused_bias_gelu, fused_mlp
from dres.ops.checks import check_inputs, resolve_backend
from dres.ops.mae_loss import mae_loss, mae_loss_reference
from dres.ops.residual_act import residual_act

__all__ = ["fused_bias_gelu", "fused_mlp", "residual_layer_norm", "residual_add", "layer_norm", "mae_loss", "mae_loss_reference", "reference",
           "residual_act"]


def _alpha_args(alpha):
    """The custom ops take alpha as (tensor or None, float): a tensor is read by the kernel, so a
    new value needs no recompilation; a Python float is passed by value."""
    if isinstance(alpha, torch.Tensor):
        return alpha.reshape(()), 1.0
    return None, float(alpha)


def residual_layer_norm(x, h, weight, bias, alpha=1.0, eps=1e-6, row_scale=None, grad_scale=None,
                        residual_dtype=None, out_dtype=None, backend=None):
    """Fused ``out = alpha*x + row_scale[b]*h`` and ``y = LayerNorm(out)``; returns ``(out, y)``.

    x, h: (B, T, D) or (M, D). row_scale, grad_scale: (B,) per-sample factors or None
    (grad_scale None = row_scale). alpha: float or 0-dim tensor (gets a gradient if it requires one).
    out has ``residual_dtype`` (default x.dtype); y has ``out_dtype`` (default h.dtype).
    """
    backend = resolve_backend(backend, x)
    check_inputs(backend, x, h, weight, bias, alpha, row_scale, grad_scale, residual_dtype, out_dtype)
    if backend == "torch":
        return reference.residual_layer_norm(x, h, weight, bias, alpha, eps, row_scale, grad_scale,
                                             residual_dtype, out_dtype)
    op = _op(backend, "residual_layer_norm")
    alpha_t, alpha_v = _alpha_args(alpha)
    out, y, _, _ = op(x, h, weight, bias, alpha_t, alpha_v, float(eps), row_scale, grad_scale,
                      residual_dtype, out_dtype)
    return out, y


def residual_add(x, h, alpha=1.0, row_scale=None, grad_scale=None, residual_dtype=None, backend=None):
    """``out = alpha*x + row_scale[b]*h`` with gradient ``grad_scale[b]*g`` into h (no norm)."""
    backend = resolve_backend(backend, x)
    check_inputs(backend, x, h, None, None, alpha, row_scale, grad_scale, residual_dtype)
    if backend == "torch":
        return reference.residual_add(x, h, alpha, row_scale, grad_scale, residual_dtype)
    alpha_t, alpha_v = _alpha_args(alpha)
    return _op(backend, "residual_add")(x, h, alpha_t, alpha_v, row_scale, grad_scale, residual_dtype)


def layer_norm(x, weight, bias, eps=1e-6, out_dtype=None, backend=None):
    """LayerNorm over the last dimension in fp32; y has ``out_dtype`` (default x.dtype)."""
    backend = resolve_backend(backend, x)
    check_inputs(backend, x, None, weight, bias, out_dtype=out_dtype, check_h=False)
    if backend == "torch":
        return reference.layer_norm(x, weight, bias, eps, out_dtype)
    y, _, _ = _op(backend, "layer_norm")(x, weight, bias, float(eps), out_dtype)
    return y


def _op(backend: str, name: str):
    """The callable for op ``name``: the custom op under torch.compile, else the eager fast path."""
    if backend == "cuda":
        if torch.compiler.is_compiling():
            return getattr(torch.ops.dres_cuda, name)
        from dres.ops import csrc_backend

        return csrc_backend.EAGER[name]
    from dres.ops import residual_norm  # registers the dres:: custom ops on first use

    if torch.compiler.is_compiling():
        return getattr(residual_norm, f"{name}_op")
    return residual_norm.EAGER[name]
