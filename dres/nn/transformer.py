"""Pre-LN transformer blocks that carry the residual stream through the fused ops.

A plain pre-LN block computes ``x = a1*x + attn(norm1(x)); x = a2*x + mlp(norm2(x))``. Here each
residual add is fused with the norm that follows it (docs/design.md, "The residual
stream"): one :func:`dres.ops.residual_layer_norm` produces the new stream and the normalised input
of the next sub-layer. Blocks take flash-attn's fused-residual form (``modules/block.py``),
``hidden_states, residual, entering = block(hidden_states, residual)``: a block receives the previous
block's MLP output still to be added, adds it fused with its own norm1 (``entering``, the stream
after the block before) and returns its own MLP output, pending in turn, so each block call uses only
that block's parameters (one FSDP2 unit per block).
The first block's norm1 is a plain :func:`dres.ops.layer_norm`; the last add is fused with the final
norm, or is a :func:`dres.ops.residual_add` when there is none.

Mixed precision: under ``torch.autocast`` the stream starts float32, each add keeps the stream's dtype
and the branches run in the autocast dtype (the normalised ``y`` has the branch's dtype).

Hooks let a model change the stream between blocks without breaking the fusion: ``hooks[k](stream,
outputs)`` returns ``(h, a)`` and the stream entering block k becomes ``a*stream + h`` (fused with
block k's first norm). The official MAE's SkipLayer adds a branch (``a = 1``); U-ViT's skip Linear
replaces the stream (``a = 0``: h becomes the stream, in h's dtype, and no gradient reaches the old stream
but through h).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dres import ops
from dres.ops.bias_gelu import F_GELU_APPROXIMATIONS, check_approximate
from dres.ops.checks import takes_pytorch_formula
from dres.nn.droppath import NO_SCALES, Scales

Hook = Callable[[torch.Tensor, dict], tuple[torch.Tensor, float]]
BlockScales = tuple[Scales, Scales]  # drop-path scales of the residual entering a block and of its attention add


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for x's device type when autocast is on there, else None."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class Attention(nn.Module):
    """Multi-head self-attention: sequences of up to 128 tokens (256 with heads up to 32 wide) through
    :func:`dres.ops.short_attention` (which reads q, k, v from the qkv Linear's output in place), others
    through :func:`sdpa`, which picks the SDPA backend per shape. ``backend`` follows the stack's (set by
    :func:`set_backend`): None takes the kernel for bf16/fp16 CUDA tensors; "triton" for every dtype and
    device (on the CPU under ``TRITON_INTERPRET=1``); "torch" keeps every shape on SDPA; short attention has
    no csrc kernel, so "cuda" runs it as None does."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, backend: Optional[str] = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.backend = num_heads, backend
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x)
        if takes_short_attention(qkv, N, C // self.num_heads, self.backend):
            return self.proj(ops.short_attention(qkv, self.num_heads, backend="triton"))
        return self.proj(sdpa_from_qkv(qkv, self.num_heads))


# dres.ops.short_attention packs several sequences of a head into one tile, where SDPA's kernels pad one
# sequence per tile; up to 256 tokens it runs one sequence a program, which beats SDPA with 32-wide heads only
# (the limits where it measured faster: BENCHMARKS.md, "Attention backends"). The head dims are the kernel's
# (dres.kernels.short_attention.HEAD_DIMS), written out so that building a model imports no Triton.
SHORT_ATTENTION_MAX_TOKENS, SHORT_ATTENTION_HEAD_DIMS = 128, (16, 32, 64, 128)
NARROW_HEADS_MAX_TOKENS, NARROW_HEAD_DIM = 256, 32


def takes_short_attention(qkv: torch.Tensor, tokens: int, head_dim: int, backend: Optional[str]) -> bool:
    max_tokens = NARROW_HEADS_MAX_TOKENS if head_dim <= NARROW_HEAD_DIM else SHORT_ATTENTION_MAX_TOKENS
    if backend == "torch" or tokens > max_tokens or head_dim not in SHORT_ATTENTION_HEAD_DIMS:
        return False
    # where a launch-bound model's norms and MLPs take their PyTorch formulas (under torch.compile, and in eager mode
    # without the csrc extension, outside a captured step) its attention is SDPA (qkv: the stream's width three times)
    if takes_pytorch_formula(backend, qkv, parts=3):
        return False
    return backend == "triton" or (qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16))


