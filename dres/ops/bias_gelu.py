"""The fused MLP activation ``gelu(pre + bias)`` as torch custom ops, and the memory-saving MLP
``fused_mlp`` built on them.

``fused_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)`` computes the timm/MAE MLP
``fc2(gelu(fc1(x)))`` with fc1's matmul run without its bias and the bias add + GELU fused into one
kernel; ``approximate`` picks the GELU as ``F.gelu`` names it, "none" (exact erf GELU, nn.GELU's
default) or "tanh" (``nn.GELU(approximate="tanh")``, timm's ``gelu_tanh``), or "quick", the sigmoid
approximation ``v * sigmoid(1.702 v)`` (CLIP's QuickGELU: timm's and HF's ``quick_gelu``). Its autograd keeps only
``x`` and ``pre = x @ fc1_weight.T`` (plus the weights); the backward recomputes the activation from
``pre``::

    dact       = g @ W2
    dpre, act, db1 = bias_gelu_backward(dact, pre, b1)   # one kernel: GELU recomputed, act rewritten
    dW2 = g^T act,  db2 = sum(g),  dW1 = dpre^T x,  dx = dpre @ W1

so an MLP stores one (tokens x hidden) activation fewer than under plain autograd (which keeps both
``fc1(x)`` for GELU's backward and ``gelu(fc1(x))`` for fc2's).

As in :mod:`dres.ops.residual_norm`: one explicit ``autograd.Function`` per op whose launches take
the backend. ``BiasGeluFn`` is also the autograd of the custom ops ``dres::bias_gelu`` and
``dres::bias_gelu_backward`` (``define_op(..., autograd=BiasGeluFn)``), which ``torch.compile`` and
``opcheck`` see; eager calls skip the custom-op dispatch cost. ``FusedMlpFn`` has no custom op of its
own: it is two matmuls around ``dres::bias_gelu``, and torch.compile traces the Function itself, so the
matmuls stay aten ops Inductor sees and the bias + GELU stays the custom op (docs/design.md, "The ops",
says why). ``backend``: None runs the Triton kernels on CUDA tensors (the csrc extension's, where
built, for eager calls of ``fused_mlp`` up to the size of :func:`dres.ops.checks.choose_default_backend`)
and the PyTorch reference (:func:`dres.ops.reference.bias_gelu`, :func:`dres.ops.reference.mlp`,
float64-capable) elsewhere, but for a launch-bound ``fused_mlp`` (:func:`dres.ops.checks.takes_pytorch_formula`),
which runs the MLP as a plain model does (:func:`plain_mlp`); "triton" forces the kernels (on CPU under
TRITON_INTERPRET=1); "torch" the reference; "cuda": ``fused_mlp`` in eager calls
``torch.ops.dres_cuda.fused_mlp``, the csrc extension's MLP with its autograd in C++ (``csrc/ops.cpp``'s
``FusedMlpFunction``: these formulas, no Python per call); under torch.compile, and for ``fused_bias_gelu``, it
runs Triton.

Importing this module registers the ops but does not import Triton (the kernels are imported on
the first Triton call), so ``import dres.ops`` works where Triton is not installed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dres.ops import csrc_backend, reference
from dres.ops.checks import (KERNEL_DTYPES, check_dtype_arg, check_same_device, check_tensor, check_vector,
                             resolve_backend, resolve_backend_without_csrc, supported_dtypes, takes_pytorch_formula)
from dres.ops.registration import define_op
from dres.ops.utils import mlp_compute_dtype, param_grad

__all__ = ["fused_bias_gelu", "fused_mlp", "BiasGeluFn", "FusedMlpFn"]

F_GELU_APPROXIMATIONS = ("none", "tanh")  # F.gelu's (and nn.GELU's) names
GELU_APPROXIMATIONS = F_GELU_APPROXIMATIONS + ("quick",)  # the ops': and QuickGELU, v * sigmoid(1.702 v)


# ---------------------------------------------------------------------------------------------
# Argument checks: messages name the argument, before any kernel sees it


def check_approximate(approximate: str, name: str = "approximate", allowed: tuple = GELU_APPROXIMATIONS) -> None:
    """``approximate`` one of ``allowed``: the ops' GELUs, or (a module that also runs ``nn.GELU``) F.gelu's."""
    if approximate not in allowed:
        quick = ", or 'quick' (QuickGELU, v * sigmoid(1.702 v))" if "quick" in allowed else ""
        raise ValueError(f"{name} must be 'none' (exact erf GELU) or 'tanh', as F.gelu names them{quick}; "
                         f"got {approximate!r}")


def check_bias_gelu_inputs(backend: str, pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype],
                           approximate: str) -> None:
    check_approximate(approximate)
    dtypes = supported_dtypes(backend)
    check_tensor("pre", pre, dtypes)
    if pre.dim() < 1:
        raise ValueError("pre must have at least one dimension (the hidden features, last)")
    check_vector("bias", bias, pre.shape[-1], pre, dtypes, "pre's last dimension")
    check_dtype_arg("out_dtype", out_dtype, dtypes)


def check_mlp_inputs(backend: str, x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
                     fc2_bias: Optional[Tensor], approximate: str) -> None:
    check_approximate(approximate)
    dtypes = supported_dtypes(backend)
    check_tensor("x", x, dtypes)
    if x.dim() < 2:
        raise ValueError(f"x must have shape (B, T, D) or (M, D), got {tuple(x.shape)}")
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        check_tensor(name, w, dtypes)
        if w.dim() != 2:
            raise ValueError(f"{name} must be a 2-D (out_features, in_features) matrix, got {tuple(w.shape)}")
        check_same_device(name, w, x)
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
# Reference: dres.ops.reference.bias_gelu, .mlp (backend="torch" runs them; the tests compare the
# kernels against them)


# ---------------------------------------------------------------------------------------------
# Triton launches (also the bodies of the dres:: custom ops)


def bias_gelu_triton(pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype], approximate: str) -> Tensor:
    from dres.kernels.bias_gelu import bias_gelu_forward

    act = torch.empty(pre.shape, dtype=out_dtype or pre.dtype, device=pre.device)
    bias_gelu_forward(pre, bias, act, approximate)
    return act


def bias_gelu_backward_triton(g: Tensor, pre: Tensor, bias: Optional[Tensor], act_dtype: Optional[torch.dtype],
                              need_dbias: bool, approximate: str,
                              dpre: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dpre in pre's dtype, act recomputed in ``act_dtype``, dbias fp32); act (``act_dtype=None``)
    and dbias (not needed, or no bias) come back as distinct empty tensors when not asked for.

    ``dpre``: where to write dpre (fresh when None). The MLP's eager backward passes ``g`` itself
    (contiguous, pre's shape and dtype): each element of g is read before its dpre is stored, by
    the same program. The custom op's schema leaves ``dpre`` out, so the op never mutates g.
    """
    from dres.kernels.bias_gelu import bias_gelu_backward

    dpre = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device) if dpre is None else dpre
    act = torch.empty(pre.shape, dtype=act_dtype, device=pre.device) if act_dtype is not None else None
    dbias = bias_gelu_backward(g, pre, bias, dpre, act, need_dbias and bias is not None, approximate)
    return (dpre, act if act is not None else pre.new_empty((0,)),
            dbias if dbias is not None else pre.new_empty((0,), dtype=torch.float32))


