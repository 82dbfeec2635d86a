"""The trainer's step as one CUDA graph, kept apart from the loop (torchtitan style).

:class:`GraphedStep` wraps a step function, the trainer's :meth:`Trainer.step_body
<dres.train.loop.Trainer.step_body>` — forward and backward of every micro-batch, loss scaling,
gradient clipping, the optimizer, EMA, the ResidualDroppath iteration and the non-finite flag —
without changing it, and takes only what it reads besides (the optimizer, the LR schedule, the
device and its capture stream), not the trainer; the trainer picks its step once, in setup: the
wrapper where the run is captured, its ``step_body`` where not. It runs the body eagerly
for a few warm-up steps on a side stream (lazy initialisation, torch.compile and Triton autotuning
happen there, as torch's "whole network capture" recipe asks), captures it once, and replays the
graph for every later step. What the body reads and writes stays at fixed addresses:

* the batch is copied into static input tensors before each replay (a device-to-device copy: the
  GPU-resident loader's batches are already on the device);
* the learning rate of each parameter group is a device tensor that the graph fills from a table of
  the LR schedule indexed by a device step counter (the fused AdamW reads a tensor lr); the host's
  scheduler still steps, with floats, for logs and checkpoints;
* fp16 loss scaling goes through ``GradScaler`` unchanged: with the fused AdamW its scale, overflow
  check and skipped step are device tensors (``found_inf``), so nothing reads a value on the host;
* random draws (MAE masks, U-ViT noise) use the CUDA generator, whose philox offset each replay
  advances by what the captured draws consume, as the eager step would: the RNG state a checkpoint
  saves resumes the same sequence; ResidualDroppath masks hash a device counter.

Warm-up steps and replays run the same body, so they compute the same values; the eager trainer
(``cuda_graphs=false``) differs only in the learning rate's rounding (a Python float there, a float32
tensor here). :func:`graph_plan` decides whether a run captures its step; a configuration that
cannot be captured runs the eager step and says why in one line.

Each replay is timed by a pair of CUDA events on the current stream (recorded outside the graph, read
only at log steps, where the loop synchronises anyway): the replay's GPU time is the floor of the
trainer's step, and :func:`window_timing` / :func:`steady_timing` set the wall
time of the log windows against it. Eager steps are not timed: events around them would measure the
host's launch time as much as the GPU's, which is no floor.
"""

from __future__ import annotations

import contextlib
import statistics
import warnings

import torch

from dres.train.config import ConfigError
from dres.train.optim import capture_blocker


# DDP does host-side work in its first iterations (bucket rebuild, sampled logging): torch's recipe for
# capturing a whole DDP step runs 11 eager iterations first
DDP_WARMUP_STEPS = 11


def graph_plan(cfg, device: torch.device, precision: str, world: int) -> tuple[bool, str]:
    """``(capture, why)``: whether the trainer captures its step and a one-line reason. ``cuda_graphs``:
    ``auto`` captures where the configuration allows and runs eagerly elsewhere, ``true`` captures or
    fails with the reason (:class:`ConfigError`), ``false`` never captures. DDP on several processes is
    captured with its all-reduce inside the graph (NCCL >= 2.9; measured faster than eager DDP,
    BENCHMARKS.md)."""
    if cfg.cuda_graphs == "false":
        return False, "off (cuda_graphs=false)"
    ddp = cfg.dist == "ddp" and world > 1
    reason = None
    if device.type != "cuda":
        reason = f"the device is {device.type}, not CUDA"
    elif cfg.dist == "fsdp":
        reason = "FSDP2 gathers and frees parameters through hooks that a graph cannot capture"
    elif cfg.act_ckpt != "none":
        reason = "activation checkpointing saves and restores the RNG state on the host in the backward"
    else:
        reason = capture_blocker(cfg, device, precision)
    if reason is not None and cfg.cuda_graphs == "true":
        raise ConfigError(f"cuda_graphs=true, but the step cannot be captured: {reason} "
                          "(cuda_graphs=auto runs it eagerly)")
    if reason is not None:
        return False, f"off ({reason}); the step runs eagerly"
    if ddp:
        return True, (f"on (the whole step, DDP's gradient all-reduce included, is captured after "
                      f"{DDP_WARMUP_STEPS} warm-up steps and replayed)")
    return True, "on (the whole step is captured after warm-up steps and replayed)"