# SDPA's memory-efficient kernel beats torch's own choice (cuDNN on Hopper) on short sequences of 64-wide heads
# only (BENCHMARKS.md, "Attention backends").
EFFICIENT_MAX_TOKENS, EFFICIENT_HEAD_DIM = 128, 64


def heads_of_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of a qkv Linear's output (B, N, 3C), each permuted to (B, H, N, d) as SDPA takes them."""
    return qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)


def sdpa_from_qkv(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The qkv Linear's output (B, N, 3C) -> (B, N, C) through :func:`sdpa`: q, k and v permuted out of it to
    (B, H, N, d), the result transposed back (the copies SDPA costs a model beside its kernel)."""
    return sdpa(*heads_of_qkv(qkv, num_heads)).transpose(1, 2).flatten(2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` (B, H, N, hd), on the backend measured fastest for
    the shape: the memory-efficient kernel for short sequences of 64-wide heads on CUDA, else torch's choice."""
    N, hd = q.shape[-2:]
    if q.is_cuda and N <= EFFICIENT_MAX_TOKENS and hd == EFFICIENT_HEAD_DIM and q.dtype != torch.float64:
        need_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, need_lse)[0]
    return F.scaled_dot_product_attention(q, k, v)


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))``, plain or through :func:`dres.ops.fused_mlp` (``fused``); ``approximate``
    as ``nn.GELU``'s, "none" (exact erf GELU) or "tanh". Both paths compute the GELU that ``act`` (an
    ``nn.GELU``) names, also after ``act`` is replaced.

    The fused path adds fc1's bias inside the GELU kernel and recomputes GELU in the backward, so it
    keeps one (tokens x hidden) activation fewer for the backward. ``fused=None`` (auto) uses it
    outside torch.compile and leaves compiled graphs to Inductor, which fuses bias+GELU itself
    (record ``h200-2026-11-26-branch-ops``). ``backend`` follows the stack's (set by
    :func:`set_backend`); the fused MLP has no csrc kernel, so ``"cuda"`` runs it on Triton.
    """

    def __init__(self, dim: int, hidden_dim: int, fused: Optional[bool] = None, backend: Optional[str] = None,
                 approximate: str = "none"):
        check_approximate(approximate, allowed=F_GELU_APPROXIMATIONS)  # its unfused path is nn.GELU's
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.fused, self.backend = fused, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = (not torch.compiler.is_compiling()) if self.fused is None else self.fused
        if fused:
            return ops.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                                 backend=self.backend, approximate=self.act.approximate)
        return self.fc2(self.act(self.fc1(x)))


def add_and_norm(hidden_states: torch.Tensor, residual: Optional[torch.Tensor], norm: Optional[nn.LayerNorm],
                 alpha, scales: Scales = NO_SCALES, backend: Optional[str] = None):
    """``residual = alpha * residual + scales * hidden_states`` fused with ``y = norm(residual)``; returns
    ``(residual, y)``. With ``residual`` None, ``hidden_states`` is the stream itself (the first block:
    a plain LayerNorm); with ``norm`` None the add alone (``y`` is the new residual). The residual keeps
    its dtype (float32 under autocast, as :meth:`ResidualStream.run_stream` starts it); a plain LayerNorm's
    ``y`` takes the autocast dtype, a fused one's the branch's."""
    if residual is None:
        return hidden_states, ops.layer_norm(hidden_states, norm.weight, norm.bias, eps=norm.eps,
                                             out_dtype=autocast_dtype(hidden_states), backend=backend)
    row_scale, grad_scale = scales
    if norm is None:
        out = ops.residual_add(residual, hidden_states, alpha=alpha, row_scale=row_scale, grad_scale=grad_scale,
                               backend=backend)
        return out, out
    return ops.residual_layer_norm(residual, hidden_states, norm.weight, norm.bias, alpha=alpha, eps=norm.eps,
                                   row_scale=row_scale, grad_scale=grad_scale, backend=backend)


class Block(nn.Module):
    """One pre-LN block (timm / MAE parameter names) on the carried residual stream, in flash-attn's
    fused-residual form: ``forward(hidden_states, residual) -> (hidden_states, residual, entering)``.

    ``hidden_states`` is the previous block's MLP output, still to be added to ``residual``: the block
    adds it fused with its norm1 (the residual entering the block, whose alpha ``alphas[0]`` it
    owns), runs attention, adds that fused with norm2 (``alphas[1]``) and returns its own MLP output,
    pending in turn. So every parameter a block call touches is its own: the block is the unit that
    FSDP2 shards and torch.compile compiles (:meth:`TransformerStack.parallel_units`).
    ``gelu_approximate``: the MLP's GELU, as ``nn.GELU``'s ``approximate`` names it: "none" (exact
    erf GELU) or "tanh".
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 eps: float = 1e-6, backend: Optional[str] = None, gelu_approximate: str = "none"):
        check_approximate(gelu_approximate, "gelu_approximate", F_GELU_APPROXIMATIONS)
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, backend=backend)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), backend=backend, approximate=gelu_approximate)
        self.backend = backend
        # float32 0-dim views the kernels read, so torch.compile never specialises on their values
        self.register_buffer("alphas", torch.ones(2), persistent=False)  # (entering, attention)

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor] = None,
                scales: Optional[BlockScales] = None,
                entering_alpha=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states: the pending branch output (B, T, D), or the stream itself when ``residual`` is
        None (the first block). scales: ``(entering, attention)`` drop-path ``(row_scale, grad_scale)``
        pairs (None: none). entering_alpha: replaces ``alphas[0]`` (a skip hook's add).
        Returns ``(hidden_states, residual, entering)``: this block's MLP output, pending, the stream
        after its attention add, and the stream entering the block (after the pending add), which is
        the output of the block before."""
        entering_scales, attention_scales = (NO_SCALES, NO_SCALES) if scales is None else scales
        alpha = block_alpha(self, 0) if entering_alpha is None else entering_alpha
        entering, y = add_and_norm(hidden_states, residual, self.norm1, alpha, entering_scales, self.backend)
        residual, y = add_and_norm(self.attn(y), entering, self.norm2, block_alpha(self, 1), attention_scales,
                                   self.backend)
        return self.mlp(y), residual, entering


def block_alpha(blk: nn.Module, i: int):
    """Alpha ``i`` of a block on the stream (0: the residual entering it, 1: its attention add) as the ops take it:
    its buffer's 0-dim view, on which torch.compile never specialises, but the float 1.0 where the alpha is one
    (:meth:`ResidualStream.set_alphas` records which), for which the PyTorch formulas skip the multiply."""
    return 1.0 if blk.unit_alphas[i] else blk.alphas[i]


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


class ResidualStream:
    """The residual-stream loop over blocks in the fused-residual form, with per-residual alphas.

    Residual ``2k`` is block k's attention add and ``2k+1`` its MLP add, which is the residual
    entering block k+1 (owned by it, ``blocks[k+1].alphas[0]``) or, after the last block, the
    stream's final add (``self.final_alpha``). Mixed into :class:`TransformerStack` and dres.convert's
    ``FusedTimmBlocks``, which define ``stream_blocks()`` (the blocks in order) and may override
    :meth:`fused_call`.
    """

    backend: Optional[str]
    final_alpha: torch.Tensor
    # the stream's dtype under autocast: float32 (None), or the half dtype a converter was asked for, which rounds
    # the stream at every add (a change of function that moves a third fewer bytes through each fused add + norm)
    stream_dtype: Optional[torch.dtype] = None

    def fused_call(self, block: nn.Module) -> Callable:
        """``block``'s ``(hidden_states, residual, scales, entering_alpha) -> (hidden_states, residual,
        entering)`` form, :meth:`Block.forward`'s."""
        return block

    @property
    def num_residuals(self) -> int:
        return 2 * len(self.stream_blocks())

    @property
    def alphas(self) -> torch.Tensor:
        """The ``num_residuals`` alphas, shallowest first (a copy; :meth:`set_alphas` writes them)."""
        owned = [blk.alphas[1:] if k == 0 else blk.alphas for k, blk in enumerate(self.stream_blocks())]
        return torch.cat(owned + [self.final_alpha.reshape(1)])

    @torch.no_grad()
    def set_alphas(self, alphas: Sequence[float]) -> None:
        if len(alphas) != self.num_residuals:
            raise ValueError(f"alphas has {len(alphas)} values; this stack has {self.num_residuals} residuals")
        alphas = [float(a) for a in alphas]
        for k, blk in enumerate(self.stream_blocks()):
            pair = (alphas[2 * k - 1] if k else 1.0, alphas[2 * k])
            blk.alphas.copy_(torch.tensor(pair))
            blk.unit_alphas = tuple(a == 1.0 for a in pair)  # block_alpha's choice, a host-side bool
        self.final_alpha.fill_(alphas[-1])
        self.unit_final_alpha = alphas[-1] == 1.0

    def final_alpha_arg(self):
        """The stream's final alpha as the ops take it (:func:`block_alpha`'s rule)."""
        return 1.0 if self.unit_final_alpha else self.final_alpha

    def run_stream(self, x: torch.Tensor, norm: Optional[nn.LayerNorm], scales: Optional[Sequence[Scales]] = None,
                   hooks: Optional[dict[int, Hook]] = None,
                   collect: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The blocks on tokens ``x`` (B, T, D), the last add fused with ``norm`` (none: the raw stream).

        scales: per residual ``(row_scale, grad_scale)`` (from a ResidualDroppath controller) or None.
        hooks: ``{block: fn(stream, outputs) -> (h, a)}``, the stream entering ``block`` becomes ``a*stream + h``.
        collect: block indices whose output stream (after the block's MLP add) to return.
        Returns ``(y, outputs)``: y the final-normed output (the raw stream when there is no final
        norm) and ``outputs[k]`` the residual stream after block k for k in collect.
        """
        hooks = hooks or {}
        if autocast_dtype(x) is not None:
            x = x.to(self.stream_dtype or torch.float32)  # the branches run in the autocast dtype
        blocks = self.stream_blocks()

        def scale(r: int) -> Scales:
            return NO_SCALES if scales is None or r < 0 else scales[r]

        outputs: dict[int, torch.Tensor] = {}
        hidden_states, residual = x, None
        for k, blk in enumerate(blocks):
            block = self.fused_call(blk)
            block_scales = (scale(2 * k - 1), scale(2 * k))
            if k in hooks:  # the hook reads the stream after block k-1, so that add cannot wait for norm1
                if residual is not None:
                    hidden_states, _ = add_and_norm(hidden_states, residual, None, block_alpha(blk, 0), block_scales[0],
                                                    self.backend)
                    if k - 1 in collect:
                        outputs[k - 1] = hidden_states
                h, a = hooks[k](hidden_states, outputs)
                # a = 0 replaces the stream: h enters block k as the stream itself, in its own dtype (bf16 from
                # a Linear under autocast, as plain PyTorch code carries it), with no add and no gradient into
                # the old stream but through h
                hidden_states, residual, entering_alpha = (h, None, None) if a == 0 else (h, hidden_states, a)
                block_scales = (NO_SCALES, block_scales[1])
            else:
                entering_alpha = None
            hidden_states, residual, entering = block(hidden_states, residual, block_scales, entering_alpha)
            if k > 0 and k - 1 in collect and k not in hooks:
                outputs[k - 1] = entering
            del entering  # not kept through the next block unless collected
        stream, y = add_and_norm(hidden_states, residual, norm, self.final_alpha_arg(), scale(2 * len(blocks) - 1),
                                 self.backend)
        if len(blocks) - 1 in collect:
            outputs[len(blocks) - 1] = stream
        return y, outputs


class TransformerStack(ResidualStream, nn.Module):
    """``depth`` pre-LN blocks with per-residual alphas, fused adds and an optional final norm.

    alphas: ``2*depth`` floats (attention, MLP, attention, ...), default all ones; each block keeps
        the alphas of the residual entering it and of its attention add as a non-persistent float32
        buffer, the stack the last one (``final_alpha``); ``self.alphas`` reads them all.
    final_norm: a final LayerNorm (``self.norm``) fused with the last add; else the stack returns the
        raw stream.
    backend: passed to every :mod:`dres.ops` call (None: its choice by device and size, docs/ops.md).
    gelu_approximate: every block's MLP GELU, "none" (exact erf GELU) or "tanh" (:class:`Block`).
    """

    def __init__(self, dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 alphas: Optional[Sequence[float]] = None, final_norm: bool = True, eps: float = 1e-6,
                 backend: Optional[str] = None, gelu_approximate: str = "none"):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_ratio, qkv_bias, eps, backend, gelu_approximate)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=eps) if final_norm else None
        self.register_buffer("final_alpha", torch.ones(()), persistent=False)
        self.set_alphas([1.0] * (2 * depth) if alphas is None else alphas)
        self.backend = backend

    def stream_blocks(self) -> Sequence[nn.Module]:
        return self.blocks

    def parallel_units(self) -> list[nn.Module]:
        """The blocks: each one torch.compile region; FSDP2 groups ``fsdp_blocks_per_unit`` of them a unit."""
        return list(self.blocks)

    def zero_init_branch_ends(self) -> None:
        """Zero the last Linear of every branch (attention proj, MLP fc2): needed for alpha_min <= 0.7."""
        for blk in self.blocks:
            for linear in (blk.attn.proj, blk.mlp.fc2):
                nn.init.zeros_(linear.weight)
                nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, scales: Optional[Sequence[Scales]] = None,
                hooks: Optional[dict[int, Hook]] = None) -> torch.Tensor:
        """The stack on tokens ``x`` (B, T, D): the final-normed output (the raw stream without a final norm)."""
        return self.run_stream(x, self.norm, scales, hooks)[0]

    def forward_intermediates(self, x: torch.Tensor, indices: Sequence[int], scales: Optional[Sequence[Scales]] = None,
                              hooks: Optional[dict[int, Hook]] = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`forward` and the residual stream after each block in ``indices``: ``(y, {block: stream})``
        as :meth:`ResidualStream.run_stream`'s ``collect``."""
        return self.run_stream(x, self.norm, scales, hooks, collect=indices)


def set_backend(module: nn.Module, backend: Optional[str]) -> nn.Module:
    """Point every fused stack inside ``module`` at ``backend`` (None, "torch", "triton", "cuda")."""
    for m in module.modules():
        if hasattr(m, "backend") and (isinstance(m, (TransformerStack, Block, Attention, Mlp))
                                      or getattr(m, "_dres_fused", False)):
            m.backend = backend
    return module


def set_fused_mlp(module: nn.Module, fused: Optional[bool]) -> nn.Module:
    """Choose the MLP path of every :class:`Mlp` in ``module``: True (fused), False (plain), None (auto)."""
    for m in module.modules():
        if isinstance(m, Mlp):
            m.fused = fused
    return module
