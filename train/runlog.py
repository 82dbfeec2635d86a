"""Where the training loop reports a log step: :class:`RunLog`, one object for every output of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from dres.train import rundir
from dres.train.common import progress


class RunLog:
    """The outputs of the log steps of one :meth:`Trainer.fit <dres.train.loop.Trainer.fit>`: on the main
    rank, each record as a line of ``metrics_path`` (metrics.jsonl), its values as TensorBoard scalars
    ``train/<key>`` (``tb``, a ``SummaryWriter`` or None) and loss, lr, img/s and mfu on a progress bar
    (``show_progress``) that counts every step from ``initial`` to ``total``; other ranks write nothing.
    ``kept()`` says what the run still has (its last good checkpoint) in the message of a full disk."""

    def __init__(self, metrics_path: Path, *, main: bool, tb, show_progress: bool, total: int, initial: int,
                 kept: Callable[[], str]):
        self.metrics_path, self.main, self.tb, self.kept = metrics_path, main, tb, kept
        self.bar = progress(total=total, initial=initial, unit="step") if main and show_progress else None

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

    def advance(self) -> None:
        """One step done (the bar counts it)."""
        if self.bar:
            self.bar.update(1)

    def close(self) -> None:
        """End the bar (the TensorBoard writer stays open: evaluation writes to it after the loop)."""
        if self.bar:
            self.bar.close()
