"""Pure-PyTorch reference implementations of the fused ops (the contract, written plainly).

These are what ``backend="torch"`` runs and what the tests compare the kernels against. They
compute in float32, or in float64 when any input is float64, so a float64 call gives the exact
reference. They differentiate through ordinary autograd; the one custom piece is
:class:`ScaleWithGradScale`, which multiplies by ``row_scale`` forward and by ``grad_scale``
backward (ResidualDroppath's detach semantics: ``f.detach() * m + f * (1 - m)`` has value ``f``
and gradient ``(1 - m) * g``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_row(scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B,) per-sample factors broadcast over rows of a (B*T, D) or (B, T, D) tensor."""
    if rows.dim() == 2:
        return scale.repeat_interleave(rows.shape[0] // scale.shape[0]).unsqueeze(-1)
    return scale.reshape((scale.shape[0],) + (1,) * (rows.dim() - 1))


class ScaleWithGradScale(torch.autograd.Function):
    """``h * row_scale`` forward; gradient ``g * grad_scale`` backward (per sample)."""

    @staticmethod
    def forward(ctx, h, row_scale, grad_scale):
        ctx.save_for_backward(grad_scale)
        return h if row_scale is None else h * row_scale

    @staticmethod
    def backward(ctx, g):
        (grad_scale,) = ctx.saved_tensors
        return (g if grad_scale is None else g * grad_scale), None, None


def scaled_branch(h: torch.Tensor, row_scale: torch.Tensor | None, grad_scale: torch.Tensor | None) -> torch.Tensor:
    """The branch term ``row_scale[b] * h`` with gradient ``grad_scale[b] * g`` (None = row_scale)."""
    if grad_scale is None:
        grad_scale = row_scale
    if row_scale is None and grad_scale is None:
        return h
    rs = None if row_scale is None else _per_row(row_scale.to(h.dtype), h)
    gs = None if grad_scale is None else _per_row(grad_scale.to(h.dtype), h)
    if row_scale is not None and grad_scale is row_scale:
        return h * rs  # plain autograd already gives g * row_scale
    return ScaleWithGradScale.apply(h, rs, gs)


def residual_add(x, h, alpha=1.0, row_scale=None, grad_scale=None, residual_dtype=None):
    """out = alpha * x + row_scale[b] * h, computed in fp32 (fp64 if any input is), stored in residual_dtype."""
    compute = _compute_dtype(x, h)
    residual_dtype = residual_dtype or x.dtype
    alpha = alpha.to(compute) if isinstance(alpha, torch.Tensor) else alpha
    branch = scaled_branch(h.to(compute), row_scale, grad_scale)
    return (alpha * x.to(compute) + branch).to(residual_dtype)


def layer_norm(x, weight, bias, eps=1e-6, out_dtype=None):
    """LayerNorm over the last dim in fp32 (fp64 if any input is); y in out_dtype (default x.dtype)."""
    compute = _compute_dtype(x, weight, bias)
    w = None if weight is None else weight.to(compute)
    b = None if bias is None else bias.to(compute)
    y = F.layer_norm(x.to(compute), x.shape[-1:], w, b, eps)
    return y.to(out_dtype or x.dtype)


def residual_layer_norm(x, h, weight, bias, alpha=1.0, eps=1e-6, row_scale=None, grad_scale=None,
                        residual_dtype=None, out_dtype=None):
    """(out, y): the residual add, then LayerNorm of the stored (rounded) ``out``."""
    out = residual_add(x, h, alpha, row_scale, grad_scale, residual_dtype)
    y = layer_norm(out, weight, bias, eps, out_dtype or h.dtype)
    return out, y


def residual_act(x, h, alpha=1.0, row_scale=None, grad_scale=None, act="relu"):
    """act(alpha * x + row_scale[b] * h) for x, h of shape (B, ...), act "relu" or "identity":
    computed in fp32 (fp64 if any input is), stored in x.dtype; the ReLU backward is torch's."""
    out = residual_add(x, h, alpha, row_scale, grad_scale, residual_dtype=_compute_dtype(x, h))
    return (torch.relu(out) if act == "relu" else out).to(x.dtype)
