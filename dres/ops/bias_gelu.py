"""The fused MLP activation ``gelu(pre + bias)`` as torch custom ops, and the memory-saving MLP
``fused_mlp`` built on them.

``fused_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)`` computes the timm/MAE MLP
``fc2(gelu(fc1(x)))`` (exact GELU, nn.GELU's default) with fc1's matmul run without its bias and the
bias add + GELU fused into one kernel. Its autograd keeps only ``x`` and ``pre = x @ fc1_weight.T``
(plus the weights); the backward recomputes the activation from ``pre``::

    dact       = g @ W2
    dpre, act, db1 = bias_gelu_backward(dact, pre, b1)   # one kernel: GELU recomputed, act rewritten
    dW2 = g^T act,  db2 = sum(g),  dW1 = dpre^T x,  dx = dpre @ W1

so an MLP stores one (tokens x hidden) activation fewer than under plain autograd (which keeps both
``fc1(x)`` for GELU's backward and ``gelu(fc1(x))`` for fc2's).

Registration follows :mod:`dres.ops.residual_norm`: ``torch.library.custom_op`` + ``register_fake``
+ ``register_autograd`` (eager, ``torch.compile(fullgraph=True)``, CUDA graphs, ``opcheck``), and
outside torch.compile plain ``autograd.Function``s run the same bodies without the custom-op
dispatch cost. ``backend``: None runs the Triton kernels on CUDA tensors and the PyTorch reference
(float64-capable, below) elsewhere; "triton" forces the kernels (on CPU under TRITON_INTERPRET=1);
"torch" the reference; "cuda" (the csrc extension, which has no such kernel) runs Triton.

Importing this module registers the ops but does not import Triton: the kernels and the
residual-norm helpers they share are imported on the first Triton call, so ``import dres.ops``
stays light.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dres.ops.checks import (KERNEL_DTYPES, REFERENCE_DTYPES, _check_same_device, _check_tensor, check_dtype_arg,
                             check_vector, resolve_backend_without_csrc)
from dres.ops.reference import _compute_dtype
from dres.ops.registration import eager_autograd_function, with_inductor_fallbacks

__all__ = ["fused_bias_gelu", "fused_mlp", "bias_gelu_reference", "mlp_reference", "mlp_compute_dtype"]


# ---------------------------------------------------------------------------------------------
# Reference (what backend="torch" runs and what the tests compare against)


def bias_gelu_reference(pre: Tensor, bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``gelu(pre + bias)`` (exact GELU) in fp32, or fp64 when an input is; result in out_dtype (default pre.dtype)."""
    compute = _compute_dtype(pre, bias)
    v = pre.to(compute)
    if bias is not None:
        v = v + bias.to(compute)
    return F.gelu(v).to(out_dtype or pre.dtype)


