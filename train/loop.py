"""The one training loop shared by every task.

A *task* (``mae.py``, ``uvit.py``, ``classify.py``, registered in :mod:`dres.train.tasks`) supplies only
what differs: its model builder, loss, evaluation and curve point; the :class:`Trainer` composes the rest:
data (:mod:`dres.data`), parallelism (:mod:`dres.train.distributed`), precision, optimizer and schedule,
EMA, ResidualDroppath iteration parity, checkpoints (:mod:`dres.train.checkpoint`) and observability.

Step semantics: one *step* is one optimizer update on ``batch_size`` samples (all ranks, all
micro-batches). The ResidualDroppath controller advances once per step, so the micro-batches of
a step share its parity (and, with equal micro-batch sizes, its masks).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from dres.data import build_loader, lost_data_line
from dres.models.flops import training_flops
from dres.nn import set_backend, set_fused_mlp
from dres.train import checkpoint
from dres.train import distributed
from dres.train import rundir
from dres.train.common import dense_bf16_peak, flops_rate_text, model_flops_rate
from dres.train.config import Config, ConfigError, cpu_threads, dotted_value, fingerprint, save_config, to_dict
from dres.train.optim import build_optimizer, peak_lr
from dres.train.runlog import LogFile, RunLog, open_tensorboard, open_wandb, steady_timing
from dres.train.step import GraphedStep, NonFiniteLoss, TrainStep, graph_plan, graph_warmup_steps
from dres.train.stop import EXIT_INTERRUPTED, Interrupted


# keys a resume may change: applied to the optimizer's groups and the LR schedule after its state is loaded
RESUME_APPLIED = ("steps", "epochs", "accum_steps", "optim.lr", "optim.blr", "optim.min_lr", "optim.weight_decay",
                  "optim.betas", "optim.eps", "optim.momentum", "optim.schedule", "optim.warmup_steps",
                  "optim.warmup_epochs", "optim.clip_grad", "optim.label_smoothing", "optim.fused")
# keys a resume may not change: the checkpoint carries the random streams and data order they decided
RESUME_FIXED = ("seed",)


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_precision(p: str, device: torch.device) -> str:
    if p == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return p


def param_groups(model: nn.Module, weight_decay: float):
    """AdamW groups: no weight decay on biases, norms (all 1-D tensors), tokens and position
    embeddings (MAE / timm convention)."""
    decay, no_decay, names = [], [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = n.split(".")[-1]
        if p.ndim < 2 or "token" in leaf or "pos_embed" in leaf or leaf in ("cls", "pos", "alpha"):
            no_decay.append(p)
            names.append(n)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], names


def fused_mlp_choice(setting: str, captured: bool) -> bool | None:
    """The :class:`dres.nn.Mlp` path for the ``fused_mlp`` setting: True / False, or None (the module's own
    rule: fused outside torch.compile). ``auto`` fuses a captured step even when it is compiled: the replay
    has no host cost for the opaque op to add, and the op saves a (tokens x hidden) activation."""
    if setting == "auto":
        return True if captured else None
    return setting == "true"


def lr_lambda(total: int, warmup: int, schedule: str, min_ratio: float):
    """Per-iteration factor of the peak lr: linear warmup, then half-cycle cosine to ``min_ratio``
    (MAE) or constant (U-ViT)."""

    def f(step):
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))

    return f


class Trainer:
    """One run of ``task`` under ``cfg``: :meth:`setup`, then :meth:`fit`, :meth:`evaluate` and :meth:`finish`
    (or :meth:`resume` / :meth:`load_weights` first). ``log`` prints a line; ``graph_warmup_steps``: the
    eager steps before a captured step's capture (None: :func:`~dres.train.step.graph_warmup_steps`,
    what lazy initialisation and DDP need; more than the run's steps: the same body, never captured)."""

    def __init__(self, cfg: Config, task, *, log=print, graph_warmup_steps: int | None = None):
        self.cfg, self.task = cfg, task
        self.graph_warmup_steps = graph_warmup_steps
        self.info = distributed.init(cfg.device, cfg.dist, cfg.dist_timeout_s)
        self.device = self.info.device
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(cfg))
        self.main = self.info.main
        self._log = log
        self.out = Path(cfg.out or f"runs/{cfg.task}_{cfg.preset or 'custom'}")
        cfg.out = str(self.out)  # config.yaml records where the run went, the default resolved
        self.ckpt_dir = self.out / "checkpoints"
        self.precision = resolve_precision(cfg.precision, self.device)
        if self.precision == "fp16" and self.device.type == "cpu":
            raise ConfigError("precision fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
        if cfg.dist == "fsdp" and cfg.ckpt.format == "file":
            self.dcp = False
        else:
            self.dcp = cfg.ckpt.format == "dcp" or (cfg.ckpt.format == "auto" and cfg.dist == "fsdp")
        self.step = 0
        self.history: list[dict] = []
        self.summary: dict = {}
        self.eval_wall_s: float | None = None  # the last evaluate()'s wall time
        self.stop_signal: str | None = None  # set by StopOnSignal
        self.in_loop = False
        self.last_record: dict | None = None  # metrics.jsonl's last record kept on resume
        self.last_good: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.loaded_from: str | None = None  # the checkpoint load_weights read
        self.flops_per_image: float | None = None  # model FLOPs of one training image (_count_flops)
        self.peak_tflops: float | None = None  # the card's dense bf16 peak, the denominator of mfu
        self.log_file = LogFile()  # <out>/log.txt, a copy of what the main rank printed
        # built by setup
        self.raw_model: nn.Module | None = None  # the model before DDP / FSDP2 / whole-model compile
        self.model: nn.Module | None = None  # what the step calls
        self.droppath = None  # the model's ResidualDroppath controller, if any
        self.n_params = 0
        self.loader = None  # training batches (None when only evaluating)
        self.total_steps = 0
        self.lr = 0.0  # peak learning rate
        self.warmup = 0  # warm-up steps of the schedule
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.ema: dict | None = None  # fp32 EMA of the parameters (optim.ema_decay > 0)
        self.step_body: TrainStep | None = None  # the eager step (train/step.py), its non-finite flag included
        self.graphed: GraphedStep | None = None  # the captured step (None: the step runs eagerly)
        self.step_fn = None  # the step train_step runs: graphed or step_body, chosen once in setup
        self.data_stream = None  # the CUDA stream batches are made on (data.side_stream), else the step's
        # used by fit, evaluation and finish
        self.tb = None  # the TensorBoard writer (main rank, log.tensorboard)
        self.eval_loaders: dict = {}  # split -> its evaluation loader or None (train.common.eval_loader)

    def log(self, msg):
        if self.main:
            self._log(msg)
            self.log_file.write(msg)

    def start_log(self):
        """From now on :meth:`log` also appends to ``<out>/log.txt``, starting with what it printed before."""
        if self.main:
            self.log_file.open(self.out / "log.txt")

    # ---------------------------------------------------------------- setup
    def setup(self, train=True):
        cfg = self.cfg
        seed_all(cfg.seed)  # identical initial weights on every rank
        model = self.task.build_model(cfg)
        self.raw_model = model.to(self.device)
        self.droppath = getattr(model, "droppath", None)
        self.n_params = sum(p.numel() for p in model.parameters())
        n_checkpointed = distributed.apply_activation_checkpointing(model, cfg.act_ckpt)
        per_block = cfg.compile and cfg.compile_scope == "blocks"
        n_compiled = distributed.apply_compile(model) if per_block else 0
        graphs, why = graph_plan(cfg, self.device, self.precision, self.info.world)
        set_fused_mlp(model, fused_mlp_choice(cfg.fused_mlp, captured=graphs and train))
        if graphs and train and cfg.model.backend is None:
            # capture takes the Triton kernels: the eager warm-up steps take them too, so that they compute
            # what the replays compute (the default picks the csrc kernels for eager calls when built)
            set_backend(model, "triton")
        # the captured step warms up and records on its own stream; DDP must be built on that stream
        capture_stream = torch.cuda.Stream(self.device) if graphs and train else None
        if cfg.dist == "fsdp":
            # bf16 parameters need autocast (FSDP2 casts no inputs): fp32 ones under precision=fp32
            param_dtype = "fp32" if self.precision == "fp32" else cfg.fsdp_param_dtype
            model = distributed.apply_fsdp(model, self.info, param_dtype, prefetch=cfg.fsdp_prefetch, reshard=cfg.fsdp_reshard,
                                 blocks_per_unit=cfg.fsdp_blocks_per_unit)
        elif cfg.dist == "ddp" and self.info.world > 1:
            # gradients as views into the all-reduce buckets: no per-parameter copy back after the backward
            model = distributed.apply_ddp(model, self.info, bucket_view=True, stream=capture_stream)
        if cfg.compile and cfg.compile_scope == "model":
            n_compiled = distributed.apply_compile(model, "model")
        if n_checkpointed or n_compiled:
            self.log(f"[dres] activation checkpointing '{cfg.act_ckpt}' on {n_checkpointed} units; "
                     f"compiled {n_compiled} {'units' if per_block else 'region (the whole model)'}")
        self.model = model
        # after sharding: the groups must hold the parameters the optimizer will see (DTensors under FSDP)
        groups, nd = param_groups(self.raw_model, cfg.optim.weight_decay)
        self.log(f"[dres] {cfg.task}: {type(self.raw_model).__name__} {self.n_params / 1e6:.2f}M params; "
                 f"{len(nd)} tensors without weight decay; precision {self.precision}; device {self.device}; "
                 f"world {self.info.world} ({cfg.dist})")
        # data: this rank's slice of every global batch
        self.loader = build_loader(cfg.data, "train", cfg.batch_size, rank=self.info.rank, world=self.info.world,
                                   accum=cfg.accum_steps, seed=cfg.seed, device=self.device, train=True,
                                   log=self.log, compile_augment=cfg.compile and self.device.type == "cuda") \
            if train else None
        if train:
            self.log(f"[dres] data: {cfg.data.name}, {self.loader.describe()}")
        epoch_steps = len(self.loader) if train else 0
        if train and cfg.data.side_stream and self.device.type == "cuda":
            self.data_stream = torch.cuda.Stream(self.device)
        if train:
            self._count_flops()
        self.total_steps = cfg.steps if cfg.steps > 0 else int(round(cfg.epochs * epoch_steps))
        if train and self.total_steps <= 0:
            raise ConfigError("training length is zero: set steps=N or epochs=E (with a data set of known size)")
        o = cfg.optim
        self.lr = peak_lr(cfg)
        warmup = o.warmup_steps if o.warmup_steps >= 0 else int(round(o.warmup_epochs * epoch_steps))
        self.warmup = min(warmup, self.total_steps)
        self.optimizer = build_optimizer(cfg, groups, self.device, self.precision, capturable=graphs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, self.warmup, o.schedule, o.min_lr / self.lr if self.lr else 0))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # EMA of the parameters (fp32; sharded like the parameters under FSDP)
        self.ema = ({n: p.detach().clone().float() for n, p in self.raw_model.named_parameters()}
                    if o.ema_decay > 0 else None)
        self.step_body = TrainStep(self.task, cfg, self.model, self.raw_model, self.optimizer, self.scaler,
                                   self.autocast, self.device, ema=self.ema, droppath=self.droppath)
        if graphs and train:
            eager_steps = (self.graph_warmup_steps if self.graph_warmup_steps is not None
                           else graph_warmup_steps(cfg, self.info.world))
            self.graphed = GraphedStep(self.step_body, self.optimizer, self.scheduler, self.total_steps, self.device,
                                       warmup_steps=eager_steps, stream=capture_stream, log=self.log)
        self.step_fn = self.graphed if self.graphed is not None else self.step_body
        if train:
            self.log(f"[dres] cuda graphs: {why}")
        torch.manual_seed(cfg.seed + 1000003 * self.info.rank)  # per-rank randomness (masks, noise)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        return self

    def _count_flops(self):
        """The model FLOPs of one training image (forward + backward, :mod:`dres.models.flops`) and the
        card's dense bf16 peak, for ``model_tflops`` and ``mfu`` in metrics.jsonl, summary.json and the log."""
        cfg = self.cfg
        micro = cfg.batch_size // (self.info.world * cfg.accum_steps)  # the loader has checked it divides
        flops = training_flops(self.raw_model, micro, cfg.model.img_size)
        self.flops_per_image = flops / micro if flops is not None else None
        name, self.peak_tflops = dense_bf16_peak(self.device)
        if self.flops_per_image is None:
            self.log(f"[dres] note: no FLOP count for a {type(self.raw_model).__name__}; model_tflops and mfu "
                     "are not reported")
            return
        counted = f"[dres] model FLOPs: {self.flops_per_image / 1e9:.4g} GFLOP per training image (forward + backward)"
        if self.peak_tflops is None:
            self.log(f"{counted}; note: mfu is not reported, no dense bf16 peak is known for {name}")
        else:
            self.log(f"{counted}; mfu against the dense bf16 peak of {name}, {self.peak_tflops:g} TFLOP/s")

    def write_record(self):
        """The run's record (see rundir), written when training starts, so that a start refused before
        (a missing or incompatible checkpoint) leaves nothing; evaluation leaves it as training wrote it."""
        if self.main:
            rundir.publish(self.out / "config.yaml", lambda tmp: save_config(self.cfg, tmp))
            rundir.write_fingerprint(self.out, fingerprint(self.cfg))
            rundir.record_start(self.out, self.device, self.info.world, self.step)
            self.start_log()

    def autocast(self):
        if self.precision == "fp32":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    # ------------------------------------------------------------ checkpoint
    def _extra(self):
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "data": self.loader.state_dict() if self.loader else None, "config": to_dict(self.cfg),
                "fingerprint": fingerprint(self.cfg), "history_len": len(self.history)}

    def save(self):
        if self.step_body.bad is not None and bool(self.step_body.bad):
            raise NonFiniteLoss("non-finite loss; not saving")
        p = checkpoint.save(self.ckpt_dir, self.step, self.model, self.optimizer, self._extra(), dcp_format=self.dcp,
                   keep=self.cfg.ckpt.keep, device=self.device, ema=self.ema)
        self.last_good = p
        return p

    def resume(self, what="auto"):
        """``auto``: the newest readable checkpoint of this run directory (none at all: start fresh);
        or a path. Unreadable or incompatible checkpoints are :class:`~dres.train.checkpoint.CheckpointError`.

        The settings of :data:`RESUME_APPLIED` may differ from the checkpoint's: its optimizer state is
        loaded, then the current config's weight decay, betas, eps and momentum are set on the parameter
        groups and the LR schedule (peak lr, min_lr, warmup, length) is recomputed at the resumed step,
        so what config.yaml and the logs say is what the optimizer uses. :data:`RESUME_FIXED` keys are
        refused. Records of metrics.jsonl and curves.jsonl past the resumed step are moved to
        ``*.superseded.jsonl``, so the logs hold one history."""
        target = self.ckpt_dir if what == "auto" else Path(what)
        if what != "auto" and not target.exists():
            raise FileNotFoundError(f"checkpoint not found: {target}")
        built = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        extra = checkpoint.load(target, self.model, self.optimizer, ema=self.ema, device=self.device,
                       fingerprint=fingerprint(self.cfg), log=self.log)
        if extra is None:
            self.log(f"[dres] no checkpoint in {target}; starting from scratch")
            return False
        step, path = int(extra["step"]), Path(extra["path"])
        changed = self._changed_settings(extra.get("config") or {}, path)
        if step > self.total_steps:
            raise ConfigError(f"checkpoint {path} is at step {step}, past this run's length ({self.total_steps} steps); "
                              f"resume with --set steps=N, N >= {step}")
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
        if self.loader is not None and extra.get("data"):
            self.loader.load_state_dict(extra["data"])
        self._apply_settings(built)
        self.step = step
        self.last_good = path
        self.log(f"[dres] resumed from {path} at step {self.step}")
        if changed:
            self.log(f"[dres] settings changed since the checkpoint, applied from step {self.step} (the lr schedule "
                     f"recomputed): {changed}")
        aside = checkpoint.set_aside_after(self.ckpt_dir, self.step)
        if aside is not None:
            self.log(f"[dres] checkpoints after step {self.step} (skipped or from an abandoned branch) moved to {aside}")
        if self.main:
            for name in ("metrics.jsonl", "curves.jsonl"):
                kept, cut = rundir.cut_records(self.out / name, self.step)
                if cut:
                    self.log(f"[dres] {cut} records of {name} after step {self.step} moved to "
                             f"{rundir.superseded_name(name)}")
                if name == "metrics.jsonl" and kept:
                    self.last_record = kept[-1]
        return True

    def _changed_settings(self, saved: dict, path) -> str:
        """The :data:`RESUME_APPLIED` keys that differ from the checkpoint's config (one line), after
        refusing a change of a :data:`RESUME_FIXED` key."""
        now = to_dict(self.cfg)
        for key in RESUME_FIXED:
            was, is_now = dotted_value(saved, key), dotted_value(now, key)
            if saved and was != is_now:
                raise ConfigError(f"{key} cannot change on resume: checkpoint {path} continues the random streams "
                                  f"and data order of {key}={was!r} (now {is_now!r}); resume with "
                                  f"--set {key}={was}, or start a new run")
        return ", ".join(f"{k} {dotted_value(saved, k)!r} -> {dotted_value(now, k)!r}" for k in RESUME_APPLIED
                         if saved and dotted_value(saved, k) != dotted_value(now, k))

    def _apply_settings(self, built: list[dict]):
        """Set the hyper-parameters ``built`` from the current config on the parameter groups (loading the
        optimizer state replaced them with the checkpoint's), and recompute the schedule's lr at its position."""
        for g, fresh in zip(self.optimizer.param_groups, built):
            g.update(fresh)
        self.scheduler.base_lrs = [fresh["initial_lr"] for fresh in built]
        self.scheduler.last_epoch -= 1  # step() advances it back, setting each group's lr for that position
        self.scheduler.step()

    def load_weights(self, path):
        extra = checkpoint.load(path, self.model, None, ema=self.ema, device=self.device, restore_rng=False,
                       fingerprint=fingerprint(self.cfg), log=self.log)
        if extra is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        self.step, self.loaded_from = int(extra["step"]), extra["path"]
        self.log(f"[dres] loaded weights of step {self.step} from {extra['path']}")

    # ----------------------------------------------------------------- train
    def train_step(self, batch):
        """One optimizer step: ``step_fn`` (the captured step when CUDA graphs are on, else
        :meth:`step_body`), then the host's LR schedule."""
        out = self.step_fn(batch)
        self.scheduler.step()
        return out

    def _checkpoint_kept(self) -> str:
        """What a run that stops now still has, for its message."""
        return f"the last good checkpoint is {self.last_good}" if self.last_good else "no checkpoint was written"

    def _check_finite(self):
        bad = self.step_body.bad
        if bad is not None and bool(distributed.all_sum(bad.float().reshape(1))[0] > 0):
            raise self._non_finite()

    def _non_finite(self) -> NonFiniteLoss:
        return NonFiniteLoss(f"non-finite loss before step {self.step}; stopping ({self._checkpoint_kept()}; "
                             f"resume with --resume auto, perhaps with a lower lr or precision=fp32)")

    def epoch(self) -> float | None:
        """Epochs trained, or None where the training data's size is unknown (a stream without counts)."""
        steps_per_epoch = len(self.loader)
        return self.step / steps_per_epoch if steps_per_epoch else None

    def _next_batch(self) -> dict:
        """The loader's next batch. With a data stream its GPU work runs there, beside the step already queued on
        the step's stream (which waits for the batch, and keeps its memory from reuse until it has read it)."""
        if self.data_stream is None:
            return self.loader.next()
        step_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.data_stream):
            batch = self.loader.next()
        step_stream.wait_stream(self.data_stream)
        for t in batch.values():
            if t.is_cuda:
                t.record_stream(step_stream)
        return batch

    def _read_window(self, window: dict, runlog: RunLog) -> bool:
        """Read a log window's record (:meth:`RunLog.read_window`) into the history and return whether any rank
        asked to stop; raise :class:`NonFiniteLoss` if a loss anywhere was not finite."""
        rec, asked_anywhere = runlog.read_window(window)
        if rec is None:
            raise self._non_finite()
        self.history.append(rec)
        if asked_anywhere and self.stop_signal is None:
            self.stop_signal = "a signal to another rank"
        return asked_anywhere

    def fit(self, until: int | None = None):
        """Train to ``total_steps``, or stop after step ``until`` as a run cut short there would (its schedule
        that of all ``total_steps``, a checkpoint at ``until``; a later ``fit`` or resume goes on). On a
        signal (:class:`StopOnSignal`) the step under way is finished, a checkpoint is written and
        :class:`Interrupted` raised: with one process after that step; with several after the step that
        follows the next log step (the log step itself when it saves or evaluates), where the ranks agree
        on it in the all-reduce that already carries the logged metrics (no collective or host sync is
        added to the steps between). A log step's record is read from the GPU after the next step is
        issued, so the GPU never waits for the host's logging, and goes to the
        :class:`~dres.train.runlog.RunLog` (metrics.jsonl, TensorBoard, the progress bar)."""
        cfg = self.cfg
        if until is not None and not 0 < until <= self.total_steps:
            raise ValueError(f"until must be in 1..{self.total_steps} (the run's steps), got {until}")
        end = self.total_steps if until is None else until
        start_step, t0 = self.step, time.time()
        self.write_record()
        # a resumed run hides the events its predecessor logged after the checkpoint, as metrics.jsonl cuts them
        self.tb = (open_tensorboard(self.out / "tb", self._checkpoint_kept, self.log,
                                    purge_step=self.step + 1 if self.step else None)
                   if self.main and cfg.log.tensorboard else None)
        runlog = RunLog(self.out / "metrics.jsonl", main=self.main, tb=self.tb, show_progress=cfg.log.progress,
                        total=self.total_steps, initial=self.step, kept=self._checkpoint_kept,
                        batch_size=cfg.batch_size, rate=self._flops_rate,
                        timer=self.graphed.timer if self.graphed is not None else None, write=self.log,
                        wandb=open_wandb(self.out, to_dict(cfg)) if self.main and cfg.log.wandb else None)
        plain_log, self._log = self._log, runlog.around_bar(self._log)  # messages clear the bar's line first
        acc_loss, acc_n, acc_metrics = torch.zeros((), device=self.device), 0, {}
        step_last, seen = self.step, 0
        pending = None  # the last log step's record on its way to the host
        if self.data_stream is not None:  # the loader's tensors were made on the step's stream
            self.data_stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.log(f"[dres] training {self.total_steps} steps (from {self.step}), global batch {cfg.batch_size} "
                 f"({cfg.accum_steps} micro-batch{'es' if cfg.accum_steps > 1 else ''}), lr {self.lr:.3g}, "
                 f"warmup {self.warmup}, out {self.out}")
        self.model.train()
        self.in_loop = True
        try:
            while self.step < end:
                waited = time.perf_counter()
                batch = self._next_batch()
                runlog.waited_for_data(time.perf_counter() - waited)
                loss, metrics = self.train_step(batch)
                self.step += 1
                seen += cfg.batch_size
                acc_loss += loss
                acc_n += 1
                for k, v in metrics.items():
                    acc_metrics[k] = acc_metrics.get(k, 0) + v
                last = self.step == end
                # one process stops after any step (a host flag, no sync); several agree at log steps, below
                stop = self.stop_signal is not None and self.info.world == 1
                if pending is not None:  # read now that this step is queued behind it: the GPU does not wait
                    stop = self._read_window(pending, runlog) or stop
                    pending = None
                if self.step % cfg.log.every == 0 or last:
                    pending = runlog.close_window(step=self.step, steps=self.step - step_last,
                                                  lr=self.scheduler.get_last_lr()[0], epoch=self.epoch(),
                                                  loss_sum=acc_loss, n=acc_n, metrics=acc_metrics,
                                                  stop_asked=self.stop_signal is not None, bad=self.step_body.bad)
                    acc_loss, acc_n, acc_metrics = torch.zeros((), device=self.device), 0, {}
                    step_last = self.step
                save = bool(cfg.ckpt.every and self.step % cfg.ckpt.every == 0) or last or stop
                curve = bool(cfg.eval.every and (self.step % cfg.eval.every == 0 or last))
                flag_read = False  # whether every rank's non-finite flag up to this step was read
                if pending is not None and (save or curve):  # these wait for the GPU anyway
                    stop = self._read_window(pending, runlog) or stop  # this step's window, flag included
                    pending, flag_read = None, True
                    save = save or stop
                runlog.advance()
                if save:
                    if not flag_read:
                        self._check_finite()
                    self.save()
                if stop:
                    raise Interrupted(self._stopped_message())
                if curve:
                    self.log(f"[dres] curve point at step {self.step}: {self.curve_point()}")
                    self.model.train()
        finally:
            self.in_loop = False
            runlog.close()
            self._log = plain_log
        wall = time.time() - t0
        final = self.history[-1] if self.history else self.last_record
        ips = seen / max(wall, 1e-9)
        self.summary = {"steps": self.step - start_step, "step": self.step, "wall_s": wall, "img_per_s": ips,
                        "gflop_per_image": self.flops_per_image / 1e9 if self.flops_per_image is not None else None,
                        **self._flops_rate(ips), "peak_bf16_tflops": self.peak_tflops,
                        "final_loss": final["loss"] if final else None,
                        "peak_mem_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30
                                         if self.device.type == "cuda" else None),
                        "lost_data": self.loader.counter.summary()}
        if self.graphed is not None:  # how close the trainer's steps come to the replays' GPU time
            self.summary.update(steady_timing(self.graphed.timer.windows))
        return self.summary

    def _flops_rate(self, img_per_s: float) -> dict:
        return model_flops_rate(img_per_s, self.flops_per_image, self.info.world, self.peak_tflops)

    def _stopped_message(self) -> str:
        done = self.step == self.total_steps
        then = (f"training is complete, evaluate with dres-eval {self.out}" if done
                else "continue with --resume auto")
        return (f"stopped by {self.stop_signal} after step {self.step} of {self.total_steps}: checkpoint "
                f"{self.last_good} written; {then} (exit status {EXIT_INTERRUPTED})")

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict:
        t0 = time.time()
        self.log(f"[dres] evaluating step {self.step} ({self.task.name})")
        self.model.eval()
        with torch.no_grad():
            res = self.task.evaluate(self)
        self.eval_wall_s = time.time() - t0
        self.log(f"[dres] evaluation done in {self.eval_wall_s:.1f}s")
        return res

    def curve_point(self) -> dict:
        """The task's cheap evaluation (``task.curve``), recorded with the step and epoch in
        ``<out>/curves.jsonl`` and drawn to ``<out>/curves.png`` (:mod:`dres.eval.curves`)."""
        from dres.eval import log_results, record_point

        self.model.eval()
        with torch.no_grad():
            point = self.task.curve(self)
        if self.main and point:
            point = {"step": self.step, "epoch": self.epoch(), **point}
            record_point(self.out, point)
            if self.tb:
                log_results(self.tb, self.step, point, "curve")
        return point

    def finish(self, eval_metrics: dict | None = None, *, eval_only=False):
        """Write the results: after training ``summary.json`` (evaluation under "eval"); after an
        evaluation alone ``eval.json``, so the training summary stays as training wrote it."""
        if eval_only:
            s, name, lines = {"step": self.step, "checkpoint": self.loaded_from, "eval": eval_metrics or {}}, "eval.json", []
        else:
            s, name = dict(self.summary), "summary.json"
            if eval_metrics:
                s["eval"] = eval_metrics
            lost, final_loss = self.summary["lost_data"], self.summary["final_loss"]
            lines = [f"[dres] done: {self.summary['steps']} steps in {self.summary['wall_s']:.1f}s, "
                     f"{self.summary['img_per_s']:.1f} img/s"
                     f"{flops_rate_text(self.summary) if self.device.type == 'cuda' else ''}, "  # a CPU's is no GPU's
                     f"final loss {'none' if final_loss is None else f'{final_loss:.4f}'}"]
            if self.summary["peak_mem_gib"] is not None:
                lines.append(f"[dres] peak memory {self.summary['peak_mem_gib']:.2f} GiB")
            if lost_data_line(lost):
                lines.append(lost_data_line(lost))
        if eval_metrics:
            s["eval_wall_s"] = self.eval_wall_s
        if self.main:
            rundir.write_atomic(self.out / name, json.dumps(s, indent=1, default=str))
            for k, v in (eval_metrics or {}).items():
                lines.append(f"[dres] {k}: {v:.4f}" if isinstance(v, float) else f"[dres] {k}: {v}")
            self.log("\n".join(lines))
        if self.tb:
            from dres.eval import log_hparams, log_results

            log_results(self.tb, self.step, eval_metrics or {}, "eval")
            log_hparams(self.tb, to_dict(self.cfg), {"final_loss": s.get("final_loss"), **(eval_metrics or {})})
            self.tb.close()
        return s

    # ------------------------------------------------------ eval helpers
    def full_state_copy(self):
        """A plain (unsharded) copy of the model for evaluation on one rank; EMA weights if kept."""
        m = self.raw_model
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for p in m.parameters())
        if not sharded and self.ema is None:
            return m
        sd = {}
        for k, v in m.state_dict().items():
            sd[k] = v.full_tensor() if isinstance(v, DTensor) else v
        if self.ema is not None:
            for k, v in self.ema.items():
                sd[k] = v.full_tensor() if isinstance(v, DTensor) else v
        fresh = self.task.build_model(self.cfg).to(self.device)
        fresh.load_state_dict(sd)
        return fresh.eval()


