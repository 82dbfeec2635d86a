"""``nn.Module`` wrappers of the fused ops, for models of one's own (as NVIDIA apex and flash-attn ship them).

Each module holds the parameters of the PyTorch module it stands in for, under the same names, so
state dicts load either way::

    FusedLayerNorm(dim)          y = LayerNorm(x)                          like nn.LayerNorm (weight, bias)
    ResidualLayerNorm(dim)       (x, h) -> (out, y): out = alpha*x + h,    like nn.LayerNorm (weight, bias)
                                 y = LayerNorm(out)
    ResidualAdd(alpha)           (x, h) -> alpha*x + h                     no parameters
    ResidualAct(act, alpha)      (x, h) -> act(alpha*x + h)                no parameters (ResNet blocks)
    FusedMLP(in, hidden, out)    fc2(GELU(fc1(x)))                         like timm's Mlp (fc1.*, fc2.*)
                                 (approximate="tanh": nn.GELU(approximate="tanh")'s GELU;
                                 "quick": QuickGELU's)

The residual modules take a branch's per-sample drop-path scales ``(row_scale, grad_scale)`` in
their forward (:class:`dres.nn.ResidualDroppath` hands them out) and keep ``alpha`` as a
non-persistent float32 buffer (``module.alpha.fill_(a)`` changes it; torch.compile does not
specialise on it). ``backend`` is that of :mod:`dres.ops` (None: its choice by device and size,
docs/ops.md); :func:`dres.nn.set_backend` reaches these modules too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dres import ops
from dres.ops.bias_gelu import check_approximate

__all__ = ["FusedLayerNorm", "ResidualLayerNorm", "ResidualAdd", "ResidualAct", "FusedMLP"]


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension on :func:`dres.ops.layer_norm` (statistics in fp32).

    Same arguments and parameters as ``nn.LayerNorm(dim)``; ``out_dtype`` in the forward picks y's
    dtype (default x's). :meth:`from_layer_norm` takes over an existing norm's parameters.
    """

    _dres_fused = True

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 backend: Optional[str] = None, device=None, dtype=None):
        if not isinstance(normalized_shape, int):
            raise TypeError(f"normalized_shape must be an int (the last dimension), got {normalized_shape!r}")
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.backend = backend

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, **kwargs) -> "FusedLayerNorm":
        """A module of this class sharing ``norm``'s parameters (the same Parameter objects) and eps, on their
        device (a residual norm's alpha with them)."""
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise TypeError(f"norm must be an nn.LayerNorm over the last dimension, got {norm!r}")
        if norm.weight is not None:
            kwargs.setdefault("device", norm.weight.device)
        new = cls(norm.normalized_shape[0], norm.eps, elementwise_affine=False, bias=False, **kwargs)
        new.weight, new.bias = norm.weight, norm.bias
        new.elementwise_affine = norm.elementwise_affine
        return new

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, eps=self.eps, out_dtype=out_dtype, backend=self.backend)


def _register_alpha(module: nn.Module, alpha: float, device=None) -> None:
    """``alpha`` as a non-persistent float32 0-dim buffer (a state dict has no alpha)."""
    module.register_buffer("alpha", torch.tensor(float(alpha), device=device), persistent=False)


class ResidualLayerNorm(FusedLayerNorm):
    """The residual add and the LayerNorm after it, in one :func:`dres.ops.residual_layer_norm`:
    ``forward(x, h) -> (out, y)``, ``out = alpha*x + row_scale[b]*h`` (the new residual stream) and
    ``y = LayerNorm(out)`` (the next sub-layer's input; for a post-LN block, the stream itself).

    Parameters as ``nn.LayerNorm(dim)``; ``alpha`` a non-persistent buffer.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 alpha: float = 1.0, backend: Optional[str] = None, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, backend, device=device, dtype=dtype)
        _register_alpha(self, alpha, device)

    def forward(self, x: torch.Tensor, h: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None,
                grad_scale: Optional[torch.Tensor] = None, residual_dtype: Optional[torch.dtype] = None,
                out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the stream, h: the branch output (B, T, D) or (M, D); row_scale / grad_scale: (B,) or None.
        h None (the first block of a stack: nothing to add yet): ``(x, LayerNorm(x))``."""
        if h is None:
            return x, super().forward(x, out_dtype)
        return ops.residual_layer_norm(x, h, self.weight, self.bias, alpha=self.alpha, eps=self.eps,
                                       row_scale=row_scale, grad_scale=grad_scale, residual_dtype=residual_dtype,
                                       out_dtype=out_dtype, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha.item():g}"


class ResidualAdd(nn.Module):
    """``forward(x, h) -> alpha*x + row_scale[b]*h`` (:func:`dres.ops.residual_add`), gradient
    ``grad_scale[b]*g`` into h: a residual add with no norm after it (the last of a stack)."""

    _dres_fused = True

    def __init__(self, alpha: float = 1.0, backend: Optional[str] = None):
        super().__init__()
        _register_alpha(self, alpha)
        self.backend = backend

    def forward(self, x: torch.Tensor, h: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                grad_scale: Optional[torch.Tensor] = None,
                residual_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return ops.residual_add(x, h, alpha=self.alpha, row_scale=row_scale, grad_scale=grad_scale,
                                residual_dtype=residual_dtype, backend=self.backend)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha.item():g}"


class ResidualAct(nn.Module):
    """``forward(x, h) -> act(alpha*x + row_scale[b]*h)`` (:func:`dres.ops.residual_act`): the end of
    a ResNet block, x the shortcut and h the branch, any batch-outermost layout. act: "relu" or
    "identity"."""

    _dres_fused = True

    def __init__(self, act: str = "relu", alpha: float = 1.0, backend: Optional[str] = None):
        if act not in ("relu", "identity"):
            raise ValueError(f"act must be 'relu' or 'identity', got {act!r}")
        super().__init__()
        _register_alpha(self, alpha)
        self.act, self.backend = act, backend

    def forward(self, x: torch.Tensor, h: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                grad_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ops.residual_act(x, h, alpha=self.alpha, row_scale=row_scale, grad_scale=grad_scale, act=self.act,
                                backend=self.backend)

    def extra_repr(self) -> str:
        return f"act={self.act!r}, alpha={self.alpha.item():g}"


class FusedMLP(nn.Module):
    """``fc2(GELU(fc1(x)))`` on :func:`dres.ops.fused_mlp`: fc1's bias add and GELU in one kernel,
    GELU recomputed in the backward (one tokens x hidden activation fewer kept).

    Arguments and parameter names as timm's ``Mlp`` (hidden and out features default to in_features);
    ``approximate`` as ``nn.GELU``'s: "none" (exact erf GELU) or "tanh" (what an MLP with
    ``nn.GELU(approximate="tanh")``, or timm's ``act_layer="gelu_tanh"``, computes), or "quick" (QuickGELU,
    timm's and HF's ``quick_gelu``). Matmuls in the
    autocast dtype when autocast is on. There is no csrc kernel: ``backend="cuda"`` runs Triton.
    """

    _dres_fused = True

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 bias: bool = True, backend: Optional[str] = None, approximate: str = "none", device=None,
                 dtype=None):
        check_approximate(approximate)
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend, self.approximate = backend, approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, backend=self.backend,
                             approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
