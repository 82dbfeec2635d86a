"""The largest batch that fits: eager training steps at growing batches until one runs out of memory,
with and without activation checkpointing at branch granularity."""

from __future__ import annotations

import torch

from benchmarks.train_models import build_model, make_batch
from benchmarks.train_step import forward_backward, free_memory, make_optimizer


def apply_checkpointing(model: torch.nn.Module) -> int:
    """Activation checkpointing at branch granularity (every attention and MLP module recomputed in
    backward), the same for the baselines and dres: the residual adds and norms between branches
    (dres' fused ops) are kept, only the branches' activations are recomputed. Returns how many."""
    from torch.utils.checkpoint import checkpoint

    n = 0
    for m in model.modules():
        cls = type(m).__name__
        if cls in ("Attention", "UViTAttention", "Mlp") or (cls == "Sequential" and is_uvit_mlp(m)):
            orig = m.forward

            def fwd(*a, _orig=orig, **k):
                return checkpoint(_orig, *a, use_reentrant=False, **k)

            m.forward = fwd
            n += 1
    return n


def is_uvit_mlp(m) -> bool:
    return len(m) == 3 and isinstance(m[0], torch.nn.Linear) and isinstance(m[1], torch.nn.GELU)


def fits(bench: str, name: str, batch: int, checkpointing: bool, options: dict) -> bool:
    """Whether two training steps of the model (with ``options``) run at ``batch`` without running out
    of memory (eager)."""
    device = torch.device("cuda")
    model = opt = x = None
    try:
        model = build_model(bench, name, **options).to(device).train()
        if checkpointing:
            apply_checkpointing(model)
        opt = make_optimizer(model)
        x = make_batch(bench, batch, device)
        for _ in range(2):
            forward_backward(bench, model, x)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del model, opt, x
        free_memory()


def max_batch(bench: str, name: str, checkpointing: bool, start: int, step: int, cap: int,
              options: dict | None = None) -> tuple[int, bool]:
    """(largest multiple of ``step`` that fits, whether the search stopped at ``cap`` without a
    failure): double from ``start`` until a failure, then bisect down to ``step``."""
    lo, hi, b = 0, None, start
    while b <= cap:
        if fits(bench, name, b, checkpointing, options or {}):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo, True
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(bench, name, mid, checkpointing, options or {}):
            lo = mid
        else:
            hi = mid
    return lo, False
