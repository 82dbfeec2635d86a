"""``dres-launch`` (or ``python -m dres.train.launch``): torchrun, with an exit status a job script can requeue on.

It takes torchrun's arguments and runs ``torch.distributed.run`` in this process::

    dres-launch --nproc_per_node 8 -m dres.train.mae --preset mae_vit_b16_in1k --out runs/b16

A rank stopped by SIGTERM or SIGINT finishes its step, writes a checkpoint with the others and exits 75
(``EXIT_INTERRUPTED``: ``--resume auto`` continues), but torchrun exits 1 whenever a rank exits non-zero, so
the 75 never reaches the job script. This launcher exits 75 instead of torchrun's status where

* the ranks were signalled, a rank exited 75 and every other one that failed exited 75 too or was ended by a
  signal (torchrun's ChildFailedError carries their exit statuses; once one rank exits, torchrun stops the
  others with SIGTERM). A rank exits 75 only after the checkpoint's last barrier, which every rank passed,
  so the checkpoint is complete whatever ended the others after it;
* the launcher was signalled (what a signal to its process group reaches: torchrun starts each rank in a
  session of its own). torchrun forwards the signal to the ranks, waits for them for its shutdown timeout
  (30 s; torch 2.12 and later take ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), kills
  those still running, and raises a SignalException that carries no exit status: so each rank that stops
  with its checkpoint leaves a record (:func:`record_stop`) in the folder this launcher names in
  ``DRES_LAUNCH_STATUS_DIR``, and the launcher exits 75 when every rank of this node left one.

Any other outcome is torchrun's own, exit status and report alike.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from dres.train.stop import EXIT_INTERRUPTED, hand_over, run_command

STATUS_DIR_ENV = "DRES_LAUNCH_STATUS_DIR"


def record_stop() -> None:
    """Under dres-launch, record that this rank stopped on a signal with its checkpoint written: an empty file
    ``<restart>.<local rank>.<local world size>`` (torchrun's numbering of this node's ranks and of its restarts
    of them) in ``DRES_LAUNCH_STATUS_DIR``. Elsewhere it does nothing."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if folder:
        env = os.environ.get
        Path(folder, f"{env('TORCHELASTIC_RESTART_COUNT', '0')}.{env('LOCAL_RANK', '0')}."
                     f"{env('LOCAL_WORLD_SIZE', '1')}").touch()


def every_rank_stopped(folder) -> bool:
    """Whether every rank of this node's latest start recorded its stop (:func:`record_stop`) in ``folder``."""
    records = [tuple(int(n) for n in p.name.split(".")) for p in Path(folder).iterdir()]
    if not records:
        return False
    latest = max(restart for restart, _, _ in records)
    stopped = {(local_rank, world) for restart, local_rank, world in records if restart == latest}
    return {local_rank for local_rank, _ in stopped} == set(range(max(world for _, world in stopped)))


def main(argv=None) -> int:
    """A signal before torchrun takes the signals over (its imports take seconds) is a stop in one line, exit 75."""
    return run_command(lambda: _launch(sys.argv[1:] if argv is None else argv), _stopped, "the ranks started")


def _stopped(e) -> int:
    print(f"dres-launch: {e}", file=sys.stderr)
    return EXIT_INTERRUPTED


def _launch(argv) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    hand_over()  # torchrun installs handlers of its own
    with tempfile.TemporaryDirectory(prefix="dres-launch-") as folder:
        os.environ[STATUS_DIR_ENV] = folder
        try:
            torchrun(argv)
            return 0
        except ChildFailedError as e:
            codes = [f.exitcode for f in e.failures.values()]
            if EXIT_INTERRUPTED not in codes or any(c > 0 and c != EXIT_INTERRUPTED for c in codes):
                raise
            what = "the ranks stopped on a signal"
        except SignalException as e:
            if not every_rank_stopped(folder):
                raise
            what = f"{e.sigval.name}: every rank of this node stopped"
    print(f"dres-launch: {what} with the run's checkpoint written; continue with --resume auto "
          f"(exit status {EXIT_INTERRUPTED})", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