def mlp_compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype fused_mlp's matmuls run in: the autocast dtype when autocast is on for x's device
    type, else x.dtype. (A custom Function's backward does not run under autocast, so the forward
    records this dtype and casts explicitly.)"""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def mlp_reference(x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
                  fc2_bias: Optional[Tensor]) -> Tensor:
    """``fc2(gelu(fc1(x)))`` with the fused op's dtypes, through ordinary autograd: matmuls in
    :func:`mlp_compute_dtype`, fc1 without its bias, then bias + GELU in fp32 (fp64 for fp64 inputs)
    rounded to the compute dtype. In float64 this is the exact MLP."""
    compute = mlp_compute_dtype(x)
    pre = F.linear(x.to(compute), fc1_weight.to(compute))
    act = bias_gelu_reference(pre, fc1_bias)
    return F.linear(act, fc2_weight.to(compute), None if fc2_bias is None else fc2_bias.to(compute))


# ---------------------------------------------------------------------------------------------
# Argument checks: messages name the argument, before any kernel sees it


def check_bias_gelu_inputs(backend: str, pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype]) -> None:
    dtypes = REFERENCE_DTYPES if backend == "torch" else KERNEL_DTYPES
    _check_tensor("pre", pre, dtypes)
    if pre.dim() < 1:
        raise ValueError("pre must have at least one dimension (the hidden features, last)")
    check_vector("bias", bias, pre.shape[-1], pre, dtypes, "pre's last dimension")
    check_dtype_arg("out_dtype", out_dtype, dtypes)


def check_mlp_inputs(backend: str, x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
                     fc2_bias: Optional[Tensor]) -> None:
    dtypes = REFERENCE_DTYPES if backend == "torch" else KERNEL_DTYPES
    _check_tensor("x", x, dtypes)
    if x.dim() < 2:
        raise ValueError(f"x must have shape (B, T, D) or (M, D), got {tuple(x.shape)}")
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        _check_tensor(name, w, dtypes)
        if w.dim() != 2:
            raise ValueError(f"{name} must be a 2-D (out_features, in_features) matrix, got {tuple(w.shape)}")
        _check_same_device(name, w, x)
    hidden, dim = fc1_weight.shape
    if dim != x.shape[-1]:
        raise ValueError(f"fc1_weight has shape {tuple(fc1_weight.shape)}; expected (hidden, {x.shape[-1]}) "
                         f"to match x's last dimension")
    if fc2_weight.shape[1] != hidden:
        raise ValueError(f"fc2_weight has shape {tuple(fc2_weight.shape)}; expected (out, {hidden}) to match "
                         f"fc1_weight's {hidden} hidden features")
    check_vector("fc1_bias", fc1_bias, hidden, x, dtypes, "fc1_weight's hidden features")
    check_vector("fc2_bias", fc2_bias, fc2_weight.shape[0], x, dtypes, "fc2_weight's output features")
    compute = mlp_compute_dtype(x)
    if backend != "torch" and compute not in KERNEL_DTYPES:
        raise TypeError(f"fused_mlp would compute in {compute} (autocast); the kernels support "
                        f"{', '.join(str(d).replace('torch.', '') for d in KERNEL_DTYPES)}")


# ---------------------------------------------------------------------------------------------
# Op bodies (Triton)


def bias_gelu_impl(pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype]) -> Tensor:
    from dres.kernels.bias_gelu import bias_gelu_forward
    from dres.ops.residual_norm import as_rows

    act = torch.empty(pre.shape, dtype=out_dtype or pre.dtype, device=pre.device)
    bias_gelu_forward(as_rows(pre), bias, act.view(-1, pre.shape[-1]))
    return act


def _bias_gelu_fake(pre, bias, out_dtype):
    return pre.new_empty(pre.shape, dtype=out_dtype or pre.dtype)


def bias_gelu_backward_impl(g: Tensor, pre: Tensor, bias: Optional[Tensor], act_dtype: Optional[torch.dtype],
                            need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dpre in pre's dtype, act recomputed in ``act_dtype``, dbias fp32); act (``act_dtype=None``)
    and dbias (not needed, or no bias) come back as distinct empty tensors when not asked for."""
    return _bias_gelu_backward_body(g, pre, bias, act_dtype, need_dbias)


