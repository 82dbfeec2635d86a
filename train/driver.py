"""One run end to end (:func:`run`): training takes the run lock and claims its run directory
(:mod:`dres.train.rundir`), routes SIGTERM / SIGINT to the trainer (:func:`dres.train.stop.on_signal`), sets up,
resumes, fits, evaluates and writes the results; an evaluation alone reads a checkpoint's weights and evaluates."""

from __future__ import annotations

from dres.train import distributed, results, rundir
from dres.train.config import Config
from dres.train.loop import Trainer
from dres.train.stop import Interrupted, on_signal


def run(cfg: Config, task, *, resume=None, eval_only=False, ckpt=None, overwrite=False, log=print) -> dict:
    """Train (or only evaluate) one configuration end to end; returns the summary. A training run
    first takes the run lock and claims its run directory (:mod:`dres.train.rundir`:
    ``resume``/``overwrite``); a start refused before training begins leaves nothing behind, and so does one
    stopped by a signal before it saved or logged a step in a folder it found empty."""
    trainer = Trainer(cfg, task, log=log)
    if eval_only:
        trainer.setup(train=False)
        try:
            with on_signal(_stop_evaluation(trainer)):
                trainer.load_weights(ckpt or trainer.ckpt_dir)
                trainer.start_log()
                ev = trainer.evaluate() if trainer.main or cfg.dist != "none" else {}
                return trainer.finish(ev, eval_only=True)
        finally:
            distributed.barrier()
    lock, created, started = None, rundir.first_missing(trainer.out) if trainer.main else None, False
    claimed_empty = False  # the run directory held nothing when this run claimed it
    try:
        with on_signal(trainer.stop_requested):
            lock, claimed_empty = distributed.on_main(lambda: _claim(trainer, resume, overwrite), trainer.main) \
                or (None, False)
            trainer.setup()
            if resume and trainer.resume(resume) and trainer.step == trainer.total_steps \
                    and (trainer.out / "summary.json").exists():
                return results.finished(trainer)
            started = True
            trainer.fit()
            ev = trainer.evaluate()
            return trainer.finish(ev)
    except Exception as e:
        if trainer.log_file.path is not None:  # the one line the command line prints, in the run's log too
            kind = "" if isinstance(e, Interrupted) else "error: "
            trainer.log_file.write(f"[dres] {kind}{' '.join(str(e).split())}")
        if isinstance(e, Interrupted) and claimed_empty and trainer.last_good is None and not trainer.history:
            started = False  # nothing of the run is kept: the same command starts it again
            rundir.empty(trainer.out)
        raise
    finally:
        if trainer.graphed is not None:
            trainer.graphed.release()
        if lock is not None:
            lock.release()
        if not started and trainer.main:
            rundir.remove_created(trainer.out, created)
        distributed.barrier()


def _stop_evaluation(trainer: Trainer):
    """Where a signal goes during an evaluation alone: it ends at once, in one line."""
    def stop(name: str) -> None:
        raise Interrupted(results.stopped_evaluation(name, trainer))
    return stop


def _claim(trainer: Trainer, resume, overwrite) -> tuple[rundir.RunLock, bool]:
    """The run lock taken and the run directory claimed; whether the directory was empty."""
    lock = rundir.RunLock(trainer.out).acquire(trainer.log)
    try:
        empty = not rundir.contents(trainer.out)
        rundir.claim(trainer.out, trainer.cfg, resume=resume, overwrite=overwrite, log=trainer.log)
    except BaseException:
        lock.release()
        raise
    return lock, empty