def graph_warmup_steps(cfg, world: int) -> int:
    """Eager steps before the capture: lazy initialisation, compilation and autotuning happen in them."""
    return DDP_WARMUP_STEPS if cfg.dist == "ddp" and world > 1 else 3


def schedule_table(scheduler, total_steps: int, device) -> torch.Tensor:
    """(groups, total_steps + 1) float32: the learning rate a ``LambdaLR`` gives each parameter group
    at every position 0..total_steps (the last value also serves positions past the end)."""
    rows = [[base * fn(i) for i in range(total_steps + 1)]
            for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


def window_timing(replay_ms: list[float], replays: int, wall_ms: float) -> dict:
    """The metrics.jsonl fields of one log window of ``wall_ms`` in which ``replays`` steps were graph
    replays, ``replay_ms`` the GPU times of (the last of) them: ``gpu_ms_per_step``, their mean, and
    ``gpu_bound``, the fraction of the wall time the GPU spent in the step's graph (1.0: the trainer
    adds nothing to the replays); nothing when no replay ran in the window."""
    if not replay_ms or replays <= 0:
        return {}
    if wall_ms <= 0:
        raise ValueError(f"wall_ms must be positive, got {wall_ms}")
    per_step = sum(replay_ms) / len(replay_ms)
    return {"gpu_ms_per_step": per_step, "gpu_bound": per_step * replays / wall_ms}


def steady_timing(windows: list[dict], skip: int = 2) -> dict:
    """summary.json's ``graph_gpu_ms_per_step`` and ``trainer_vs_replay`` (wall ms per step / replay GPU
    ms per step; 1.0 is the floor): medians over the log windows after the first ``skip`` (compilation,
    warm-up, capture) in which every step was a replay. ``windows``: per log window its ``steps``,
    ``replays`` and ``wall_ms`` with the :func:`window_timing` fields; nothing when no window qualifies."""
    steady = [w for w in windows[skip:] if w["replays"] == w["steps"] > 0]
    if not steady:
        return {}
    return {"graph_gpu_ms_per_step": statistics.median(w["gpu_ms_per_step"] for w in steady),
            "trainer_vs_replay": statistics.median(w["wall_ms"] / w["steps"] / w["gpu_ms_per_step"] for w in steady)}


class GraphedStep:
    """``step(batch) -> (loss, metrics)`` like ``step_body``, the step it wraps, captured as one CUDA graph
    after ``warmup_steps`` eager steps (every call is one real training step). The returned tensors
    are the graph's static outputs: read them before the next call (the loop accumulates them).

    What the wrapper reads besides ``step_body``: the ``optimizer``'s parameter groups (their lr is a
    device tensor inside the step), the LambdaLR ``scheduler`` (its table over ``total_steps`` positions,
    and its position when the first batch comes, after any resume), the ``device``, the ``stream`` it
    warms up and captures on (DDP must have been built on it; a new one when None) and ``log`` for the
    line that says the step was captured. Everything else (scaler, EMA, ResidualDroppath, the
    non-finite flag) is ``step_body``'s own state, captured with it.

    Every replay of a log window records a CUDA event pair (the last ``timed_replays`` are kept);
    :meth:`end_window` closes the window at a log step and :meth:`read_window` reads its replay times
    once the host waits for that step anyway, keeping them in ``windows`` for :func:`steady_timing`."""

    def __init__(self, step_body, optimizer: torch.optim.Optimizer, scheduler, total_steps: int,
                 device: torch.device, *, warmup_steps: int = 3, timed_replays: int = 128, stream=None, log=print):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (lazy initialisation cannot be captured), got {warmup_steps}")
        if timed_replays < 1:
            raise ValueError(f"timed_replays must be >= 1, got {timed_replays}")
        self.step_body, self.optimizer, self.scheduler, self.device = step_body, optimizer, scheduler, device
        self.warmup_steps, self.timed_replays, self.log = warmup_steps, timed_replays, log
        self.warmed = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict | None = None
        self.outputs = None
        self.stream = stream if stream is not None else torch.cuda.Stream(device)  # warm-up and capture
        self.lr_table = schedule_table(scheduler, total_steps, device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self._index = torch.zeros(1, dtype=torch.int64, device=device)
        self._lrs = torch.zeros(self.lr_table.shape[0], 1, device=device)
        self.lrs = list(self._lrs[:, 0].unbind(0))  # one 0-dim view per parameter group
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # this window's, a ring of timed_replays
        self._replays = 0  # in the current log window
        self.windows: list[dict] = []

    # ------------------------------------------------------------------ the captured function
    @contextlib.contextmanager
    def _device_lr(self):
        """The parameter groups read their lr from the device tensors inside the step."""
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, self.lrs):
            g["lr"] = lr
        try:
            yield
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr

    def _step(self):
        torch.clamp(self.position, max=self.lr_table.shape[1] - 1, out=self._index)
        torch.index_select(self.lr_table, 1, self._index, out=self._lrs)
        self.position.add_(1)
        with self._device_lr():
            return self.step_body(self.inputs)

    # ------------------------------------------------------------------ per call
    def _load(self, batch: dict):
        if self.inputs is None:
            self.inputs = {k: torch.empty_like(v) for k, v in batch.items()}
            self.position.fill_(self.scheduler.last_epoch)  # after any resume
        for k, v in batch.items():
            dst = self.inputs.get(k)
            if dst is None or dst.shape != v.shape or dst.dtype != v.dtype:
                have = {n: (tuple(t.shape), str(t.dtype)) for n, t in self.inputs.items()}
                raise ValueError(f"cuda_graphs: batch '{k}' is {tuple(v.shape)} {v.dtype}, but the captured step "
                                 f"takes {have}; use fixed-size batches or cuda_graphs=false")
            dst.copy_(v)

    def _warmup(self):
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream), warnings.catch_warnings():
            # the optimizer is built capturable for the graph; these steps are its deliberate eager ones
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            out = self._step()
        cur.wait_stream(self.stream)
        self.warmed += 1
        return out

    def _capture(self):
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                self.outputs = self._step()
        except RuntimeError as e:  # something in the step synchronised or allocated on the host
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"cuda_graphs: capturing the train step failed ({first}); "
                               "run it eagerly with --set cuda_graphs=false") from e
        self.log(f"[dres] cuda graphs: captured the train step after {self.warmed} warm-up steps")

    def __call__(self, batch: dict):
        self._load(batch)
        if self.graph is None and self.warmed < self.warmup_steps:
            return self._warmup()
        if self.graph is None:
            self._capture()
        slot = self._replays % self.timed_replays
        if slot == len(self._events):
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        start, end = self._events[slot]
        start.record()
        self.graph.replay()
        end.record()
        self._replays += 1
        return self.outputs

    def release(self) -> None:
        """Free the captured graph once training is over. NCCL keeps a communicator alive while a graph
        that captured its collectives exists, so destroying the process group first hangs
        (pytorch/pytorch#115388): the trainer releases the graph before it tears the group down."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None

    # ------------------------------------------------------------------ per log window
    def end_window(self) -> tuple[list, int]:
        """Close the log window at the step just issued, without waiting for it: its replays' event pairs and
        replay count, for :meth:`read_window`; the next window records into new events."""
        window = (self._events, self._replays)
        self._events, self._replays = [], 0
        return window

    def read_window(self, window: tuple[list, int], steps: int, wall_ms: float) -> dict:
        """The :func:`window_timing` fields of a window from :meth:`end_window` (``steps`` steps in
        ``wall_ms``), recorded in ``windows``; waits for the window's replays to end."""
        events, replays = window
        for _, end in events:
            end.synchronize()
        timing = window_timing([start.elapsed_time(end) for start, end in events], replays, wall_ms)
        self.windows.append({"steps": steps, "replays": replays, "wall_ms": wall_ms, **timing})
        return timing
