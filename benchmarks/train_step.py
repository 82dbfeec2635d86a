"""The bare training step on one GPU: forward + backward + fused AdamW step + zero_grad under bf16
autocast, on synthetic data already on the GPU (the data pipeline is not measured), timed with CUDA
events after a warm-up that also absorbs torch.compile's compilation. Images/s = batch / median step
time; peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps; FLOPs per step come
from ``torch.utils.flop_counter.FlopCounterMode`` on one eager forward+backward, and model FLOP
utilisation divides the achieved rate by the bf16 matmul rate measured in the same run. The same step
captured as one CUDA graph and replayed gives its GPU time alone (``replay_ms``): against it, the
launched step's time shows what the host adds (``step_vs_replay``).
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings

import torch

from benchmarks import measure
from benchmarks.train_models import MODELS, build_model, loss_fn, make_batch


# "compile_graphs": torch.compile's reduce-overhead mode (CUDA graphs over the compiled step)
MODES = ("eager", "compile", "compile_graphs")


def compile_for(model: torch.nn.Module, mode: str):
    if mode == "compile":
        return torch.compile(model)
    if mode == "compile_graphs":
        return torch.compile(model, mode="reduce-overhead")
    return model


def make_optimizer(model, fused: bool = True, *, capturable: bool = False):
    # MAE's recipe (AdamW 0.9/0.95, wd 0.05), fused; the hyper-parameters do not change the cost of a step.
    # capturable: the step will be captured in a CUDA graph (the step count and its arithmetic stay on the GPU)
    params = [p for p in model.parameters() if p.requires_grad]
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.05, capturable=capturable, **kind)


def count_flops(bench: str, model, x) -> int:
    """FLOPs of one forward + backward (matmuls, convolutions and SDPA; elementwise ops count 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        forward_backward(bench, model, x)
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def time_steps(step, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` steps from CUDA events, synchronising only at the end so the
    CPU runs ahead as in a real training loop (a per-step sync would add launch gaps)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def forward_backward(bench: str, model_fwd, x: torch.Tensor) -> None:
    """One bf16-autocast forward of ``model_fwd`` on ``x`` and the backward of its loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(bench, model_fwd, x)
    loss.backward()


def first_training_step(bench: str, model: torch.nn.Module, x: torch.Tensor, sharded: bool = False):
    """``(step, optimizer kind)`` after running the first step: ``step()`` is :func:`forward_backward` +
    fused AdamW step + zero_grad of ``model`` (as given: compiled or wrapped already, or not) on ``x``.
    When ``sharded`` (FSDP2) and this torch's fused AdamW rejects DTensor parameters, the step falls back
    to the foreach kernel, the next fastest; the kind says which runs."""
    opt = make_optimizer(model)

    def step():
        forward_backward(bench, model, x)
        opt.step()  # `opt` is looked up at call time, so the fallback below is used
        opt.zero_grad(set_to_none=True)

    try:
        step()
        return step, "fused"
    except Exception:
        if not sharded:
            raise
        opt = make_optimizer(model, fused=False)
        step()
        return step, "foreach"


def warm_and_time(step, warmup: int, steps: int, t0: float) -> tuple[list[float], float, float]:
    """``(step milliseconds, warm-up seconds since t0, peak GiB)``: ``warmup`` - 1 more untimed steps
    after the first (compilation happens there), then ``steps`` timed ones with the peak memory reset."""
    for _ in range(max(1, warmup) - 1):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps)
    return times, warm_s, torch.cuda.max_memory_allocated() / 2**30


def capturable_step(bench: str, model_fwd, model: torch.nn.Module, x: torch.Tensor):
    """``step()`` in the form PyTorch's whole-network capture takes: :func:`forward_backward` through
    ``model_fwd`` (the callable the timed step runs, compiled or not: no second compile), and
    the step of a second fused AdamW on ``model``'s parameters built ``capturable``. No zero_grad: the
    gradients are set to None once before the capture, so each replay's backward writes them afresh
    into the graph's memory, as the timed step's backward does after its zero_grad."""
    opt = make_optimizer(model, capturable=True)

    def step():
        forward_backward(bench, model_fwd, x)
        opt.step()

    return step


def replay_step_ms(bench: str, model_fwd, model: torch.nn.Module, x: torch.Tensor, rep_ms: float = 1000) -> float:
    """Median milliseconds of a replay of :func:`capturable_step` captured as one CUDA graph: the step's
    GPU time alone, no host launch or dispatch in it. ``rep_ms`` of replays are timed (about 20 of a
    ViT-B/16 step; ``graph_median_us``'s default, made for kernels, would time one). The replays update
    ``model``'s parameters; the graph, its gradients and the second optimizer are freed on return."""
    try:
        with warnings.catch_warnings():  # the capturable optimizer's eager warm-up steps are deliberate
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            return measure.graph_median_us(capturable_step(bench, model_fwd, model, x), rep_ms=rep_ms,
                                           before_capture=lambda: model.zero_grad(set_to_none=True)) / 1e3
    finally:
        model.zero_grad(set_to_none=True)  # the gradients live in the graph's memory pool


def run_one(bench: str, name: str, mode: str, batch: int, options: dict, *, steps: int, warmup: int, flops: bool,
            env: dict, card: str, peak_tflops: float) -> dict:
    """Images/s, peak memory, FLOPs (when ``flops``) and MFU of one (model with ``options``, mode,
    batch) on one GPU, unwrapped; and the GPU time of the same step replayed as a CUDA graph."""
    device = torch.device("cuda")
    torch._dynamo.reset()
    free_memory()
    model = build_model(bench, name, **options).to(device).train()
    images = make_batch(bench, batch, device)
    flops = count_flops(bench, model, images) if flops else None
    t0 = time.time()
    fwd = compile_for(model, mode)  # compiled once: the timed step and its replay run the same code
    step, optimizer_kind = first_training_step(bench, fwd, images)
    times, warm_s, peak = warm_and_time(step, warmup, steps, t0)
    try:  # reduce-overhead mode replays its own CUDA graphs already: they cannot be captured in another
        replay_ms = replay_step_ms(bench, fwd, model, images) if mode != "compile_graphs" else None
    except RuntimeError as e:  # the capture failed (a host sync in the step, ...): the figure is a probe, not the row
        print(f"  replay_ms not measured: {str(e).splitlines()[0][:120]}", flush=True)
        replay_ms = None
    ms = statistics.median(times)
    ips = batch / (ms / 1e3)
    rec = {
        "kind": "throughput", "bench": bench, "model": name, "description": MODELS[bench][name], **options,
        "mode": mode, "batch": batch, "world_size": 1, "fsdp": False, "checkpointing": False,
        "compile_scope": None if mode == "eager" else "model",
        "images_per_s": ips, "images_per_s_per_gpu": ips, "step_ms": ms,
        "step_ms_min": min(times), "step_ms_max": max(times), "steps": len(times), "warmup_s": warm_s,
        "replay_ms": replay_ms, "step_vs_replay": ms / replay_ms if replay_ms else None,
        "peak_mem_gib": peak, "card": card, "torch": env["torch"], "triton": env["triton"],
        "date": measure.today(), "matmul_tflops": peak_tflops, "optimizer": optimizer_kind,
    }
    if flops:
        rec["flops_per_step"] = flops
        rec["gflop_per_image"] = flops / batch / 1e9
        rec["achieved_tflops"] = flops / (ms / 1e3) / 1e12
        rec["mfu_pct"] = 100 * rec["achieved_tflops"] / peak_tflops if peak_tflops else None
    del model, fwd, step, images
    free_memory()
    return rec
