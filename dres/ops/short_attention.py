"""Multi-head self-attention over short sequences (N <= 256 tokens) as one fused op per direction.

    out = short_attention(qkv, num_heads, scale=None)

    qkv: the qkv Linear's output (B, N, 3C), timm's layout: qkv.reshape(B, N, 3, H, d) holds q, k, v
    out[b, n, h*d:(h+1)*d] = softmax(q_bh k_bh^T * scale) v_bh      (scale default 1/sqrt(d))
    backward: dqkv (B, N, 3C) in qkv's layout, so the split and permute cost no copy

i.e. ``F.scaled_dot_product_attention`` of the (B, H, N, d) views, transposed back to (B, N, C); no
mask, dropout or causality. The Triton kernels (:mod:`dres.kernels.short_attention`) pack several
whole sequences of one head into one tile up to 128 tokens and give each (sequence, head) a program
above; the autograd saves only qkv (the backward recomputes the softmax).

As in every op module: one explicit ``autograd.Function`` (``ShortAttentionFn``), which is also the
autograd of the ``torch.library`` custom ops (``dres::short_attention``,
``dres::short_attention_backward``, ``define_op(..., autograd=ShortAttentionFn)``) that
``torch.compile`` (which calls them as opaque ops, see below) and ``opcheck`` see; eager calls skip
the custom-op dispatch cost. ``backend``: None runs the Triton kernels on CUDA tensors and the
PyTorch reference (:func:`dres.ops.reference.short_attention`) on CPU tensors or float64; "triton"
forces the kernels (on CPU under TRITON_INTERPRET=1); "torch" the reference; "cuda" (the csrc
extension, which has no such kernel) runs Triton.

Importing this module registers the ops but does not import Triton (the kernels are imported on
the first Triton call), so ``import dres.ops`` works where Triton is not installed.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from dres.ops import reference
from dres.ops.checks import check_tensor, resolve_backend_without_csrc, supported_dtypes
from dres.ops.registration import define_op

__all__ = ["short_attention", "ShortAttentionFn"]


# ---------------------------------------------------------------------------------------------
# Argument checks: messages name the argument, before any kernel sees it


def check_short_attention_inputs(backend: str, qkv: Tensor, num_heads: int, scale: Optional[float]) -> None:
    check_tensor("qkv", qkv, supported_dtypes(backend))
    if qkv.dim() != 3:
        raise ValueError(f"qkv must have shape (B, N, 3*C), got {tuple(qkv.shape)}")
    if not isinstance(num_heads, int) or isinstance(num_heads, bool):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    if qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"qkv has last dimension {qkv.shape[-1]}, not divisible by 3 * num_heads = {3 * num_heads}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
    if scale is not None and not -math.inf < scale < math.inf:
        raise ValueError(f"scale must be finite, got {scale!r}")
    if backend == "torch":
        return
    from dres.kernels.short_attention import HEAD_DIMS, MAX_SEQ_LEN, PACKED_MAX_SEQ_LEN, SEQUENCE_HEAD_DIMS

    seq_len, head_dim = qkv.shape[1], qkv.shape[-1] // (3 * num_heads)
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"qkv has N = {seq_len} tokens per sequence, above the kernel's maximum of {MAX_SEQ_LEN} "
                         f"(use backend='torch')")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"qkv has head dimension d = {head_dim} (3*C / (3 * num_heads)); the kernel supports "
                         f"{', '.join(map(str, HEAD_DIMS))} (use backend='torch')")
    if seq_len > PACKED_MAX_SEQ_LEN and head_dim not in SEQUENCE_HEAD_DIMS:
        raise ValueError(f"qkv has head dimension d = {head_dim} with N = {seq_len} tokens; above "
                         f"{PACKED_MAX_SEQ_LEN} tokens the kernel supports d in {', '.join(map(str, SEQUENCE_HEAD_DIMS))} "
                         f"(use backend='torch')")


# ---------------------------------------------------------------------------------------------
# Reference: dres.ops.reference.short_attention (backend="torch" runs it; the tests compare the
# kernels against it)


# ---------------------------------------------------------------------------------------------
# Triton launches (also the bodies of the dres:: custom ops)


def short_attention_triton(qkv: Tensor, num_heads: int, scale: float) -> Tensor:
    from dres.kernels.short_attention import short_attention_forward

    B, N, three_c = qkv.shape
    out = torch.empty((B, N, three_c // 3), dtype=qkv.dtype, device=qkv.device)
    short_attention_forward(qkv, out, num_heads, scale)
    return out


def short_attention_backward_triton(g: Tensor, qkv: Tensor, num_heads: int, scale: float) -> Tensor:
    """dqkv in qkv's dtype and layout, contiguous; ``g`` (B, N, C) with any strides."""
    from dres.kernels.short_attention import short_attention_backward

    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    short_attention_backward(g, qkv, dqkv, num_heads, scale)
    return dqkv


