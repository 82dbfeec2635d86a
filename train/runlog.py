"""Where the training loop reports a log step: :class:`RunLog`, one object for the log window's read-back and
every output of it, :class:`ReplayTimer`, the captured step's GPU time per window, :class:`TensorBoard`,
the run's TensorBoard writer whose full disk is one line like every other log's, and :func:`open_wandb`, the
optional Weights & Biases run (``log.wandb=true``)."""

from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from dres.optional import import_optional
from dres.train import distributed, rundir
from dres.train.common import progress


class RunLog:
    """The log steps of one :meth:`Trainer.fit <dres.train.loop.Trainer.fit>`. A log window is closed at the
    step just issued without waiting for the GPU (:meth:`close_window`: the window's mean loss and metrics, the
    stop request and non-finite flag, reduced over the ranks and copied to the host behind the step) and read
    once the next step is issued (:meth:`read_window`), so the GPU never waits for the host's logging. Its record
    (img/s from ``batch_size`` images a step over the window's wall time, ``rate(img_per_s)``'s FLOP fields,
    ``data_ms``: the host's mean wait a step for the loader's batch, as :meth:`waited_for_data` counted it,
    ``peak_mem_gib``: the device's peak allocated memory so far (CUDA only), the replays' GPU time from
    ``timer``) goes, on the main rank, to ``metrics_path`` (metrics.jsonl), to TensorBoard as scalars
    ``train/<key>`` (``tb``, a :class:`TensorBoard` or None), to ``wandb`` (a run of :func:`open_wandb`, or None)
    and, with ``show_progress``, either to a progress bar counting every step from ``initial`` to ``total`` where
    stderr is a terminal, or to one plain line per log step through ``write`` (step, epoch, loss, lr, img/s,
    data time, MFU, peak memory, ETA: a pipe, a batch job's log); other ranks write nothing. ``kept()`` says what the run still has (its last good checkpoint) in the message
    of a full disk."""

    def __init__(self, metrics_path: Path, *, main: bool, tb, show_progress: bool, total: int, initial: int,
                 kept: Callable[[], str], batch_size: int, rate: Callable[[float], dict],
                 timer: ReplayTimer | None = None, write: Callable[[str], None] = print, wandb=None):
        self.metrics_path, self.main, self.tb, self.kept, self.total = metrics_path, main, tb, kept, total
        self.wandb = wandb
        self.batch_size, self.rate, self.timer = batch_size, rate, timer
        shown = main and show_progress
        self.bar = progress(total=total, initial=initial, unit="step") if shown and sys.stderr.isatty() else None
        self.plain = shown and self.bar is None
        self.write = write  # the plain lines, written where there is no bar
        self._since = (initial, time.monotonic())  # the step and time ETA counts from
        self._window_start = time.time()  # wall time at which the current log window began
        self._data_s = 0.0  # the host's wait for batches in the current log window

    def waited_for_data(self, seconds: float) -> None:
        """Count ``seconds`` the host waited for the loader's next batch in the current log window."""
        self._data_s += seconds

    def close_window(self, *, step: int, steps: int, lr: float, epoch: float | None, loss_sum: torch.Tensor,
                     n: int, metrics: dict, stop_asked: bool, bad: torch.Tensor | None) -> dict:
        """Close the window of ``steps`` steps ending at ``step`` (``n`` accumulated losses and ``metrics`` of
        device tensors, this rank's ``stop_asked`` and non-finite flag ``bad``) without waiting for the GPU."""
        device = loss_sum.device
        asked = torch.full((1,), float(stop_asked), device=device)
        bad = torch.zeros(1, device=device) if bad is None else bad.float().reshape(1)
        vals = distributed.all_mean(torch.cat([torch.stack([loss_sum] + list(metrics.values())) / n, asked, bad]))
        host, ready = vals, None
        if vals.is_cuda:
            host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            host.copy_(vals, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        data_s, self._data_s = self._data_s, 0.0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None  # no sync
        return {"step": step, "steps": steps, "lr": lr, "epoch": epoch, "keys": list(metrics), "host": host,
                "ready": ready, "replays": self.timer.end_window() if self.timer is not None else None,
                "data_ms": data_s / steps * 1e3, "peak_mem_gib": peak}

    def read_window(self, window: dict) -> tuple[dict | None, bool]:
        """Wait for a window from :meth:`close_window` and write its record: ``(record, whether any rank asked to
        stop)``; the record is None, and nothing written, where a loss on any rank was not finite."""
        if window["ready"] is not None:
            window["ready"].synchronize()
        *vals, asked_anywhere, bad_anywhere = window["host"].tolist()
        if bad_anywhere > 0:
            return None, asked_anywhere > 0
        now = time.time()  # the window's steps have ended on the GPU: its wall time is from the last window's end
        wall, self._window_start = now - self._window_start, now
        ips = window["steps"] * self.batch_size / max(wall, 1e-9)
        rec = {"step": window["step"], "loss": vals[0], "lr": window["lr"], "img_per_s": ips, **self.rate(ips),
               "epoch": window["epoch"], "data_ms": window["data_ms"], **dict(zip(window["keys"], vals[1:]))}
        if window["peak_mem_gib"] is not None:
            rec["peak_mem_gib"] = window["peak_mem_gib"]
        if window["replays"] is not None:  # the replays' GPU time against this window's wall time
            rec.update(self.timer.read_window(window["replays"], window["steps"], wall * 1e3))
        self.step(rec)
        return rec, asked_anywhere > 0

    def around_bar(self, write: Callable[[str], None]) -> Callable[[str], None]:
        """``write`` that clears the bar first and draws it again after, so a message never shares its line."""
        if self.bar is None:
            return write

        def clear_then_write(msg):
            with self.bar.external_write_mode():
                write(msg)
        return clear_then_write

    def step(self, rec: dict) -> None:
        """Write the record of a log step (``rec["step"]`` is the step it ends)."""
        if not self.main:
            return
        rundir.append_line(self.metrics_path, json.dumps(rec),
                           f"{self.kept()}; {rundir.FREE_SPACE_AND_RESUME}")
        scalars = {f"train/{k}": v for k, v in rec.items() if k != "step" and v is not None}
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb:
            self.wandb.log(scalars, step=rec["step"])
        if self.bar:
            mfu = {} if rec.get("mfu") is None else {"mfu": f"{rec['mfu']:.1%}"}
            mem = {} if rec.get("peak_mem_gib") is None else {"mem": f"{rec['peak_mem_gib']:.1f}GiB"}
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", img_s=f"{rec['img_per_s']:.0f}",
                                 **mfu, **mem, refresh=False)
        elif self.plain:
            self.write(self.plain_line(rec))

    def plain_line(self, rec: dict) -> str:
        """``[dres] step 200/1000 epoch 0.40 loss 0.6123 lr 1.50e-04 img/s 5,069 data 1.2 ms mfu 31.4% mem 14.4 GiB
        eta 0:02:38`` (data time, MFU and memory where known); the ETA from the steps per second since the run's
        first logged step."""
        first, t0 = self._since
        rate = (rec["step"] - first) / max(time.monotonic() - t0, 1e-9)
        eta = datetime.timedelta(seconds=round((self.total - rec["step"]) / rate)) if rate > 0 else "?"
        epoch = f" epoch {rec['epoch']:.2f}" if rec.get("epoch") is not None else ""
        data = f" data {rec['data_ms']:.1f} ms" if rec.get("data_ms") is not None else ""
        mfu = f" mfu {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
        mem = f" mem {rec['peak_mem_gib']:.1f} GiB" if rec.get("peak_mem_gib") is not None else ""
        return (f"[dres] step {rec['step']}/{self.total}{epoch} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"img/s {rec['img_per_s']:,.0f}{data}{mfu}{mem} eta {eta}")

    def advance(self) -> None:
        """One step done (the bar counts it)."""
        if self.bar:
            self.bar.update(1)

    def close(self) -> None:
        """End the bar and the wandb run (the TensorBoard writer stays open: evaluation writes to it after the loop)."""
        if self.bar:
            self.bar.close()
        if self.wandb:
            self.wandb.finish()


class ReplayTimer:
    """The GPU time of a captured step's replays, by a CUDA event pair recorded around each on the current stream
    (outside the graph) and read only at log steps, where the loop synchronises anyway: the replay's GPU time is
    the floor of the trainer's step, and :func:`window_timing` / :func:`steady_timing` set the wall time of the
    log windows against it. The last ``kept`` replays of a window are timed. Eager steps are not: events around
    them would measure the host's launch time as much as the GPU's, which is no floor."""

    def __init__(self, kept: int = 128):
        if kept < 1:
            raise ValueError(f"timed_replays must be >= 1, got {kept}")
        self.kept = kept
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # this window's, a ring of ``kept``
        self._replays = 0  # in the current log window
        self.windows: list[dict] = []

    @contextlib.contextmanager
    def timed(self):
        """Time the replay issued inside."""
        slot = self._replays % self.kept
        if slot == len(self._events):
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        start, end = self._events[slot]
        start.record()
        yield
        end.record()
        self._replays += 1

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


class LogFile:
    """``log.txt``: a copy of what the run printed. Lines written before the run has its folder (:meth:`open`) are
    held and written first; a failed write does not stop the run (the lines were printed)."""

    def __init__(self):
        self.path: Path | None = None
        self._held: list[str] = []

    def open(self, path: Path) -> None:
        if self.path is None:
            self.path = path
            held, self._held = self._held, []
            if held:
                self.write("\n".join(held))

    def write(self, msg: str) -> None:
        if self.path is None:
            self._held.append(msg)
            return
        try:
            with open(self.path, "a") as f:
                f.write(msg + "\n")
        except OSError:
            pass


def open_tensorboard(folder: Path, kept: Callable[[], str], log: Callable[[str], None], **writer_options):
    """A :class:`TensorBoard` of ``folder``, or None, said in one line through ``log``, where TensorBoard is not
    installed (it is optional at run time)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 (TensorBoard writes through it)
    except Exception as e:
        log(f"[dres] tensorboard disabled ({type(e).__name__}: {e}); pip install 'dres[tensorboard]' for "
            "<out>/tb, or set log.tensorboard=false")
        return None
    return TensorBoard(folder, kept, **writer_options)


def open_wandb(out: Path, config: dict):
    """A Weights & Biases run of the run folder ``out`` (project ``dres``, named after the folder, its files under
    ``out``, the resolved ``config``); :class:`~dres.optional.MissingExtra` naming the extra where wandb is not
    installed. wandb's own settings apply (``WANDB_MODE=offline`` keeps the run on this machine)."""
    wandb = import_optional("wandb", "wandb", "log.wandb=true")
    return wandb.init(project="dres", name=out.name, dir=str(out), config=config)


class TensorBoard:
    """A ``SummaryWriter`` of ``folder`` whose full disk (met by its writer thread, re-raised at the next call) is
    the one-line :class:`~dres.train.rundir.DiskFull` every other log of the run gives, naming the folder and
    ``kept()``; the writer thread's own traceback of it is left out (the next call reports it)."""

    def __init__(self, folder: Path, kept: Callable[[], str], **writer_options):
        from torch.utils.tensorboard import SummaryWriter

        self.folder, self.kept = folder, kept
        _quiet_writer_thread()
        self.writer = self._guarded(SummaryWriter)(str(folder), **writer_options)  # it writes the file's header

    def __getattr__(self, name):
        attr = getattr(self.writer, name)
        return self._guarded(attr) if callable(attr) else attr

    def _guarded(self, fn):
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if rundir.is_disk_full(e):
                    # a log step's scalars are a few hundred bytes: 1 KiB is what to free at least
                    raise rundir.disk_full(self.folder / "events", 1024,
                                           f"{self.kept()}; {rundir.FREE_SPACE_AND_RESUME}") from None
                raise
        return call


def _quiet_writer_thread() -> None:
    """Leave out the traceback TensorBoard's writer thread prints when the disk is full (once installed)."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and rundir.is_disk_full(args.exc_value):
            return
        previous(args)
    hook.quiets_tensorboard = True
    threading.excepthook = hook