def _bias_gelu_backward_body(g: Tensor, pre: Tensor, bias: Optional[Tensor], act_dtype: Optional[torch.dtype],
                             need_dbias: bool, dpre_into_g: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """bias_gelu_backward_impl, optionally writing dpre over ``g`` (same shape and dtype as pre,
    contiguous): each element of g is read before its dpre is stored, by the same program."""
    from dres.kernels.bias_gelu import bias_gelu_backward
    from dres.ops.residual_norm import as_rows

    dim = pre.shape[-1]
    dpre = g if dpre_into_g else torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
    act = torch.empty(pre.shape, dtype=act_dtype, device=pre.device) if act_dtype is not None else None
    dbias = bias_gelu_backward(as_rows(g), as_rows(pre), bias, dpre.view(-1, dim),
                               None if act is None else act.view(-1, dim), need_dbias and bias is not None)
    return (dpre, act if act is not None else pre.new_empty((0,)),
            dbias if dbias is not None else pre.new_empty((0,), dtype=torch.float32))


def _bias_gelu_backward_fake(g, pre, bias, act_dtype, need_dbias):
    act = pre.new_empty(pre.shape if act_dtype is not None else (0,), dtype=act_dtype or pre.dtype)
    dbias = pre.new_empty((pre.shape[-1],) if need_dbias and bias is not None else (0,), dtype=torch.float32)
    return pre.new_empty(pre.shape), act, dbias


# ---------------------------------------------------------------------------------------------
# Autograd of the standalone op (shared by the custom op and the eager Function)


def _bias_gelu_setup(ctx, inputs, output):
    pre, bias, out_dtype = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(pre, bias)
    ctx.need = (ctx.needs_input_grad[0], bias is not None and ctx.needs_input_grad[1])


def _bias_gelu_backward(backward_op, ctx, g):
    from dres.ops.residual_norm import _param_grad

    pre, bias = ctx.saved_tensors
    need_dpre, need_dbias = ctx.need
    if g is None:
        return None, None, None
    dpre, _, dbias = backward_op(g, pre, bias, None, need_dbias)
    return dpre if need_dpre else None, _param_grad(dbias, bias, need_dbias), None


# ---------------------------------------------------------------------------------------------
# The custom ops

bias_gelu_op = torch.library.custom_op("dres::bias_gelu", mutates_args=())(bias_gelu_impl)
bias_gelu_backward_op = torch.library.custom_op("dres::bias_gelu_backward", mutates_args=())(bias_gelu_backward_impl)
# The fakes register Inductor's fallback lowerings of both ops first (dres.ops.registration says why).
_QUALNAMES = ("dres::bias_gelu", "dres::bias_gelu_backward")
bias_gelu_op.register_fake(with_inductor_fallbacks(_QUALNAMES, _bias_gelu_fake))
bias_gelu_backward_op.register_fake(with_inductor_fallbacks(_QUALNAMES, _bias_gelu_backward_fake))
bias_gelu_op.register_autograd(functools.partial(_bias_gelu_backward, bias_gelu_backward_op),
                               setup_context=_bias_gelu_setup)


# ---------------------------------------------------------------------------------------------
# Which body runs: the custom ops while torch.compile traces (Inductor calls them as fallbacks),
# the plain bodies otherwise (no dispatcher cost).


def _forward(pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype]) -> Tensor:
    return (bias_gelu_op if torch.compiler.is_compiling() else bias_gelu_impl)(pre, bias, out_dtype)


def _backward(g, pre, bias, act_dtype, need_dbias, dpre_into_g=False):
    """``dpre_into_g``: in eager mode dpre overwrites g (a buffer the caller owns), so the MLP's
    backward holds one hidden-sized tensor fewer; compiled graphs keep the functional op and leave
    buffer reuse to Inductor's memory planning."""
    if torch.compiler.is_compiling():
        return bias_gelu_backward_op(g, pre, bias, act_dtype, need_dbias)
    return _bias_gelu_backward_body(g, pre, bias, act_dtype, need_dbias, dpre_into_g)


# The eager fast path of the standalone op: the same body and formulas without custom-op dispatch.
_EAGER_BIAS_GELU = eager_autograd_function("TritonBiasGelu", bias_gelu_impl, _bias_gelu_setup,
                                           functools.partial(_bias_gelu_backward, bias_gelu_backward_impl)).apply


