"""The train step, in one file: :class:`TrainStep`, one optimizer step of device work only, and
:class:`GraphedStep`, the same step captured as one CUDA graph and replayed (torchtitan keeps its step
apart from the loop the same way). The trainer (:mod:`dres.train.loop`) picks one of them once, in setup:
the captured step where :func:`graph_plan` allows it, the eager step where not.

:class:`TrainStep` runs the forward and backward of every micro-batch, loss scaling, gradient clipping,
the optimizer, the EMA of the parameters, the ResidualDroppath iteration and a device-side non-finite
flag, with no host sync, so that it can be captured. :class:`GraphedStep` wraps it without changing it,
and takes only what it reads besides (the optimizer, the LR schedule, the device and its capture
stream), not the trainer. It runs the step eagerly for a few warm-up steps on a side stream (lazy
initialisation, torch.compile and Triton autotuning happen there, as torch's "whole network capture"
recipe asks), captures it once, and replays the graph for every later step. What the step reads and
writes stays at fixed addresses:

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

Warm-up steps and replays run the same step, so they compute the same values; the eager trainer
(``cuda_graphs=false``) differs only in the learning rate's rounding (a Python float there, a float32
tensor here). A configuration that cannot be captured runs the eager step and says why in one line.
Each replay is timed by a :class:`~dres.train.runlog.ReplayTimer` (the log windows' GPU time against
their wall time, :mod:`dres.train.runlog`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from dres.captured_step import CaptureError, GraphedFunction, StaticInputs
from dres.train import distributed
from dres.train.config import ConfigError
from dres.train.optim import capture_blocker
from dres.train.runlog import ReplayTimer


class NonFiniteLoss(RuntimeError):
    pass


class TrainStep:
    """``step(batch) -> (loss, metrics)``: one optimizer step on ``batch`` (``cfg.accum_steps`` micro-batches
    of ``task.loss`` on ``model`` under ``autocast()``) with device work only, returning the step's mean loss
    and metrics as device tensors; the LR scheduler is stepped by the caller. Besides the optimizer and
    ``scaler`` it updates ``ema`` (name -> fp32 tensor, from ``raw_model``'s parameters) and advances
    ``droppath`` where given, and ORs the loss's non-finiteness into :attr:`bad`, read only at log and
    checkpoint steps (in place, so that a captured step keeps updating the tensor the loop reads)."""

    def __init__(self, task, cfg, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, autocast, device: torch.device, *, ema: dict | None = None,
                 droppath=None):
        self.task, self.cfg, self.model, self.raw_model = task, cfg, model, raw_model
        self.optimizer, self.scaler, self.autocast, self.device = optimizer, scaler, autocast, device
        self.ema, self.droppath = ema, droppath
        self.bad: torch.Tensor | None = None  # the device-side non-finite flag of the steps so far

    def __call__(self, batch: dict):
        cfg, model = self.cfg, self.model
        A = cfg.accum_steps
        n = next(iter(batch.values())).shape[0]
        mb = n // A
        loss_sum = torch.zeros((), device=self.device)
        metrics_sum: dict = {}
        for i in range(A):
            micro = {k: v[i * mb:(i + 1) * mb] for k, v in batch.items()}
            with distributed.set_grad_sync(model, i == A - 1):
                with self.autocast():
                    loss, metrics = self.task.loss(model, micro, cfg)
                self.scaler.scale(loss / A).backward()
            loss_sum += loss.detach().float() / A
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0) + v.detach().float() / A
        if cfg.optim.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)
            gn = nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
            metrics_sum["grad_norm"] = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self._ema_update()
        if self.droppath is not None:
            self.droppath.next_iteration()
        bad = ~torch.isfinite(loss_sum)
        self.bad = bad if self.bad is None else self.bad.logical_or_(bad)
        return loss_sum, metrics_sum

    @torch.no_grad()
    def _ema_update(self):
        params = [p.detach().float() for p in self.raw_model.parameters()]
        torch._foreach_lerp_(list(self.ema.values()), params, 1.0 - self.cfg.optim.ema_decay)


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


def fused_mlp_choice(setting: str, captured: bool) -> bool | None:
    """The :class:`dres.nn.Mlp` path for the ``fused_mlp`` setting: True / False, or None (the module's own
    rule: fused outside torch.compile). ``auto`` fuses a captured step even when it is compiled: the replay
    has no host cost for the opaque op to add, and the op saves a (tokens x hidden) activation."""
    if setting == "auto":
        return True if captured else None
    return setting == "true"


def graph_warmup_steps(cfg, world: int) -> int:
    """Eager steps before the capture: lazy initialisation, compilation and autotuning happen in them."""
    return DDP_WARMUP_STEPS if cfg.dist == "ddp" and world > 1 else 3


def schedule_table(scheduler, total_steps: int, device) -> torch.Tensor:
    """(groups, total_steps + 1) float32: the learning rate a ``LambdaLR`` gives each parameter group
    at every position 0..total_steps (the last value also serves positions past the end)."""
    rows = [[base * fn(i) for i in range(total_steps + 1)]
            for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


class GraphedStep(GraphedFunction):
    """``step(batch) -> (loss, metrics)`` like ``step`` (a :class:`TrainStep`), the step it wraps, captured as
    one CUDA graph after ``warmup_steps`` eager steps (every call is one real training step). The returned
    tensors are the graph's static outputs: read them before the next call (the loop accumulates them).

    What the wrapper reads besides ``step``: the ``optimizer``'s parameter groups (their lr is a device
    tensor inside the step), the LambdaLR ``scheduler`` (its table over ``total_steps`` positions, and its
    position when the first batch comes, after any resume), the ``device``, the ``stream`` it warms up and
    captures on (DDP must have been built on it; a new one when None) and ``log`` for the line that says the
    step was captured. Everything else (scaler, EMA, ResidualDroppath, the non-finite flag) is ``step``'s own
    state, captured with it. Every replay is timed by ``timer`` (a :class:`~dres.train.runlog.ReplayTimer`
    keeping the last ``timed_replays`` of each log window). The warm-up, capture and replay are
    :class:`~dres.captured_step.GraphedFunction`'s (``warmed``, ``graph``, ``outputs``, ``stream``,
    :meth:`release`)."""

    def __init__(self, step, optimizer: torch.optim.Optimizer, scheduler, total_steps: int,
                 device: torch.device, *, warmup_steps: int = 3, timed_replays: int = 128, stream=None, log=print):
        super().__init__(self._step, device, warmup_steps=warmup_steps, stream=stream)
        self.step, self.optimizer, self.scheduler, self.log = step, optimizer, scheduler, log
        self.timer = ReplayTimer(timed_replays)
        self.inputs: StaticInputs | None = None
        self.lr_table = schedule_table(scheduler, total_steps, device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self._index = torch.zeros(1, dtype=torch.int64, device=device)
        self._lrs = torch.zeros(self.lr_table.shape[0], 1, device=device)
        self.lrs = list(self._lrs[:, 0].unbind(0))  # one 0-dim view per parameter group

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
            return self.step(self.inputs.tensors)

    # ------------------------------------------------------------------ per call
    def _load(self, batch: dict):
        if self.inputs is None:
            self.inputs = StaticInputs(batch)
            self.position.fill_(self.scheduler.last_epoch)  # after any resume
        if (k := self.inputs.misfit(batch)) is not None:
            v = batch[k]
            raise ValueError(f"cuda_graphs: batch '{k}' is {tuple(v.shape)} {v.dtype}, but the captured step "
                             f"takes {self.inputs.describe()}; use fixed-size batches or cuda_graphs=false")
        self.inputs.load(batch)

    def _capture(self):
        try:
            self.capture()
        except CaptureError as e:
            raise RuntimeError(f"cuda_graphs: capturing the train step failed ({e}); "
                               "run it eagerly with --set cuda_graphs=false") from e.__cause__
        self.log(f"[dres] cuda graphs: captured the train step after {self.warmed} warm-up steps")

    def __call__(self, batch: dict):
        self._load(batch)
        if self.warming:
            return self.warm_up()
        if self.graph is None:
            self._capture()
        with self.timer.timed():
            return self.replay()