def run_short_attention_backward(backend: str, g: Tensor, qkv: Tensor, num_heads: int, scale: float) -> Tensor:
    """dqkv: "triton" launches the kernels (eager), "dres" calls the backward custom op (the custom
    op's autograd)."""
    if backend == "triton":
        return short_attention_backward_triton(g, qkv, num_heads, scale)
    return getattr(torch.ops, backend).short_attention_backward(g, qkv, num_heads, scale)


# ---------------------------------------------------------------------------------------------
# The autograd Function


class ShortAttentionFn(torch.autograd.Function):
    """out = softmax(q k^T * scale) v per (sequence, head); the backward recomputes the softmax from qkv,
    the only saved tensor."""

    @staticmethod
    def forward(ctx, qkv, num_heads, scale, backend):
        inputs = (qkv, num_heads, scale)
        out = short_attention_triton(*inputs)  # eager calls run Triton: the csrc extension has no such kernel
        ShortAttentionFn.save(ctx, backend, inputs, out)
        return out

    @staticmethod
    def save(ctx, backend, inputs, output):
        qkv, num_heads, scale = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv)
        ctx.backend, ctx.num_heads, ctx.scale = backend, num_heads, scale

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None, None
        (qkv,) = ctx.saved_tensors
        return run_short_attention_backward(ctx.backend, g, qkv, ctx.num_heads, ctx.scale), None, None, None


# ---------------------------------------------------------------------------------------------
# The custom ops (what torch.compile, opcheck and the dispatcher see)


def _short_attention_fake(qkv, num_heads, scale):
    B, N, three_c = qkv.shape
    return qkv.new_empty((B, N, three_c // 3))


def _short_attention_backward_fake(g, qkv, num_heads, scale):
    return qkv.new_empty(qkv.shape)


# Opaque under torch.compile: launched from Inductor's generated code, the kernels ran about eight times
# slower inside the whole-model compiled mae_cifar10 step than the same launches as a fallback
# (BENCHMARKS.md); the trainers capture whole steps in CUDA graphs, where the fallback's host cost is not paid.
_QUALNAMES = ("dres::short_attention", "dres::short_attention_backward")
short_attention_op = define_op("dres::short_attention", short_attention_triton, _short_attention_fake, _QUALNAMES,
                               inline=False, autograd=ShortAttentionFn)
short_attention_backward_op = define_op("dres::short_attention_backward", short_attention_backward_triton,
                                        _short_attention_backward_fake, _QUALNAMES, inline=False)


# ---------------------------------------------------------------------------------------------
# Public function


def short_attention(qkv: Tensor, num_heads: int, scale: Optional[float] = None,
                    backend: Optional[str] = None) -> Tensor:
    """Multi-head self-attention of each sequence of ``qkv`` (B, N, 3C), timm's qkv layout, with
    ``num_heads`` heads of d = C / num_heads; returns (B, N, C) contiguous in qkv's dtype, as
    ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` transposed back. scale: default 1/sqrt(d).

    Differentiable in qkv; the gradient comes back in qkv's layout. The kernels take N <= 256,
    d in (16, 32, 64, 128) (above 128 tokens d <= 64) and bf16, fp16 or fp32 (fp32 accumulation);
    qkv with evenly spaced rows and unit feature stride is read in place, other strides are copied.
    """
    backend = resolve_backend_without_csrc(backend, qkv, "qkv")
    check_short_attention_inputs(backend, qkv, num_heads, scale)
    if backend == "torch":
        return reference.short_attention(qkv, num_heads, scale)
    scale = 1.0 / math.sqrt(qkv.shape[-1] // (3 * num_heads)) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return short_attention_op(qkv, num_heads, scale)
    return ShortAttentionFn.apply(qkv, num_heads, scale, backend)
