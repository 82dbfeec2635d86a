"""The one training loop shared by every task.

A *task* (``mae.py``, ``uvit.py``, ``classify.py``) supplies only what differs:

    task.build_model(cfg) -> nn.Module
    task.loss(model, batch, cfg) -> (loss, {name: tensor})      # one micro-batch, under autocast
    task.evaluate(trainer) -> {name: value}                      # probes, samples, ...
    task.curve(trainer) -> {name: value}                         # the cheap one, every eval.every steps

and the :class:`Trainer` composes the rest: data (:mod:`dres.data`), parallelism
(:mod:`dres.train.distributed`), precision, optimizer and schedule, EMA, ResidualDroppath
iteration parity, checkpoints (:mod:`dres.train.checkpoint`) and observability.

Step semantics: one *step* is one optimizer update on ``batch_size`` samples (all ranks, all
micro-batches). The ResidualDroppath controller advances once per step, so the micro-batches of
a step share its parity (and, with equal micro-batch sizes, its masks).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from dres.data import build_loader, lost_data_line
from dres.train import checkpoint as C
from dres.train import distributed as D
from dres.train import rundir
from dres.train.config import Config, ConfigError, fingerprint, save_config, to_dict
from dres.train.graph_step import GraphedStep, graph_plan, graph_warmup_steps, steady_timing
from dres.train.optim import build_optimizer, peak_lr


class NonFiniteLoss(RuntimeError):
    pass


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
    def __init__(self, cfg: Config, task, *, log=print):
        self.cfg, self.task = cfg, task
        self.info = D.init(cfg.device, cfg.dist)
        self.device = self.info.device
        if cfg.threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        self.main = self.info.main
        self._log = log
        self.out = Path(cfg.out or f"runs/{cfg.task}_{cfg.preset or 'custom'}")
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

    def log(self, msg):
        if self.main:
            self._log(msg)

    # ---------------------------------------------------------------- setup
    def setup(self, train=True):
        cfg = self.cfg
        seed_all(cfg.seed)  # identical initial weights on every rank
        model = self.task.build_model(cfg)
        self.raw_model = model.to(self.device)
        self.droppath = getattr(model, "droppath", None)
        self.n_params = sum(p.numel() for p in model.parameters())
        n_ac = D.apply_activation_checkpointing(model, cfg.act_ckpt)
        n_c = D.apply_compile(model) if cfg.compile else 0
        if n_ac or n_c:
            self.log(f"[dres] activation checkpointing '{cfg.act_ckpt}' on {n_ac} units; compiled {n_c} units")
        graphs, why = graph_plan(cfg, self.device, self.precision, self.info.world)
        # the captured step warms up and records on its own stream; DDP must be built on that stream
        capture_stream = torch.cuda.Stream(self.device) if graphs and train else None
        if cfg.dist == "fsdp":
            # bf16 parameters need autocast (FSDP2 casts no inputs): fp32 ones under precision=fp32
            param_dtype = "fp32" if self.precision == "fp32" else cfg.fsdp_param_dtype
            model = D.apply_fsdp(model, self.info, param_dtype, prefetch=cfg.fsdp_prefetch, reshard=cfg.fsdp_reshard,
                                 blocks_per_unit=cfg.fsdp_blocks_per_unit)
        elif cfg.dist == "ddp" and self.info.world > 1:
            # gradients as views into the all-reduce buckets: no per-parameter copy back after the backward
            model = D.apply_ddp(model, self.info, bucket_view=True, stream=capture_stream)
        self.model = model
        # after sharding: the groups must hold the parameters the optimizer will see (DTensors under FSDP)
        groups, nd = param_groups(self.raw_model, cfg.optim.weight_decay)
        self.log(f"[dres] {cfg.task}: {type(self.raw_model).__name__} {self.n_params / 1e6:.2f}M params; "
                 f"{len(nd)} tensors without weight decay; precision {self.precision}; device {self.device}; "
                 f"world {self.info.world} ({cfg.dist})")
        # data: this rank's slice of every global batch
        self.loader = build_loader(cfg.data, "train", cfg.batch_size, rank=self.info.rank, world=self.info.world,
                                   accum=cfg.accum_steps, seed=cfg.seed, device=self.device, train=True,
                                   log=self.log) if train else None
        spe = len(self.loader) if train else 0
        self.total_steps = cfg.steps if cfg.steps > 0 else int(round(cfg.epochs * spe))
        if train and self.total_steps <= 0:
            raise ConfigError("training length is zero: set steps=N or epochs=E (with a data set of known size)")
        o = cfg.optim
        self.lr = peak_lr(cfg)
        warmup = o.warmup_steps if o.warmup_steps >= 0 else int(round(o.warmup_epochs * spe))
        self.warmup = min(warmup, self.total_steps)
        self.optimizer = build_optimizer(cfg, groups, self.device, capturable=graphs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, self.warmup, o.schedule, o.min_lr / self.lr if self.lr else 0))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # EMA of the parameters (fp32; sharded like the parameters under FSDP)
        self.ema = ({n: p.detach().clone().float() for n, p in self.raw_model.named_parameters()}
                    if o.ema_decay > 0 else None)
        self.graphed = (GraphedStep(self, warmup_steps=graph_warmup_steps(cfg, self.info.world), stream=capture_stream)
                        if graphs and train else None)
        if train:
            self.log(f"[dres] cuda graphs: {why}")
        torch.manual_seed(cfg.seed + 1000003 * self.info.rank)  # per-rank randomness (masks, noise)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        if self.main and train:  # the run's record (see rundir); evaluation leaves it as training wrote it
            save_config(cfg, self.out / "config.yaml")
            rundir.write_fingerprint(self.out, fingerprint(cfg))
        return self

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
        if self._bad is not None and bool(self._bad):
            raise NonFiniteLoss("non-finite loss; not saving")
        p = C.save(self.ckpt_dir, self.step, self.model, self.optimizer, self._extra(), dcp_format=self.dcp,
                   keep=self.cfg.ckpt.keep, device=self.device, ema=self.ema)
        self.last_good = p
        return p

    def resume(self, what="auto"):
        """``auto``: the newest readable checkpoint of this run directory (none at all: start fresh);
        or a path. Unreadable or incompatible checkpoints are :class:`~dres.train.checkpoint.CheckpointError`."""
        target = self.ckpt_dir if what == "auto" else Path(what)
        if what != "auto" and not target.exists():
            raise FileNotFoundError(f"checkpoint not found: {target}")
        extra = C.load(target, self.model, self.optimizer, ema=self.ema, device=self.device,
                       fingerprint=fingerprint(self.cfg), log=self.log)
        if extra is None:
            self.log(f"[dres] no checkpoint in {target}; starting from scratch")
            return False
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
        if self.loader is not None and extra.get("data"):
            self.loader.load_state_dict(extra["data"])
        self.step = int(extra["step"])
        self.last_good = Path(extra["path"])
        self.log(f"[dres] resumed from {extra['path']} at step {self.step}")
        aside = C.set_aside_after(self.ckpt_dir, self.step)
        if aside is not None:
            self.log(f"[dres] checkpoints after step {self.step} (skipped or from an abandoned branch) moved to {aside}")
        return True

    def load_weights(self, path):
        extra = C.load(path, self.model, None, ema=self.ema, device=self.device, restore_rng=False,
                       fingerprint=fingerprint(self.cfg), log=self.log)
        if extra is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        self.step, self.loaded_from = int(extra["step"]), extra["path"]
        self.log(f"[dres] loaded weights of step {self.step} from {extra['path']}")

    # ----------------------------------------------------------------- train
    _bad = None
    last_good = None
    loaded_from = None

    @torch.no_grad()
    def _ema_update(self):
        d = self.cfg.optim.ema_decay
        params = [p for n, p in self.raw_model.named_parameters()]
        ema = list(self.ema.values())
        torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1.0 - d)

    def step_body(self, batch):
        """One optimizer step on ``batch`` with device work only (no host sync, so that
        :class:`~dres.train.graph_step.GraphedStep` can capture it): returns the step's mean loss and
        metrics as device tensors. The LR scheduler is stepped by :meth:`train_step`."""
        cfg, model = self.cfg, self.model
        A = cfg.accum_steps
        n = next(iter(batch.values())).shape[0]
        mb = n // A
        loss_sum = torch.zeros((), device=self.device)
        metrics_sum: dict = {}
        for i in range(A):
            micro = {k: v[i * mb:(i + 1) * mb] for k, v in batch.items()}
            with D.set_grad_sync(model, i == A - 1):
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
        # non-finite detection without a per-step host sync: checked at log/checkpoint steps; in place,
        # so that a captured step keeps updating the flag the loop reads
        bad = ~torch.isfinite(loss_sum)
        self._bad = bad if self._bad is None else self._bad.logical_or_(bad)
        return loss_sum, metrics_sum

    def train_step(self, batch):
        """One optimizer step: the captured step when CUDA graphs are on, else :meth:`step_body`."""
        out = self.graphed(batch) if self.graphed is not None else self.step_body(batch)
        self.scheduler.step()
        return out

    def _check_finite(self):
        if self._bad is not None and bool(D.all_sum(self._bad.float().reshape(1))[0] > 0):
            where = f"the last good checkpoint is {self.last_good}" if self.last_good else "no checkpoint was written"
            raise NonFiniteLoss(f"non-finite loss before step {self.step}; stopping ({where}; resume with "
                                f"--resume auto, perhaps with a lower lr or precision=fp32)")

    def epoch(self) -> float | None:
        """Epochs trained, or None where the training data's size is unknown (a stream without counts)."""
        steps_per_epoch = len(self.loader)
        return self.step / steps_per_epoch if steps_per_epoch else None

    def fit(self):
        cfg = self.cfg
        start_step, t0 = self.step, time.time()
        if self.main and cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.out / "tb"))
            except Exception as e:  # tensorboard is optional at run time
                self.tb = None
                self.log(f"[dres] tensorboard disabled ({type(e).__name__})")
        else:
            self.tb = None
        metrics_f = open(self.out / "metrics.jsonl", "a") if self.main else None
        bar = None
        if self.main and cfg.log.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, dynamic_ncols=True, file=sys.stderr)
        acc_loss, acc_n, acc_metrics = torch.zeros((), device=self.device), 0, {}
        t_last, step_last, seen = time.time(), self.step, 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.log(f"[dres] training {self.total_steps} steps (from {self.step}), global batch {cfg.batch_size} "
                 f"({cfg.accum_steps} micro-batches), lr {self.lr:.3g}, warmup {self.warmup}, out {self.out}")
        self.model.train()
        try:
            while self.step < self.total_steps:
                batch = self.loader.next()
                loss, metrics = self.train_step(batch)
                self.step += 1
                seen += cfg.batch_size
                acc_loss += loss
                acc_n += 1
                for k, v in metrics.items():
                    acc_metrics[k] = acc_metrics.get(k, 0) + v
                last = self.step == self.total_steps
                if self.step % cfg.log.every == 0 or last:
                    self._check_finite()
                    vals = torch.stack([acc_loss] + list(acc_metrics.values())) / acc_n
                    vals = D.all_mean(vals).tolist()
                    now = time.time()
                    ips = (self.step - step_last) * cfg.batch_size / max(now - t_last, 1e-9)
                    rec = {"step": self.step, "loss": vals[0], "lr": self.scheduler.get_last_lr()[0],
                           "img_per_s": ips, "epoch": self.epoch()}
                    rec.update({k: v for k, v in zip(acc_metrics, vals[1:])})
                    if self.graphed is not None:  # the replays' GPU time against this window's wall time
                        rec.update(self.graphed.read_window(self.step - step_last, (now - t_last) * 1e3))
                    self.history.append(rec)
                    if self.main:
                        metrics_f.write(json.dumps(rec) + "\n")
                        metrics_f.flush()
                        if self.tb:
                            for k, v in rec.items():
                                if k != "step":
                                    self.tb.add_scalar(f"train/{k}", v, self.step)
                    if bar:
                        bar.set_postfix(loss=f"{vals[0]:.4f}", lr=f"{rec['lr']:.2e}", img_s=f"{ips:.0f}")
                    acc_loss, acc_n, acc_metrics = torch.zeros((), device=self.device), 0, {}
                    t_last, step_last = now, self.step
                if bar:
                    bar.update(1)
                if (cfg.ckpt.every and self.step % cfg.ckpt.every == 0) or last:
                    self._check_finite()
                    self.save()
                if cfg.eval.every and (self.step % cfg.eval.every == 0 or last):
                    self.log(f"[dres] curve point at step {self.step}: {self.curve_point()}")
                    self.model.train()
        finally:
            if bar:
                bar.close()
            if metrics_f:
                metrics_f.close()
        wall = time.time() - t0
        self.summary = {"steps": self.step - start_step, "wall_s": wall,
                        "img_per_s": seen / max(wall, 1e-9),
                        "final_loss": self.history[-1]["loss"] if self.history else None,
                        "peak_mem_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30
                                         if self.device.type == "cuda" else None),
                        "lost_data": self.loader.counter.summary()}
        if self.graphed is not None:  # issue 14 target 3: trainer_vs_replay <= 1.05
            self.summary.update(steady_timing(self.graphed.windows))
        return self.summary

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict:
        self.model.eval()
        with torch.no_grad():
            res = self.task.evaluate(self)
        return res

    def curve_point(self) -> dict:
        """The task's cheap evaluation (``task.curve``), recorded with the step and epoch in
        ``<out>/curves.jsonl`` and drawn to ``<out>/curves.png`` (:mod:`dres.eval.curves`)."""
        from dres.eval import record_point

        self.model.eval()
        with torch.no_grad():
            point = self.task.curve(self)
        if self.main and point:
            point = {"step": self.step, "epoch": self.epoch(), **point}
            record_point(self.out, point)
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
            lost = self.summary["lost_data"]
            lines = [f"[dres] done: {self.summary['steps']} steps in {self.summary['wall_s']:.1f}s, "
                     f"{self.summary['img_per_s']:.1f} img/s, final loss {self.summary['final_loss']}"]
            if self.summary["peak_mem_gib"] is not None:
                lines.append(f"[dres] peak memory {self.summary['peak_mem_gib']:.2f} GiB")
            if lost_data_line(lost):
                lines.append(lost_data_line(lost))
        if self.main:
            with open(self.out / name, "w") as f:
                json.dump(s, f, indent=1, default=str)
            for k, v in (eval_metrics or {}).items():
                lines.append(f"[dres] {k}: {v:.4f}" if isinstance(v, float) else f"[dres] {k}: {v}")
            self.log("\n".join(lines))
        if getattr(self, "tb", None):
            for k, v in (eval_metrics or {}).items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"eval/{k}", v, self.step)
            self.tb.close()
        return s

    # ------------------------------------------------------ eval helpers
    def full_state_copy(self):
        """A plain (unsharded) copy of the model for evaluation on one rank; EMA weights if kept."""
        import copy

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


def run(cfg: Config, task, *, resume=None, eval_only=False, ckpt=None, overwrite=False, log=print) -> dict:
    """Train (or only evaluate) one configuration end to end; returns the summary. A training run
    first claims its run directory (:func:`dres.train.rundir.claim`: ``resume``/``overwrite``)."""
    tr = Trainer(cfg, task, log=log)
    if not eval_only:
        rundir.claim(tr.out, cfg, resume=resume, overwrite=overwrite, main=tr.main, log=tr.log)
        D.barrier()
    tr.setup(train=not eval_only)
    try:
        if eval_only:
            tr.load_weights(ckpt or tr.ckpt_dir)
            ev = tr.evaluate() if tr.main or cfg.dist != "none" else {}
            return tr.finish(ev, eval_only=True)
        if resume:
            tr.resume(resume)
        tr.fit()
        ev = tr.evaluate()
        return tr.finish(ev)
    finally:
        if tr.graphed is not None:
            tr.graphed.release()
        D.barrier()
