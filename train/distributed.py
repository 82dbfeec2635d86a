"""Parallelism, kept apart from the model and the loop (torchtitan style): process-group setup from
the ``torchrun`` environment, and functions that transform a built model in place —
activation checkpointing, per-unit ``torch.compile``, then DDP or FSDP2 — applied in that order.

*Units.* A unit is a transformer block, as the model's ``parallel_units()`` lists them (a dres
:class:`~dres.nn.Block` adds the previous block's pending branch fused with its own norm1, so a
block call touches only its own parameters).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def pick_device(name="auto", local_rank=0) -> torch.device:
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    d = torch.device(name)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", local_rank)
    return d


def init(device="auto", mode="none") -> DistInfo:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1) or already joined."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return DistInfo(rank, world, local, pick_device(device, local))
    if world == 1 and mode == "none":  # a one-process DDP/FSDP run joins a 1-rank group below
        return DistInfo(0, 1, 0, pick_device(device, 0))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if "MASTER_ADDR" not in os.environ:  # a single process asked for ddp/fsdp without torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30),
                            **({"device_id": dev} if dev.type == "cuda" else {}))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, dev)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier():
    if is_dist():
        dist.barrier()


def all_mean(t: torch.Tensor) -> torch.Tensor:
    if is_dist() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_sum(t: torch.Tensor) -> torch.Tensor:
    if is_dist() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def cleanup():
    if is_dist():
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def parallel_units(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, as its ``parallel_units()`` method lists them in execution order."""
    if not hasattr(model, "parallel_units"):
        raise TypeError(f"{type(model).__name__} does not list its blocks: define parallel_units() "
                        "(the repeated blocks, in execution order) to compile or shard it per block")
    return list(model.parallel_units())


def _selective_policy():
    """Save matmul and attention outputs (expensive to recompute), recompute the rest (cheap,
    memory-bound element-wise ops) — the selective policy torchtitan uses."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, n):
            save.add(getattr(aten, n).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Wrap each unit's forward in ``torch.utils.checkpoint`` (non-reentrant, RNG preserved). The
    forward is replaced on the instance, so parameter names and state-dict keys do not change."""
    if mode == "none":
        return 0
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    units = parallel_units(model)
    for u in units:
        fwd = u.forward
        if mode == "full":
            u.forward = functools.partial(lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k), fwd)
        elif mode == "selective":
            ctx = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
            u.forward = functools.partial(
                lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, context_fn=ctx, **k), fwd)
        else:
            raise ValueError(f"act_ckpt must be none, full or selective; got {mode!r}")
    return len(units)


def apply_compile(model: nn.Module) -> int:
    """``torch.compile`` each unit (repeated structure compiles once and is reused; the fused
    custom ops between units stay as they are)."""
    units = parallel_units(model)
    for u in units:
        u.compile()
    return len(units)


def apply_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


RESHARD_POLICIES = ("always", "except_last", "never")


def fully_shard_units(model: nn.Module, units: list[nn.Module], mp_policy, prefetch: bool = False,
                      mesh=None, reshard: str = "always") -> nn.Module:
    """``fully_shard`` each of ``units`` (listed in execution order), then the root ``model``.

    reshard: which units free their gathered parameters after the forward (``reshard_after_forward``):
    every one ("always", FSDP2's default: least memory, a second all-gather per unit in the backward),
    all but the last ("except_last": the backward starts with the last unit, so regathering it at
    once is pure cost) or none ("never": memory of all gathered units, one all-gather per unit).
    prefetch: additionally start the next unit's all-gather during each unit's forward."""
    import dataclasses

    from torch.distributed.fsdp import fully_shard

    from dres.nn import Block

    if reshard not in RESHARD_POLICIES:
        raise ValueError(f"reshard must be one of {', '.join(RESHARD_POLICIES)}; got {reshard!r}")
    # A dres Block receives the fp32 residual stream as an argument: FSDP2 must not cast it to the
    # parameters' dtype on the way in (its default), which would round the stream to bf16.
    stream_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for i, u in enumerate(units):
        keep = reshard == "never" or (reshard == "except_last" and i == len(units) - 1)
        fully_shard(u, mesh=mesh, mp_policy=stream_policy if isinstance(u, Block) else mp_policy,
                    reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if prefetch:
        for unit, nxt in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([nxt])
    return model


def apply_fsdp(model: nn.Module, info: DistInfo, param_dtype="bf16", prefetch: bool = False,
               reshard: str | None = None) -> nn.Module:
    """FSDP2 over :func:`parallel_units` (in execution order: encoder blocks, then decoder blocks)
    and the root (which holds embeddings, norms, heads). ``prefetch`` (the config's
    ``fsdp_prefetch``) keeps every unit gathered from its forward to its backward and prefetches
    the next; ``reshard`` as in :func:`fully_shard_units` (default: "never" with prefetch, else
    "always"). Mixed precision: parameters gathered in bf16 for compute, gradients reduced in fp32;
    the sharded master parameters and optimizer states stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(info.device.type, (info.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else torch.float32,
                              reduce_dtype=torch.float32)
    reshard = reshard or ("never" if prefetch else "always")
    return fully_shard_units(model, parallel_units(model), mp, prefetch=prefetch, mesh=mesh, reshard=reshard)


def set_grad_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce/reduce-scatter on the micro-batches before the last one."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()
