"""Parallelism, kept apart from the model and the loop (torchtitan style): process-group setup from
the ``torchrun`` environment, and functions that transform a built model in place —
activation checkpointing, per-unit ``torch.compile``, then DDP or FSDP2 — applied in that order (a
whole-model ``torch.compile`` comes last, around the DDP wrapper).

*Units.* A unit is a transformer block, as the model's ``parallel_units()`` lists them (a dres
:class:`~dres.nn.Block` adds the previous block's pending branch fused with its own norm1, so a
block call touches only its own parameters).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import pickle
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from dres.train.config import Config, ConfigError


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


def init(device="auto", mode="none", timeout_s: float = Config.dist_timeout_s) -> DistInfo:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1) or already joined. ``timeout_s``
    (the config's ``dist_timeout_s``): how long a collective waits for a rank that stopped answering."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and mode == "none":  # each process would silently train a model of its own
        raise ConfigError(f"launched as {world} processes with dist=none, which would train {world} separate "
                          "models; set --set dist=ddp (or dist=fsdp)")
    if dist.is_initialized():
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return DistInfo(rank, world, local, pick_device(device, local))
    if world == 1 and mode == "none":  # a one-process DDP/FSDP run joins a 1-rank group below
        return DistInfo(0, 1, 0, pick_device(device, 0))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # a single process asked for ddp/fsdp without torchrun: a store in its own memory (a port could be another run's)
    alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if "MASTER_ADDR" not in os.environ else {}
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": dev} if dev.type == "cuda" else {}), **alone)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, dev)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier():
    if is_dist():
        dist.barrier()


def _portable(e: Exception) -> Exception:
    """``e`` where it survives pickling (what a broadcast does), else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # exceptions whose __init__ takes other arguments than their args
        return RuntimeError(f"{type(e).__name__}: {e}")


def on_main(fn, main: bool):
    """Run ``fn()`` on the main rank only and share its outcome: an exception it raised is raised on
    every rank (so no rank waits in a later collective for one that failed); its result is returned on
    the main rank, None elsewhere."""
    result, error = None, None
    if main:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
    if is_dist() and dist.get_world_size() > 1:
        box = [_portable(error) if error is not None else None]
        dist.broadcast_object_list(box, src=0)
        if not main:
            error = box[0]
    if error is not None:
        raise error
    return result


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
    """With a process group: free what the run left in reference cycles (a stopped run's trainer, its DDP model and
    gradients), then end the group: freed later, at interpreter exit, gloo's threads touch tensors whose release
    needs the GIL and the process aborts ("terminate called without an active exception") after its run ended."""
    if is_dist():
        gc.collect()
        dist.destroy_process_group()


class LostRank(RuntimeError):
    """Another rank's process ended, or stopped answering for the process group's timeout, while this one
    waited on it in a collective (one line, naming the rank where it can be known)."""


_GLOO_PEER = re.compile(r"\[([^\]]+)\]:\d+")  # gloo names the far end of a broken pair as [address]:port
# what gloo's transport errors (plain RuntimeErrors) and NCCL's (DistBackendError) say of a peer that is gone
_PEER_GONE = re.compile(r"connection (reset|closed)|closed by peer|pair closure|broken pipe|timed? ?out|"
                        r"remote process|network error|ncclRemoteError|ncclSystemError", re.I)


def _is_lost_peer(e: BaseException) -> bool:
    if isinstance(e, (dist.DistNetworkError, dist.DistStoreError)):  # the store's host is gone
        return True
    text = str(e)
    backend = isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and ("gloo" in text or "pair" in text))
    return backend and _PEER_GONE.search(text) is not None