class FusedMLP(torch.autograd.Function):
    """fc2(gelu(fc1(x))) saving x and pre (not the activation); GELU is recomputed in the backward.

    Matmuls run in ``compute_dtype`` (the caller's :func:`mlp_compute_dtype`) on tensors cast once
    here, so the result is the same inside or outside autocast and the backward, which autocast does
    not reach, uses the very tensors the forward did. Gradients come back in each input's dtype.
    """

    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype):
        x_c, w1, w2 = x.to(compute_dtype), fc1_weight.to(compute_dtype), fc2_weight.to(compute_dtype)
        pre = F.linear(x_c, w1)
        act = _forward(pre, fc1_bias, None)
        out = F.linear(act, w2, None if fc2_bias is None else fc2_bias.to(compute_dtype))
        # The cast weights are what the backward multiplies by (the originals themselves when no
        # cast was needed); plain autograd under autocast keeps the same casts.
        ctx.save_for_backward(x_c, pre, w1, fc1_bias, w2)
        ctx.dtypes = (x.dtype, fc1_weight.dtype, fc2_weight.dtype, None if fc2_bias is None else fc2_bias.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x_c, pre, w1, fc1_bias, w2 = ctx.saved_tensors
        x_dtype, w1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_b1 = need_b1 and fc1_bias is not None
        hidden, dim = w1.shape
        g = g.reshape(-1, w2.shape[0]).to(w2.dtype)  # rows; copies only when g's strides demand it
        dx = dw1 = db1 = dw2 = db2 = None
        if need_b2 and b2_dtype is not None:
            db2 = g.sum(0, dtype=torch.float32).to(b2_dtype)
        if need_x or need_w1 or need_b1 or need_w2:
            dact = g @ w2  # a fresh contiguous buffer in pre's dtype: dpre may overwrite it
            dpre, act, dbias = _backward(dact, pre.view(-1, hidden), fc1_bias, w2.dtype if need_w2 else None, need_b1,
                                         dpre_into_g=dact.dtype == pre.dtype)
            if need_w2:
                dw2 = (g.t() @ act).to(w2_dtype)
            del act  # free the recomputed activation before the two matmuls that follow
            if need_b1:
                db1 = dbias.to(fc1_bias.dtype)
            if need_w1:
                dw1 = (dpre.t() @ x_c.reshape(-1, dim)).to(w1_dtype)
            if need_x:
                dx = (dpre @ w1).view(x_c.shape).to(x_dtype)
        return dx, dw1, db1, dw2, db2, None


# ---------------------------------------------------------------------------------------------
# Public functions


def fused_bias_gelu(pre: Tensor, bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                    backend: Optional[str] = None) -> Tensor:
    """``gelu(pre + bias)`` (exact GELU) in fp32 registers; result in ``out_dtype`` (default pre.dtype).

    pre: (..., N); bias: (N,) or None. Differentiable in pre and bias (dbias summed in fp32,
    deterministically); the backward recomputes GELU from pre, so only pre and bias are kept.
    """
    backend = resolve_backend_without_csrc(backend, pre, "pre")
    check_bias_gelu_inputs(backend, pre, bias, out_dtype)
    if backend == "torch":
        return bias_gelu_reference(pre, bias, out_dtype)
    if torch.compiler.is_compiling():
        return bias_gelu_op(pre, bias, out_dtype)
    return _EAGER_BIAS_GELU(pre, bias, out_dtype)


def fused_mlp(x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
              fc2_bias: Optional[Tensor], backend: Optional[str] = None) -> Tensor:
    """The MLP ``fc2(gelu(fc1(x)))`` (nn.Linear weights: fc1 (hidden, D), fc2 (out, hidden)).

    x: (B, T, D) or (M, D). Matmuls run in the autocast dtype when autocast is on for x's device,
    else in x.dtype (the weights are cast to it); the result has that dtype. Gradients come back
    in the dtypes of x and of the parameters. Saves x and fc1's pre-activation only, one
    (tokens x hidden) tensor fewer than plain autograd.
    """
    backend = resolve_backend_without_csrc(backend, x)
    check_mlp_inputs(backend, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    if backend == "torch":
        return mlp_reference(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    return FusedMLP.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, mlp_compute_dtype(x))