class StopOnSignal:
    """While training, SIGTERM and SIGINT (what schedulers send before they kill, and Ctrl-C) ask
    :meth:`Trainer.fit` to finish its step, save and stop (:class:`Interrupted`); before the loop and
    during the final evaluation, when there is no step to finish, they raise :class:`Interrupted` at
    once. After the first signal both signals take their default action again, so a second one ends
    the process at once (the checkpoint being written, if any, stays a temporary the next resume
    ignores). Only the main thread can take signals; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.previous: dict = {}
        self.pid = os.getpid()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.getsignal(s) for s in self.SIGNALS}
            for s in self.SIGNALS:
                signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data-loader worker: it reacts as it would without this handler
            previous = self.previous.get(signum, signal.SIG_DFL)
            if callable(previous):
                return previous(signum, frame)
            if previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        trainer, name = self.trainer, signal.Signals(signum).name
        trainer.stop_signal = name
        if not trainer.in_loop:
            if trainer.summary:  # fit() has returned
                where = (f"during the evaluation after step {trainer.step}; the checkpoint {trainer.last_good} is written, "
                         f"evaluate it with dres-eval {trainer.out}")
            else:
                where = "before training started" + (f" (from {trainer.last_good})" if trainer.last_good else "")
            raise Interrupted(f"stopped by {name} {where} (exit status {EXIT_INTERRUPTED})")
        wait = "this step" if trainer.info.world == 1 else f"the next log step (log.every={trainer.cfg.log.every})"
        trainer.log(f"[dres] {name}: stopping after {wait} with a checkpoint; a second signal stops at once, unsaved")

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        return False


def run(cfg: Config, task, *, resume=None, eval_only=False, ckpt=None, overwrite=False, log=print) -> dict:
    """Train (or only evaluate) one configuration end to end; returns the summary. A training run
    first takes the run lock and claims its run directory (:mod:`dres.train.rundir`:
    ``resume``/``overwrite``); a start refused before training begins leaves nothing behind."""
    trainer = Trainer(cfg, task, log=log)
    if eval_only:
        trainer.setup(train=False)
        try:
            trainer.load_weights(ckpt or trainer.ckpt_dir)
            trainer.start_log()
            ev = trainer.evaluate() if trainer.main or cfg.dist != "none" else {}
            return trainer.finish(ev, eval_only=True)
        finally:
            distributed.barrier()
    lock, created, started = None, rundir.first_missing(trainer.out) if trainer.main else None, False
    try:
        with StopOnSignal(trainer):
            lock = distributed.on_main(lambda: _claim(trainer, resume, overwrite), trainer.main)
            trainer.setup()
            if resume and trainer.resume(resume) and trainer.step == trainer.total_steps and (trainer.out / "summary.json").exists():
                return _finished(trainer)
            started = True
            trainer.fit()
            ev = trainer.evaluate()
            return trainer.finish(ev)
    except Exception as e:
        if trainer.log_file.path is not None:  # the one line the command line prints, in the run's log too
            trainer.log_file.write(f"[dres] {'' if isinstance(e, Interrupted) else 'error: '}{' '.join(str(e).split())}")
        raise
    finally:
        if trainer.graphed is not None:
            trainer.graphed.release()
        if lock is not None:
            lock.release()
        if not started and trainer.main:
            rundir.remove_created(trainer.out, created)
        distributed.barrier()


def _claim(trainer: Trainer, resume, overwrite) -> rundir.RunLock:
    lock = rundir.RunLock(trainer.out).acquire(trainer.log)
    try:
        rundir.claim(trainer.out, trainer.cfg, resume=resume, overwrite=overwrite, log=trainer.log)
    except BaseException:
        lock.release()
        raise
    return lock


def _finished(trainer: Trainer) -> dict:
    """A resume of a run that is complete: its results stay as they are."""
    trainer.log(f"[dres] the run in {trainer.out} is finished (step {trainer.step} of {trainer.total_steps}; results in "
           f"{trainer.out / 'summary.json'}); nothing was changed. To train it longer: --resume auto --set steps=N with "
           f"N > {trainer.step}; to evaluate it again: dres-eval {trainer.out}")
    return json.loads((trainer.out / "summary.json").read_text())
