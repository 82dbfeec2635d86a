"""Where the training loop reports a log step: :class:`RunLog`, one object for every output of it, and
:class:`TensorBoard`, the run's TensorBoard writer whose full disk is one line like every other log's."""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from dres.train import rundir
from dres.train.common import progress


class RunLog:
    """The outputs of the log steps of one :meth:`Trainer.fit <dres.train.loop.Trainer.fit>`: on the main
    rank, each record as a line of ``metrics_path`` (metrics.jsonl), its values as TensorBoard scalars
    ``train/<key>`` (``tb``, a :class:`TensorBoard` or None) and, with ``show_progress``, either a progress bar
    counting every step from ``initial`` to ``total`` where stderr is a terminal, or one plain line per log step
    through ``write`` (step, epoch, loss, lr, img/s, MFU, ETA: a pipe, a batch job's log); other ranks write
    nothing. ``kept()`` says what the run still has (its last good checkpoint) in the message of a full disk."""

    def __init__(self, metrics_path: Path, *, main: bool, tb, show_progress: bool, total: int, initial: int,
                 kept: Callable[[], str], write: Callable[[str], None] = print):
        self.metrics_path, self.main, self.tb, self.kept, self.total = metrics_path, main, tb, kept, total
        shown = main and show_progress
        self.bar = progress(total=total, initial=initial, unit="step") if shown and sys.stderr.isatty() else None
        self.plain = shown and self.bar is None
        self.write = write  # the plain lines, written where there is no bar
        self._since = (initial, time.monotonic())  # the step and time ETA counts from

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
        if self.tb:
            for k, v in rec.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])
        if self.bar:
            mfu = {} if rec["mfu"] is None else {"mfu": f"{rec['mfu']:.1%}"}
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", img_s=f"{rec['img_per_s']:.0f}",
                                 **mfu, refresh=False)
        elif self.plain:
            self.write(self.plain_line(rec))

    def plain_line(self, rec: dict) -> str:
        """``[dres] step 200/1000 epoch 0.40 loss 0.6123 lr 1.50e-04 img/s 5,069 mfu 31.4% eta 0:02:38``; the ETA
        from the steps per second since the run's first logged step."""
        first, t0 = self._since
        rate = (rec["step"] - first) / max(time.monotonic() - t0, 1e-9)
        eta = datetime.timedelta(seconds=round((self.total - rec["step"]) / rate)) if rate > 0 else "?"
        epoch = f" epoch {rec['epoch']:.2f}" if rec.get("epoch") is not None else ""
        mfu = f" mfu {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
        return (f"[dres] step {rec['step']}/{self.total}{epoch} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"img/s {rec['img_per_s']:,.0f}{mfu} eta {eta}")

    def advance(self) -> None:
        """One step done (the bar counts it)."""
        if self.bar:
            self.bar.update(1)

    def close(self) -> None:
        """End the bar (the TensorBoard writer stays open: evaluation writes to it after the loop)."""
        if self.bar:
            self.bar.close()


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