# By backend: "triton" runs the kernels directly (eager), "dres" the custom ops (FusedMlpFn under
# torch.compile, and the backward of the custom op's own autograd).


def run_bias_gelu(backend: str, pre: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype],
                  approximate: str) -> Tensor:
    if backend == "triton":
        return bias_gelu_triton(pre, bias, out_dtype, approximate)
    return getattr(torch.ops, backend).bias_gelu(pre, bias, out_dtype, approximate)


def run_bias_gelu_backward(backend: str, g: Tensor, pre: Tensor, bias: Optional[Tensor],
                           act_dtype: Optional[torch.dtype], need_dbias: bool, approximate: str,
                           dpre: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``dpre``: see :func:`bias_gelu_backward_triton`; the custom op allocates its own (compiled
    graphs leave buffer reuse to Inductor's memory planning)."""
    if backend == "triton":
        return bias_gelu_backward_triton(g, pre, bias, act_dtype, need_dbias, approximate, dpre)
    return getattr(torch.ops, backend).bias_gelu_backward(g, pre, bias, act_dtype, need_dbias, approximate)


# ---------------------------------------------------------------------------------------------
# The autograd Functions


class BiasGeluFn(torch.autograd.Function):
    """act = gelu(pre + bias); dpre = g * gelu'(pre + bias) with GELU recomputed from pre, dbias = sum(dpre)."""

    @staticmethod
    def forward(ctx, pre, bias, out_dtype, approximate, backend):
        inputs = (pre, bias, out_dtype, approximate)
        act = run_bias_gelu(backend, *inputs)
        BiasGeluFn.save(ctx, backend, inputs, act)
        return act

    @staticmethod
    def save(ctx, backend, inputs, output):
        pre, bias, out_dtype, approximate = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(pre, bias)
        ctx.backend, ctx.approximate = backend, approximate
        ctx.need = (ctx.needs_input_grad[0], bias is not None and ctx.needs_input_grad[1])

    @staticmethod
    def backward(ctx, g):
        pre, bias = ctx.saved_tensors
        need_dpre, need_dbias = ctx.need
        if g is None:
            return None, None, None, None, None
        dpre, _, dbias = run_bias_gelu_backward(ctx.backend, g, pre, bias, None, need_dbias, ctx.approximate)
        return dpre if need_dpre else None, param_grad(dbias, bias, need_dbias), None, None, None


class FusedMlpFn(torch.autograd.Function):
    """fc2(gelu(fc1(x))) saving x and pre (not the activation); GELU is recomputed in the backward.

    Matmuls run in ``compute_dtype`` (the caller's :func:`mlp_compute_dtype`) on tensors cast once
    here, so the result is the same inside or outside autocast and the backward, which autocast does
    not reach, uses the very tensors the forward did. Gradients come back in each input's dtype.
    ``backend``: "triton" (eager) or "dres" (the custom ops, under torch.compile).
    """

    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype, approximate, backend):
        x_c, w1, w2 = x.to(compute_dtype), fc1_weight.to(compute_dtype), fc2_weight.to(compute_dtype)
        pre = F.linear(x_c, w1)
        act = run_bias_gelu(backend, pre, fc1_bias, None, approximate)
        out = F.linear(act, w2, None if fc2_bias is None else fc2_bias.to(compute_dtype))
        # The cast weights are what the backward multiplies by (the originals themselves when no
        # cast was needed); plain autograd under autocast keeps the same casts.
        ctx.save_for_backward(x_c, pre, w1, fc1_bias, w2)
        ctx.dtypes = (x.dtype, fc1_weight.dtype, fc2_weight.dtype, None if fc2_bias is None else fc2_bias.dtype)
        ctx.backend, ctx.approximate = backend, approximate
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
            dact = g @ w2  # a fresh contiguous buffer in pre's dtype: in eager mode dpre overwrites it
            in_place = ctx.backend == "triton" and dact.dtype == pre.dtype
            dpre, act, dbias = run_bias_gelu_backward(ctx.backend, dact, pre.view(-1, hidden), fc1_bias,
                                                      w2.dtype if need_w2 else None, need_b1, ctx.approximate,
                                                      dact if in_place else None)
            if need_w2:
                dw2 = (g.t() @ act).to(w2_dtype)
            del act  # free the recomputed activation before the two matmuls that follow
            if need_b1:
                db1 = dbias.to(fc1_bias.dtype)
            if need_w1:
                dw1 = (dpre.t() @ x_c.reshape(-1, dim)).to(w1_dtype)
            if need_x:
                dx = (dpre @ w1).view(x_c.shape).to(x_dtype)
        return dx, dw1, db1, dw2, db2, None, None, None


# ---------------------------------------------------------------------------------------------
# The custom ops (what torch.compile, opcheck and the dispatcher see)


def _bias_gelu_fake(pre, bias, out_dtype, approximate):
    return pre.new_empty(pre.shape, dtype=out_dtype or pre.dtype)


def _bias_gelu_backward_fake(g, pre, bias, act_dtype, need_dbias, approximate):
    act = pre.new_empty(pre.shape if act_dtype is not None else (0,), dtype=act_dtype or pre.dtype)
    dbias = pre.new_empty((pre.shape[-1],) if need_dbias and bias is not None else (0,), dtype=torch.float32)
    return pre.new_empty(pre.shape), act, dbias


def _fused_mlp_fake(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute_dtype, approximate):
    return x.new_empty((*x.shape[:-1], fc2_weight.shape[0]), dtype=compute_dtype)


_QUALNAMES = ("dres::bias_gelu", "dres::bias_gelu_backward")
bias_gelu_op = define_op("dres::bias_gelu", bias_gelu_triton, _bias_gelu_fake, _QUALNAMES, autograd=BiasGeluFn)
bias_gelu_backward_op = define_op(
    "dres::bias_gelu_backward", bias_gelu_backward_triton, _bias_gelu_backward_fake, _QUALNAMES,
    schema="(Tensor g, Tensor pre, Tensor? bias, ScalarType? act_dtype, bool need_dbias, str approximate) "
           "-> (Tensor, Tensor, Tensor)")
# The csrc MLP (defined in C++ with these schemas, fused_mlp with its autograd) takes the same fakes.
if csrc_backend.available():
    csrc_backend.register_fakes({"bias_gelu": _bias_gelu_fake, "bias_gelu_backward": _bias_gelu_backward_fake,
                                 "fused_mlp": _fused_mlp_fake})


# ---------------------------------------------------------------------------------------------
# Public functions


def fused_bias_gelu(pre: Tensor, bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                    backend: Optional[str] = None, approximate: str = "none") -> Tensor:
    """``F.gelu(pre + bias, approximate=approximate)`` in fp32 registers; result in ``out_dtype``
    (default pre.dtype).

    pre: (..., N); bias: (N,) or None; approximate: "none" (exact erf GELU), "tanh" or "quick"
    (QuickGELU, ``v * sigmoid(1.702 v)``, which F.gelu does not have). Differentiable
    in pre and bias (dbias summed in fp32, deterministically); the backward recomputes GELU from pre,
    so only pre and bias are kept.
    """
    backend = resolve_backend_without_csrc(backend, pre, "pre")
    check_bias_gelu_inputs(backend, pre, bias, out_dtype, approximate)
    if backend == "torch":
        return reference.bias_gelu(pre, bias, out_dtype, approximate)
    if torch.compiler.is_compiling():
        return bias_gelu_op(pre, bias, out_dtype, approximate)
    return BiasGeluFn.apply(pre, bias, out_dtype, approximate, backend)


def fused_mlp(x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
              fc2_bias: Optional[Tensor], backend: Optional[str] = None, approximate: str = "none") -> Tensor:
    """The MLP ``fc2(gelu(fc1(x)))`` (nn.Linear weights: fc1 (hidden, D), fc2 (out, hidden)), GELU as
    ``F.gelu(..., approximate=approximate)``: "none" (exact erf GELU) or "tanh", or "quick" (QuickGELU).

    x: (B, T, D) or (M, D). Matmuls run in the autocast dtype when autocast is on for x's device,
    else in x.dtype (the weights are cast to it); the result has that dtype. Gradients come back
    in the dtypes of x and of the parameters. Saves x and fc1's pre-activation only, one
    (tokens x hidden) tensor fewer than plain autograd. Where ``backend=None`` finds ``x`` launch-bound
    (:func:`dres.ops.checks.takes_pytorch_formula`), the MLP as a plain model runs it (:func:`plain_mlp`).
    """
    plain = takes_pytorch_formula(backend, x)
    backend = "torch" if plain else resolve_backend(backend, x, "x")
    check_mlp_inputs(backend, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate)
    if plain:
        return plain_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate)
    if backend == "torch":
        return reference.mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate)
    compute, compiling = mlp_compute_dtype(x), torch.compiler.is_compiling()
    if backend == "cuda" and not compiling:
        return torch.ops.dres_cuda.fused_mlp.default(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute,
                                                     approximate)
    # compiled: the Function traced, its bias + GELU the dres:: custom ops
    return FusedMlpFn.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, compute, approximate,
                            "dres" if compiling else "triton")


def plain_mlp(x: Tensor, fc1_weight: Tensor, fc1_bias: Optional[Tensor], fc2_weight: Tensor,
              fc2_bias: Optional[Tensor], approximate: str = "none") -> Tensor:
    """``fc2(gelu(fc1(x)))`` as a plain PyTorch model computes it, in :func:`dres.ops.utils.mlp_compute_dtype`:
    fc1's bias inside its matmul, the GELU on its rounded output. Unlike :func:`dres.ops.reference.mlp` (the
    kernels' contract: bias and GELU in float32) it neither keeps nor passes a float32 (tokens x hidden) tensor."""
    compute = mlp_compute_dtype(x)
    w1, b1, w2, b2 = (None if t is None else t.to(compute) for t in (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    pre = F.linear(x.to(compute), w1, b1)
    return F.linear(reference.gelu(pre, approximate), w2, b2)