def _lost_peer_errors(e: BaseException) -> list[BaseException]:
    """The exceptions of ``e``'s chain (and of the ranks' failures a DCP CheckpointException holds) that are a
    collective failing on a lost peer, outermost first."""
    found, seen = [], set()
    while isinstance(e, BaseException) and id(e) not in seen:
        seen.add(id(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                found += _lost_peer_errors(f[0] if isinstance(f, tuple) else f)
        if _is_lost_peer(e):
            found.append(e)
        e = e.__cause__ or e.__context__
    return found


def lost_rank(e: BaseException) -> str | None:
    """``e`` told as a lost rank, in one line, where it is a collective of this process group that failed
    because a peer was lost (the earliest such error of its chain: later ones are the teardown meeting the
    same loss), else None. The rank is named where it can be known: the other one of two ranks, or the address
    gloo gives."""
    if not is_dist() or dist.get_world_size() < 2:
        return None
    errors = _lost_peer_errors(e)
    if not errors:
        return None
    text = str(errors[-1]).strip().splitlines()[0]
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0].rstrip(".")  # without gloo's [file:line]
    world, rank = dist.get_world_size(), dist.get_rank()
    address = _GLOO_PEER.search(text)
    who = f"rank {1 - rank}" if world == 2 else f"the rank at {address.group(1)}" if address else "another rank"
    wait = " (dist_timeout_s)" if re.search(r"timed? ?out", reason, re.I) else ""
    return f"lost {who} of {world}: {reason[:200]}{wait}; its process ended, or its host stopped answering"


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


def apply_compile(model: nn.Module, scope: str = "blocks") -> int:
    """``torch.compile`` the model in place; the number of compiled regions. ``scope`` "model": its
    forward as one region (under DDP pass the wrapped model, whose graph Dynamo splits at the gradient
    buckets so that all-reduces still overlap the backward). "blocks": each unit (repeated structure
    compiles once and is reused; the code between units runs eager): the model's ``compile_units()``
    where it lists more regions than its blocks, else :func:`parallel_units`. A model may set
    ``compile_dynamic`` (the ``dynamic`` argument of ``torch.compile``; default None, torch's choice)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    dynamic = getattr(inner, "compile_dynamic", None)
    if scope == "model":
        model.compile(dynamic=dynamic)
        return 1
    units = list(model.compile_units()) if hasattr(model, "compile_units") else parallel_units(model)
    if dynamic is False:  # units share one forward: static shapes need an entry per unit, mode and batch size
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(units))
    for u in units:
        u.compile(dynamic=dynamic)
    return len(units)


def apply_ddp(model: nn.Module, info: DistInfo, bucket_view: bool = False, stream=None) -> nn.Module:
    """DDP; ``bucket_view`` makes the gradients views into the all-reduce buckets
    (``gradient_as_bucket_view``: no copy of each gradient into its bucket and back). ``stream``: the
    CUDA stream a captured step will run on; DDP built there records its gradient hooks' work on it
    (torch's recipe for capturing DDP), and the current stream waits for its parameter broadcast."""
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            gradient_as_bucket_view=bucket_view)
    if stream is not None:
        torch.cuda.current_stream(info.device).wait_stream(stream)
    return ddp


RESHARD_POLICIES = ("auto", "always", "except_last", "never")


def resolve_reshard(reshard: str, world: int) -> str:
    """``auto``: "never" on one rank (the shard is the whole parameter, so resharding frees only the
    gathered low-precision copy and costs a second gather per unit), else "except_last" (torchtitan's
    default: the last unit is the first the backward needs)."""
    if reshard not in RESHARD_POLICIES:
        raise ValueError(f"reshard must be one of {', '.join(RESHARD_POLICIES)}; got {reshard!r}")
    if reshard != "auto":
        return reshard
    return "never" if world == 1 else "except_last"


def fully_shard_units(model: nn.Module, units: list[nn.Module], mp_policy, prefetch: bool = False,
                      mesh=None, reshard: str = "always", blocks_per_unit: int = 1) -> nn.Module:
    """``fully_shard`` ``units`` (listed in execution order) in groups of ``blocks_per_unit``
    consecutive ones, then the root ``model``.

    reshard: which groups free their gathered parameters after the forward (``reshard_after_forward``):
    every one ("always", FSDP2's default: least memory, a second all-gather per group in the
    backward), all but the last ("except_last": the backward starts with the last group, so
    regathering it at once is pure cost) or none ("never": memory of all gathered groups, one
    all-gather per group); "auto" as :func:`resolve_reshard` on the mesh's size.
    prefetch: additionally start the next group's all-gather during each group's forward.
    blocks_per_unit: FSDP2's hooks cost CPU time per group, whatever its size; larger groups
    issue fewer, larger collectives."""
    from torch.distributed.fsdp import fully_shard

    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be >= 1; got {blocks_per_unit!r}")
    reshard = resolve_reshard(reshard, mesh.size() if mesh is not None else dist.get_world_size())
    groups = [units[i:i + blocks_per_unit] for i in range(0, len(units), blocks_per_unit)]
    for i, group in enumerate(groups):
        keep = reshard == "never" or (reshard == "except_last" and i == len(groups) - 1)
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if prefetch:
        for group, nxt in zip(groups, groups[1:]):
            group[0].set_modules_to_forward_prefetch([nxt[0]])
    return model


def apply_fsdp(model: nn.Module, info: DistInfo, param_dtype="bf16", prefetch: bool = False,
               reshard: str = "auto", blocks_per_unit: int = 1) -> nn.Module:
    """FSDP2 over :func:`parallel_units` (in execution order: encoder blocks, then decoder blocks)
    and the root (which holds embeddings, norms, heads). ``prefetch`` (the config's
    ``fsdp_prefetch``) keeps every unit gathered from its forward to its backward and prefetches
    the next; ``reshard`` (the config's ``fsdp_reshard``; "auto" is "never" with prefetch) and
    ``blocks_per_unit`` as in :func:`fully_shard_units`.

    Mixed precision: parameters gathered in ``param_dtype`` for compute, gradients reduced in fp32;
    the sharded master parameters and optimizer states stay fp32. Forward inputs are never cast:
    the root's would round the data (MAE's image and so its norm-pix target, U-ViT's noisy image
    and diffusion time) and a block's the fp32 residual stream; autocast casts at each matmul, so
    bf16 parameters expect autocast (the trainer gathers fp32 under ``precision=fp32``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(info.device.type, (info.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else torch.float32,
                              reduce_dtype=torch.float32, cast_forward_inputs=False)
    if prefetch and reshard == "auto":
        reshard = "never"
    return fully_shard_units(model, parallel_units(model), mp, prefetch=prefetch, mesh=mesh, reshard=reshard,
                             blocks_per_unit=blocks_per_unit)


def set_grad_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce/reduce-scatter on the micro-batches before the last one."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()
