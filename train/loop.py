"""The one training loop shared by every task.

A *task* (``mae.py``, ``uvit.py``, ``classify.py``, registered in :mod:`dres.train.tasks`) supplies only
what differs: its model builder, loss, evaluation and curve point; the :class:`Trainer` composes the rest: data
(:mod:`dres.data`), parallelism (:mod:`~dres.train.distributed`), the step (:mod:`~dres.train.step`), optimizer and
schedule (:mod:`~dres.train.optim`), resume (:mod:`~dres.train.resume`) and results (:mod:`~dres.train.results`).

Step semantics: one *step* is one optimizer update on ``batch_size`` samples (all ranks, all
micro-batches). The ResidualDroppath controller advances once per step, so the micro-batches of
a step share its parity (and, with equal micro-batch sizes, its masks).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn

from dres.data import build_loader, widen_hardware_queues
from dres.nn import set_backend, set_fused_mlp
from dres.train import checkpoint, distributed, resume, results, tasks
from dres.train.common import resolve_precision, seed_all
from dres.train.config import Config, ConfigError, cpu_threads, to_dict
from dres.train.rundir import fingerprint
from dres.train.optim import build_optimizer, build_schedule, param_groups, peak_lr
from dres.train.runlog import LogFile, RunLog
from dres.train.step import GraphedStep, NonFiniteLoss, TrainStep, fused_mlp_choice, graph_plan, graph_warmup_steps
from dres.train.stop import Interrupted


class Trainer:
    """One run of ``task`` under ``cfg``: :meth:`setup`, then :meth:`fit`, :meth:`evaluate` and :meth:`finish`
    (or :meth:`resume` / :meth:`load_weights` first). ``log`` prints a line."""

    def __init__(self, cfg: Config, task, *, log=print):
        tasks.check(cfg, task)  # a config built without its task's checks (config.build_config) is refused here
        self.cfg, self.task = cfg, task
        widen_hardware_queues(cfg.data)  # before this process's CUDA context exists
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
        self.dcp = cfg.ckpt.format == "dcp" or (cfg.ckpt.format == "auto" and cfg.dist == "fsdp")
        self.step = 0
        self.history: list[dict] = []
        self.summary: dict = {}
        self.eval_wall_s: float | None = None  # the last evaluate()'s wall time
        self.stop_signal: str | None = None  # the signal that asked the run to stop (stop_requested)
        self.in_loop = False
        self.last_record: dict | None = None  # metrics.jsonl's last record kept on resume
        self.last_good: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.loaded_from: str | None = None  # the checkpoint load_weights read
        self.flops_per_image: float | None = None  # model FLOPs of one training image (results.count_flops)
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
        self.captures_step = False  # whether the configuration captures the step (graph_plan), even when evaluating
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
        self.captures_step = graphs
        self.kernel_paths(model)
        # the captured step warms up and records on its own stream; DDP must be built on that stream
        capture_stream = torch.cuda.Stream(self.device) if graphs and train else None
        if cfg.dist == "fsdp":
            # bf16 parameters need autocast (FSDP2 casts no inputs): fp32 ones under precision=fp32
            param_dtype = "fp32" if self.precision == "fp32" else cfg.fsdp_param_dtype
            model = distributed.apply_fsdp(model, self.info, param_dtype, prefetch=cfg.fsdp_prefetch,
                                           reshard=cfg.fsdp_reshard, blocks_per_unit=cfg.fsdp_blocks_per_unit)
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
        epoch_steps = 0
        if train:  # data: this rank's slice of every global batch
            self.loader = build_loader(cfg.data, "train", cfg.batch_size, rank=self.info.rank, world=self.info.world,
                                       accum=cfg.accum_steps, seed=cfg.seed, device=self.device, train=True,
                                       log=self.log, compile_augment=cfg.compile and self.device.type == "cuda")
            self.log(f"[dres] data: {cfg.data.name}, {self.loader.describe()}")
            epoch_steps = len(self.loader)
            if cfg.data.side_stream and self.device.type == "cuda":
                self.data_stream = torch.cuda.Stream(self.device)
            self.flops_per_image, self.peak_tflops = results.count_flops(self)
        self.total_steps = cfg.steps if cfg.steps > 0 else int(round(cfg.epochs * epoch_steps))
        if train and self.total_steps <= 0:
            raise ConfigError("training length is zero: set steps=N or epochs=E (with a data set of known size)")
        self.lr = peak_lr(cfg)
        self.optimizer = build_optimizer(cfg, groups, self.device, self.precision, capturable=graphs)
        self.scheduler, self.warmup = build_schedule(cfg, self.optimizer, self.total_steps, epoch_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # EMA of the parameters (fp32; sharded like the parameters under FSDP)
        self.ema = ({n: p.detach().clone().float() for n, p in self.raw_model.named_parameters()}
                    if cfg.optim.ema_decay > 0 else None)
        self.step_body = TrainStep(self.task, cfg, self.model, self.raw_model, self.optimizer, self.scaler,
                                   self.autocast, self.device, ema=self.ema, droppath=self.droppath)
        if graphs and train:
            self.graphed = GraphedStep(self.step_body, self.optimizer, self.scheduler, self.total_steps, self.device,
                                       warmup_steps=graph_warmup_steps(cfg, self.info.world), stream=capture_stream,
                                       log=self.log)
        self.step_fn = self.graphed if self.graphed is not None else self.step_body
        if train:
            self.log(f"[dres] cuda graphs: {why}")
        torch.manual_seed(cfg.seed + 1000003 * self.info.rank)  # per-rank randomness (masks, noise)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        return self

    def kernel_paths(self, model: nn.Module) -> nn.Module:
        """``model``'s MLP path and kernels as the step trains it: a captured step takes the Triton kernels, and its
        eager warm-up steps too, so that they compute what the replays compute (the default picks the csrc kernels,
        or PyTorch's formulas at launch-bound sizes, for eager calls); the run's evaluations and an evaluation of its
        checkpoint (``--eval-only``) take the same ones, so that they give the same figures."""
        set_fused_mlp(model, fused_mlp_choice(self.cfg.fused_mlp, captured=self.captures_step))
        if self.captures_step and self.cfg.model.backend is None:
            set_backend(model, "triton")
        return model

    def autocast(self):
        if self.precision == "fp32":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    # ------------------------------------------------------------ checkpoints (dres.train.resume reads them)
    def save(self):
        if self.step_body.bad is not None and bool(self.step_body.bad):
            raise NonFiniteLoss("non-finite loss; not saving")
        extra = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "data": self.loader.state_dict() if self.loader else None, "config": to_dict(self.cfg),
                 "fingerprint": fingerprint(self.cfg), "history_len": len(self.history)}
        self.last_good = checkpoint.save(self.ckpt_dir, self.step, self.model, self.optimizer, extra,
                                         dcp_format=self.dcp, keep=self.cfg.ckpt.keep, device=self.device, ema=self.ema)
        return self.last_good

    def resume(self, what="auto") -> bool:
        """:func:`dres.train.resume.resume`: this run's state from a checkpoint (``auto``: the newest), if any."""
        resumed = resume.resume(self, what)
        if resumed is not None:
            self.step, self.last_good, self.last_record = resumed
        return resumed is not None

    def load_weights(self, path):
        """:func:`dres.train.resume.load_weights`: the model alone, for an evaluation."""
        self.step, self.loaded_from = resume.load_weights(self, path)

    def full_state_copy(self):
        """:func:`dres.train.resume.full_state_copy`: a plain model to evaluate on one rank (EMA weights if kept)."""
        return resume.full_state_copy(self)

    # ----------------------------------------------------------------- train
    def train_step(self, batch):
        """One optimizer step: ``step_fn`` (the captured step when CUDA graphs are on, else
        :meth:`step_body`), then the host's LR schedule."""
        out = self.step_fn(batch)
        self.scheduler.step()
        return out

    def checkpoint_kept(self) -> str:
        """What a run that stops now still has, for its message."""
        return f"the last good checkpoint is {self.last_good}" if self.last_good else "no checkpoint was written"

    def _check_finite(self):
        bad = self.step_body.bad
        if bad is not None and bool(distributed.all_sum(bad.float().reshape(1))[0] > 0):
            raise self._non_finite()

    def _non_finite(self) -> NonFiniteLoss:
        return NonFiniteLoss(f"non-finite loss before step {self.step}; stopping ({self.checkpoint_kept()}; "
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

    def stop_requested(self, name: str) -> None:
        """Where :func:`dres.train.stop.on_signal` sends SIGTERM / SIGINT during the run: in the loop the step under
        way is finished and saved (:meth:`fit`); elsewhere there is no step to finish, and the run stops at once."""
        self.stop_signal = name
        if not self.in_loop:
            raise Interrupted(results.stopped_at_once(name, self))
        wait = "this step" if self.info.world == 1 else f"the next log step (log.every={self.cfg.log.every})"
        self.log(f"[dres] {name}: stopping after {wait} with a checkpoint; a second signal stops at once, unsaved")

    def fit(self, until: int | None = None):
        """Train to ``total_steps``, or stop after step ``until`` as a run cut short there would (its schedule
        that of all ``total_steps``, a checkpoint at ``until``; a later ``fit`` or resume goes on). On a
        signal (:meth:`stop_requested`) the step under way is finished, a checkpoint is written and
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
        start_step, t0, seen = self.step, time.time(), 0
        self.tb, runlog = results.open_run_log(self)
        plain_log, self._log = self._log, runlog.around_bar(self._log)  # messages clear the bar's line first
        acc_loss, acc_n, acc_metrics, step_last = torch.zeros((), device=self.device), 0, {}, self.step
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
                self.step, seen, acc_loss, acc_n = self.step + 1, seen + cfg.batch_size, acc_loss + loss, acc_n + 1
                for k, v in metrics.items():
                    acc_metrics[k] = acc_metrics.get(k, 0) + v
                last = self.step == end
                # one process stops after any step (a host flag, no sync); several agree at log steps, below
                stop = self.stop_signal is not None and self.info.world == 1
                if pending is not None:  # read now that this step is queued behind it: the GPU does not wait
                    stop, pending = self._read_window(pending, runlog) or stop, None
                if self.step % cfg.log.every == 0 or last:
                    pending = runlog.close_window(step=self.step, steps=self.step - step_last,
                                                  lr=self.scheduler.get_last_lr()[0], epoch=self.epoch(),
                                                  loss_sum=acc_loss, n=acc_n, metrics=acc_metrics,
                                                  stop_asked=self.stop_signal is not None, bad=self.step_body.bad)
                    acc_loss, acc_n, acc_metrics, step_last = torch.zeros((), device=self.device), 0, {}, self.step
                save = bool(cfg.ckpt.every and self.step % cfg.ckpt.every == 0) or last or stop
                curve = bool(cfg.eval.every and (self.step % cfg.eval.every == 0 or last))
                flag_read = False  # whether every rank's non-finite flag up to this step was read
                if pending is not None and (save or curve):  # these wait for the GPU anyway
                    stop = self._read_window(pending, runlog) or stop  # this step's window, flag included
                    pending, flag_read, save = None, True, save or stop
                runlog.advance()
                if save:
                    if not flag_read:
                        self._check_finite()
                    self.save()
                if stop:
                    raise Interrupted(results.stopped_after_step(self.stop_signal, self.step, self.total_steps,
                                                                 self.out, self.last_good))
                if curve:
                    self.log(f"[dres] curve point at step {self.step}: {self.curve_point()}")
                    self.model.train()
        finally:
            self.in_loop = False
            runlog.close()
            self._log = plain_log
        self.summary = results.training_summary(self, start_step, time.time() - t0, seen)
        return self.summary

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
        """:func:`dres.train.results.curve_point`: the task's cheap evaluation, recorded with the step."""
        return results.curve_point(self)

    def finish(self, eval_metrics: dict | None = None, *, eval_only=False):
        """:func:`dres.train.results.finish`: summary.json after training, eval.json after an evaluation alone."""
        return results.finish(self, eval_metrics, eval_only=eval_only)
