"""Pre-LN transformer blocks that carry the residual stream through the fused ops.

A plain pre-LN block computes ``x = a1*x + attn(norm1(x)); x = a2*x + mlp(norm2(x))``. Here each
residual add is fused with the norm that follows it (DESIGN.md, "Carrying the residual stream across
blocks"): the stack keeps ``(residual, y)`` pairs, where ``y`` is the normalised input of the next
sub-layer, and one :func:`dres.ops.residual_layer_norm` produces both. The stack's first norm is a
:func:`dres.ops.layer_norm`; its last add is fused with the final norm, or is a
:func:`dres.ops.residual_add` when there is none. A :class:`Block` runs from its norm1 to its MLP:
it receives the previous block's MLP output still to be added (fused with its own norm1) and
returns its own, so each block call uses only that block's parameters (one FSDP2 unit per block).

Mixed precision: under ``torch.autocast`` the residual stream stays float32 and the branches run in
the autocast dtype (the normalised ``y`` has the branch's dtype), the common fast case.

Hooks let a model change the stream between blocks without breaking the fusion: ``hooks[k](stream,
outputs)`` returns ``(h, a)`` and the stream entering block k becomes ``a*stream + h`` (fused with
block k's first norm). The official MAE's SkipLayer adds a branch (``a = 1``); U-ViT's skip Linear
replaces the stream (``a = 0``: ``out = h`` exactly, and no gradient into the old stream but through h).
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dres import ops

ATTN_IMPLS = ("sdpa", "flash", "xformers")

Hook = Callable[[torch.Tensor, dict], tuple[torch.Tensor, float]]


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for x's device type when autocast is on there, else None."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class Attention(nn.Module):
    """Multi-head self-attention; SDPA by default, flash-attn or xformers when asked for."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_impl: str = "sdpa"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        if attn_impl == "flash" and importlib.util.find_spec("flash_attn") is None:
            raise ImportError("attn_impl='flash' needs the flash-attn package, which is not installed")
        if attn_impl == "xformers" and importlib.util.find_spec("xformers") is None:
            raise ImportError("attn_impl='xformers' needs the xformers package, which is not installed")
        self.num_heads = num_heads
        self.attn_impl = attn_impl
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        if self.attn_impl == "flash":
            from flash_attn import flash_attn_qkvpacked_func

            out = flash_attn_qkvpacked_func(qkv)  # (B, N, H, hd); fp16/bf16 CUDA tensors only
        elif self.attn_impl == "xformers":
            import xformers.ops

            q, k, v = qkv.unbind(2)
            out = xformers.ops.memory_efficient_attention(q, k, v)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, hd)
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return self.proj(out.reshape(B, N, C))


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))``, plain or through :func:`dres.ops.fused_mlp` (``fused``).

    The fused path adds fc1's bias inside the GELU kernel and recomputes GELU in the backward, so it
    keeps one (tokens x hidden) activation fewer for the backward. ``fused=None`` (auto) uses it
    outside torch.compile and leaves compiled graphs to Inductor, which fuses bias+GELU itself
    (BENCHMARKS.md, "Fusion in the branches"). ``backend`` follows the stack's (set by
    :func:`set_backend`); the fused MLP has no csrc kernel, so ``"cuda"`` runs it on Triton.
    """

    def __init__(self, dim: int, hidden_dim: int, fused: Optional[bool] = None, backend: Optional[str] = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.fused, self.backend = fused, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = (not torch.compiler.is_compiling()) if self.fused is None else self.fused
        if fused:
            return ops.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                                 backend=self.backend)
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """One pre-LN block (timm / MAE parameter names) on the carried residual stream.

    The block's own MLP add is left pending: the next block fuses it with its norm1 (or the stack
    with its final norm). So ``forward`` starts by adding the previous block's pending branch, fused
    with this block's norm1, and every parameter a block call touches is its own: the block is the
    unit FSDP2 shards and torch.compile compiles (:func:`dres.train.distributed.parallel_units`).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 attn_impl: str = "sdpa", eps: float = 1e-6, backend: Optional[str] = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_impl=attn_impl)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), backend=backend)
        self.backend = backend

    def forward(self, stream: torch.Tensor, pending: Optional[torch.Tensor], pending_alpha, pending_scale,
                attn_alpha: torch.Tensor, attn_scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``stream`` (B, T, D) is the residual stream before the pending add; ``pending`` the branch
        output still to be added (None for none: the stack's first block), as ``pending_alpha *
        stream + pending``; ``*_scale`` are ``(row_scale, grad_scale)`` pairs of the two residuals.
        Returns ``(entering, residual, h)``: the stream entering this block (after the pending add),
        the stream after this block's attention add, and its MLP output, pending in turn."""
        be = self.backend
        branch_dtype = autocast_dtype(stream)
        residual_dtype = torch.float32 if branch_dtype is not None else None
        n1, n2 = self.norm1, self.norm2
        if pending is None:
            entering = stream
            y = ops.layer_norm(stream, n1.weight, n1.bias, eps=n1.eps, out_dtype=branch_dtype, backend=be)
        else:
            entering, y = ops.residual_layer_norm(stream, pending, n1.weight, n1.bias, alpha=pending_alpha, eps=n1.eps,
                                                  row_scale=pending_scale[0], grad_scale=pending_scale[1],
                                                  residual_dtype=residual_dtype, backend=be)
        residual, y = ops.residual_layer_norm(entering, self.attn(y), n2.weight, n2.bias, alpha=attn_alpha, eps=n2.eps,
                                              row_scale=attn_scale[0], grad_scale=attn_scale[1],
                                              residual_dtype=residual_dtype, backend=be)
        return entering, residual, self.mlp(y)


def init_vit_weights(module: nn.Module) -> None:
    """MAE / JAX ViT init: xavier_uniform Linear weights, zero biases, unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class TransformerStack(nn.Module):
    """``depth`` pre-LN blocks with per-residual alphas, fused adds and an optional final norm.

    alphas: ``2*depth`` floats (attention, MLP, attention, ...), default all ones; kept as the
        non-persistent float32 buffer ``alphas``, read by the kernels as 0-dim tensors so that
        torch.compile does not specialise on their values.
    final_norm: a final LayerNorm (``self.norm``) fused with the last add; else the stack returns the
        raw stream.
    backend: passed to every :mod:`dres.ops` call (None: Triton on CUDA, reference on CPU).
    """

    def __init__(self, dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 alphas: Optional[Sequence[float]] = None, final_norm: bool = True, attn_impl: str = "sdpa",
                 eps: float = 1e-6, backend: Optional[str] = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_ratio, qkv_bias, attn_impl, eps, backend)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=eps) if final_norm else None
        alphas = [1.0] * (2 * depth) if alphas is None else [float(a) for a in alphas]
        if len(alphas) != 2 * depth:
            raise ValueError(f"alphas has {len(alphas)} values; a stack of depth {depth} has {2 * depth} residuals")
        self.register_buffer("alphas", torch.tensor(alphas, dtype=torch.float32), persistent=False)
        self.backend = backend

    @property
    def num_residuals(self) -> int:
        return 2 * len(self.blocks)

    def set_alphas(self, alphas: Sequence[float]) -> None:
        if len(alphas) != self.num_residuals:
            raise ValueError(f"alphas has {len(alphas)} values; this stack has {self.num_residuals} residuals")
        self.alphas.copy_(torch.tensor([float(a) for a in alphas], dtype=torch.float32))

    def zero_init_branch_ends(self) -> None:
        """Zero the last Linear of every branch (attention proj, MLP fc2): needed for alpha_min <= 0.7."""
        for blk in self.blocks:
            for linear in (blk.attn.proj, blk.mlp.fc2):
                nn.init.zeros_(linear.weight)
                nn.init.zeros_(linear.bias)

    def _alpha(self, i: int) -> torch.Tensor:
        return self.alphas[i]  # a 0-dim view: the kernels read it, so its value is never baked in

    def forward(self, x: torch.Tensor, scales: Optional[Sequence] = None, hooks: Optional[dict[int, Hook]] = None,
                collect: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the stack on tokens ``x`` (B, T, D).

        scales: per residual ``(row_scale, grad_scale)`` (from a ResidualDroppath controller) or None.
        hooks: ``{block: fn(stream, outputs) -> (h, a)}``, the stream entering ``block`` becomes ``a*stream + h``.
        collect: block indices whose output stream (after the block's MLP add) to return.
        Returns ``(y, outputs)``: y the final-normed output (the raw stream when there is no final
        norm) and ``outputs[k]`` the residual stream after block k for k in collect.
        """
        hooks = hooks or {}
        branch_dtype = autocast_dtype(x)
        residual_dtype = torch.float32 if branch_dtype is not None else None
        if branch_dtype is not None:
            x = x.float()  # the stream stays fp32 under autocast; the branches run in branch_dtype
        be = self.backend
        n = len(self.blocks)
        outputs: dict[int, torch.Tensor] = {}
        no_scale = (None, None)

        def scale(r: int):
            return no_scale if scales is None else scales[r]

        def complete(stream, pending, r):
            """``stream`` with the pending branch of residual r added (an unfused add)."""
            return ops.residual_add(stream, pending, alpha=self._alpha(r), row_scale=scale(r)[0],
                                    grad_scale=scale(r)[1], residual_dtype=residual_dtype, backend=be)

        stream, pending, pending_alpha, pending_scale = x, None, None, no_scale
        for k, blk in enumerate(self.blocks):
            if k in hooks:  # the hook sees the stream after block k-1, so that add cannot wait
                if pending is not None:
                    stream = complete(stream, pending, 2 * k - 1)
                    if k - 1 in collect:
                        outputs[k - 1] = stream
                pending, pending_alpha = hooks[k](stream, outputs)
                pending_scale = no_scale
            entering, stream, pending = blk(stream, pending, pending_alpha, pending_scale, self._alpha(2 * k),
                                            scale(2 * k))
            if k > 0 and k not in hooks and k - 1 in collect:
                outputs[k - 1] = entering
            pending_alpha, pending_scale = self._alpha(2 * k + 1), scale(2 * k + 1)
        last = 2 * n - 1
        if self.norm is not None:
            stream, y = ops.residual_layer_norm(stream, pending, self.norm.weight, self.norm.bias, alpha=self._alpha(last),
                                                eps=self.norm.eps, row_scale=scale(last)[0], grad_scale=scale(last)[1],
                                                residual_dtype=residual_dtype, backend=be)
        else:
            stream = y = complete(stream, pending, last)
        if n - 1 in collect:
            outputs[n - 1] = stream
        return y, outputs


def set_backend(module: nn.Module, backend: Optional[str]) -> nn.Module:
    """Point every fused stack inside ``module`` at ``backend`` (None, "torch", "triton", "cuda")."""
    for m in module.modules():
        if hasattr(m, "backend") and (isinstance(m, (TransformerStack, Block, Mlp)) or getattr(m, "_dres_fused", False)):
            m.backend = backend
    return module


def set_fused_mlp(module: nn.Module, fused: Optional[bool]) -> nn.Module:
    """Choose the MLP path of every :class:`Mlp` in ``module``: True (fused), False (plain), None (auto)."""
    for m in module.modules():
        if isinstance(m, Mlp):
            m.fused = fused
    return module
