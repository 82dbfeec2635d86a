"""Pure-PyTorch reference implementations of every fused op (the contract, written plainly), named
as the ops are: ``residual_layer_norm``, ``residual_add``, ``layer_norm``, ``residual_act``,
``bias_gelu`` (and its ``gelu``), ``mlp``, ``mae_loss``, ``short_attention``.

These are what ``backend="torch"`` runs and what the tests compare the kernels against. They
compute in float32, or in float64 when any input is float64 (:func:`compute_dtype`), so a float64
call gives the exact reference. They differentiate through ordinary autograd; the one custom piece
is :class:`ScaleWithGradScale`, which multiplies by ``row_scale`` forward and by ``grad_scale``
backward (ResidualDroppath's detach semantics: ``f.detach() * m + f * (1 - m)`` has value ``f``
and gradient ``(1 - m) * g``). Imports no op module: the op modules import this one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dres.ops.utils import mlp_compute_dtype, patchify


def compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """The dtype the references compute in: float64 when any of ``tensors`` is, else float32."""
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


def dropout(h: Tensor, p: float) -> Tensor:
    """torch's dropout of the branch h (kept elements scaled by 1 / (1 - p)); h itself where p is 0."""
    return F.dropout(h, p) if p > 0 else h


def residual_add(x, h, alpha=1.0, row_scale=None, grad_scale=None, residual_dtype=None):
    """out = alpha * x + row_scale[b] * h, computed in fp32 (fp64 if any input is), stored in residual_dtype."""
    compute = compute_dtype(x, h)
    residual_dtype = residual_dtype or x.dtype
    alpha = alpha.to(compute) if isinstance(alpha, torch.Tensor) else alpha
    scaled = row_scale is not None or grad_scale is not None
    # an unscaled h joins the sum by type promotion, and a float alpha of one multiplies nothing: the same values,
    # a launch (eager) fewer each
    branch = scaled_branch(h.to(compute), row_scale, grad_scale) if scaled else h
    shortcut = x.to(compute) if isinstance(alpha, (int, float)) and alpha == 1 else alpha * x.to(compute)
    return (shortcut + branch).to(residual_dtype)


def layer_norm(x, weight, bias, eps=1e-6, out_dtype=None):
    """LayerNorm over the last dim in fp32 (fp64 if any input is); y in out_dtype (default x.dtype)."""
    compute = compute_dtype(x, weight, bias)
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
    out = residual_add(x, h, alpha, row_scale, grad_scale, residual_dtype=compute_dtype(x, h)).to(x.dtype)
    # ReLU after the rounding (the same values): its backward reads the stored out, as the kernel's does
    return torch.relu(out) if act == "relu" else out


def gelu(v: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(v, approximate=approximate)`` ("none", "tanh"), or QuickGELU's ``v * sigmoid(1.702 v)`` ("quick"),
    in v's dtype."""
    return v * torch.sigmoid(1.702 * v) if approximate == "quick" else F.gelu(v, approximate=approximate)


def bias_gelu(pre: Tensor, bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
              approximate: str = "none") -> Tensor:
    """:func:`gelu` of ``pre + bias`` in fp32, or fp64 when an input is; result in out_dtype (default pre.dtype)."""
    compute = compute_dtype(pre, bias)
    v = pre.to(compute)
    if bias is not None:
        v = v + bias.to(compute)
    return gelu(v, approximate).to(out_dtype or pre.dtype)


def mlp(x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor, fc2_bias: Optional[Tensor],
        approximate: str = "none") -> Tensor:
    """``fc2(gelu(fc1(x)))`` with the fused op's dtypes, through ordinary autograd: matmuls in
    :func:`dres.ops.utils.mlp_compute_dtype`, fc1 without its bias, then bias + GELU in fp32 (fp64
    for fp64 inputs) rounded to the compute dtype. In float64 this is the exact MLP."""
    compute = mlp_compute_dtype(x)
    pre = F.linear(x.to(compute), fc1_weight.to(compute))
    act = bias_gelu(pre, fc1_bias, approximate=approximate)
    return F.linear(act, fc2_weight.to(compute), None if fc2_bias is None else fc2_bias.to(compute))


def mae_loss(pred: Tensor, imgs: Tensor, mask: Tensor, patch_size: int, norm_pix: bool = True,
             eps: float = 1e-6) -> Tensor:
    """``MAE.forward_loss`` in plain PyTorch: fp32 (fp64 when pred or imgs is fp64), gradients by autograd."""
    dtype = compute_dtype(pred, imgs)
    target = patchify(imgs, patch_size).to(dtype)
    if norm_pix:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + eps) ** 0.5
    loss = ((pred.to(dtype) - target) ** 2).mean(dim=-1)
    mask = mask.to(dtype)
    mask_sum = mask.sum()
    # An all-zero mask counts no patch: loss 0 and zero gradient rather than 0 / 0.
    return (loss * mask).sum() / torch.where(mask_sum != 0, mask_sum, torch.ones_like(mask_sum))


def short_attention(qkv: Tensor, num_heads: int, scale: Optional[float] = None) -> Tensor:
    """The attention written out in fp32 (fp64 for fp64 qkv), gradients by autograd; result in qkv's dtype."""
    B, N, three_c = qkv.shape
    C = three_c // 3
    head_dim = C // num_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = qkv.to(compute_dtype(qkv)).reshape(B, N, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    probs = ((q @ k.transpose(-2, -1)) * scale).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(B, N, C).to(qkv.dtype)
