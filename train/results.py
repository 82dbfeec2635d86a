"""What a run leaves besides its checkpoints and logs: the run's record when training starts (config.yaml, the
fingerprint, starts.jsonl), ``summary.json`` or ``eval.json`` with their closing lines, and the one-line messages of
a run that stopped on a signal or was already finished."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dres.data import CorruptCounter, lost_data_line
from dres.train import rundir
from dres.train.checkpoint import gather_ranks
from dres.models.flops import training_flops
from dres.train.common import dense_bf16_peak, flops_rate_text, model_flops_rate
from dres.train.config import save_config, to_dict
from dres.train.rundir import fingerprint
from dres.train.runlog import RunLog, open_tensorboard, open_wandb, steady_timing
from dres.train.stop import EXIT_INTERRUPTED


def write_record(trainer) -> None:
    """The run's record (see rundir), written when training starts, so that a start refused before (a missing
    or incompatible checkpoint) leaves nothing; evaluation leaves it as training wrote it."""
    if trainer.main:
        rundir.publish(trainer.out / "config.yaml", lambda tmp: save_config(trainer.cfg, tmp))
        rundir.write_fingerprint(trainer.out, fingerprint(trainer.cfg))
        rundir.record_start(trainer.out, trainer.device, trainer.info.world, trainer.step)
        trainer.start_log()


def open_run_log(trainer) -> tuple:
    """The run's record written (:func:`write_record`); the TensorBoard writer (or None) and the :class:`RunLog` of
    a :meth:`~dres.train.loop.Trainer.fit`, wandb opened for it where asked for."""
    cfg, main = trainer.cfg, trainer.main
    write_record(trainer)
    # a resumed run hides the events its predecessor logged after the checkpoint, as metrics.jsonl cuts them
    tb = (open_tensorboard(trainer.out / "tb", trainer.checkpoint_kept, trainer.log,
                           purge_step=trainer.step + 1 if trainer.step else None)
          if main and cfg.log.tensorboard else None)
    return tb, RunLog(trainer.out / "metrics.jsonl", main=main, tb=tb, show_progress=cfg.log.progress,
                      total=trainer.total_steps, initial=trainer.step, kept=trainer.checkpoint_kept,
                      batch_size=cfg.batch_size, rate=lambda ips: flops_rate(trainer, ips),
                      timer=trainer.graphed.timer if trainer.graphed is not None else None, write=trainer.log,
                      wandb=open_wandb(trainer.out, to_dict(cfg)) if main and cfg.log.wandb else None)


def flops_rate(trainer, img_per_s: float) -> dict:
    """``model_tflops`` and ``mfu`` of the run at ``img_per_s`` (:func:`~dres.train.common.model_flops_rate`)."""
    return model_flops_rate(img_per_s, trainer.flops_per_image, trainer.info.world, trainer.peak_tflops)


def lost_data_of_ranks(counter) -> dict:
    """The lost data every rank's loader counted, as one :meth:`~dres.data.CorruptCounter.summary` (a
    collective: every rank calls it)."""
    return CorruptCounter.of_ranks(gather_ranks(counter.state_dict()), counter.dropped_by_prep).summary()


def training_summary(trainer, start_step: int, wall: float, seen: int) -> dict:
    """``summary.json``'s training part: steps, speed, FLOP rate, final loss, peak memory and lost data of a
    :meth:`~dres.train.loop.Trainer.fit` that started at ``start_step``, took ``wall`` seconds and ``seen`` images."""
    final = trainer.history[-1] if trainer.history else trainer.last_record
    ips = seen / max(wall, 1e-9)
    device = trainer.device
    summary = {"steps": trainer.step - start_step, "step": trainer.step, "wall_s": wall, "img_per_s": ips,
               "gflop_per_image": trainer.flops_per_image / 1e9 if trainer.flops_per_image is not None else None,
               **flops_rate(trainer, ips), "peak_bf16_tflops": trainer.peak_tflops,
               "final_loss": final["loss"] if final else None,
               "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               "lost_data": lost_data_of_ranks(trainer.loader.counter)}
    if trainer.graphed is not None:  # how close the trainer's steps come to the replays' GPU time
        summary.update(steady_timing(trainer.graphed.timer.windows))
    return summary


def count_flops(trainer) -> tuple[float | None, float | None]:
    """The model FLOPs of one training image (forward + backward, :mod:`dres.models.flops`) and the card's dense
    bf16 peak (TFLOP/s), either None where unknown, for ``model_tflops`` and ``mfu`` in metrics.jsonl, summary.json
    and the log, which says which is known."""
    cfg = trainer.cfg
    micro = cfg.batch_size // (trainer.info.world * cfg.accum_steps)  # the loader has checked it divides
    flops = training_flops(trainer.raw_model, micro, cfg.model.img_size)
    per_image = flops / micro if flops is not None else None
    name, peak = dense_bf16_peak(trainer.device)
    if per_image is None:
        trainer.log(f"[dres] note: no FLOP count for a {type(trainer.raw_model).__name__}; model_tflops and mfu "
                    "are not reported")
    elif peak is None:
        trainer.log(f"[dres] model FLOPs: {per_image / 1e9:.4g} GFLOP per training image (forward + backward); "
                    f"note: mfu is not reported, no dense bf16 peak is known for {name}")
    else:
        trainer.log(f"[dres] model FLOPs: {per_image / 1e9:.4g} GFLOP per training image (forward + backward); "
                    f"mfu against the dense bf16 peak of {name}, {peak:g} TFLOP/s")
    return per_image, peak


def curve_point(trainer) -> dict:
    """The task's cheap evaluation (``task.curve``), recorded with the step and epoch in
    ``<out>/curves.jsonl`` and drawn to ``<out>/curves.png`` (:mod:`dres.eval.curves`)."""
    from dres.eval import log_results, record_point

    trainer.model.eval()
    with torch.no_grad():
        point = trainer.task.curve(trainer)
    if trainer.main and point:
        point = {"step": trainer.step, "epoch": trainer.epoch(), **point}
        record_point(trainer.out, point)
        if trainer.tb:
            log_results(trainer.tb, trainer.step, point, "curve")
    return point


def _closing_lines(summary: dict, on_cuda: bool) -> list[str]:
    lost, final_loss = summary["lost_data"], summary["final_loss"]
    lines = [f"[dres] done: {summary['steps']} steps in {summary['wall_s']:.1f}s, {summary['img_per_s']:.1f} img/s"
             f"{flops_rate_text(summary) if on_cuda else ''}, "  # a CPU's is no GPU's
             f"final loss {'none' if final_loss is None else f'{final_loss:.4f}'}"]
    if summary["peak_mem_gib"] is not None:
        lines.append(f"[dres] peak memory {summary['peak_mem_gib']:.2f} GiB")
    if lost_data_line(lost):
        lines.append(lost_data_line(lost))
    return lines


def finish(trainer, eval_metrics: dict | None = None, *, eval_only=False) -> dict:
    """Write the results: after training ``summary.json`` (evaluation under "eval"); after an evaluation alone
    ``eval.json``, so the training summary stays as training wrote it."""
    if eval_only:
        s = {"step": trainer.step, "checkpoint": trainer.loaded_from, "eval": eval_metrics or {}}
        name, lines = "eval.json", []
    else:
        s, name = dict(trainer.summary), "summary.json"
        if eval_metrics:
            s["eval"] = eval_metrics
        lines = _closing_lines(trainer.summary, trainer.device.type == "cuda")
    if eval_metrics:
        s["eval_wall_s"] = trainer.eval_wall_s
    if trainer.main:
        rundir.write_atomic(trainer.out / name, json.dumps(s, indent=1, default=str))
        for k, v in (eval_metrics or {}).items():
            lines.append(f"[dres] {k}: {v:.4f}" if isinstance(v, float) else f"[dres] {k}: {v}")
        trainer.log("\n".join(lines))
    if trainer.tb:
        from dres.eval import log_hparams, log_results

        log_results(trainer.tb, trainer.step, eval_metrics or {}, "eval")
        log_hparams(trainer.tb, to_dict(trainer.cfg), {"final_loss": s.get("final_loss"), **(eval_metrics or {})})
        trainer.tb.close()
    return s


def finished(trainer) -> dict:
    """A resume of a run that is complete: its results stay as they are."""
    out, step = trainer.out, trainer.step
    trainer.log(f"[dres] the run in {out} is finished (step {step} of {trainer.total_steps}; results in "
                f"{out / 'summary.json'}); nothing was changed. To train it longer: --resume auto --set steps=N with "
                f"N > {step}; to evaluate it again: dres-eval {out}")
    return json.loads((out / "summary.json").read_text())


def stopped_after_step(name: str, step: int, total: int, out: Path, checkpoint: Path) -> str:
    """The message of a run that finished its step ``step`` of ``total`` on signal ``name`` and saved ``checkpoint``."""
    then = f"training is complete, evaluate with dres-eval {out}" if step == total else "continue with --resume auto"
    return (f"stopped by {name} after step {step} of {total}: checkpoint {checkpoint} written; {then} "
            f"(exit status {EXIT_INTERRUPTED})")


def stopped_evaluation(name: str, trainer) -> str:
    """The message of an evaluation alone (dres-eval) stopped on signal ``name``."""
    return (f"stopped by {name} during the evaluation of {trainer.out}; evaluate again with dres-eval {trainer.out} "
            f"(exit status {EXIT_INTERRUPTED})")


def stopped_at_once(name: str, trainer) -> str:
    """The message of a run stopped on signal ``name`` where it had no step to finish: before training, or
    during the final evaluation (after :meth:`~dres.train.loop.Trainer.fit` returned its summary)."""
    if trainer.summary:
        where = (f"during the evaluation after step {trainer.step}; the checkpoint {trainer.last_good} is written, "
                 f"evaluate it with dres-eval {trainer.out}")
    else:
        where = "before training started" + (f" (from {trainer.last_good})" if trainer.last_good else "")
    return f"stopped by {name} {where} (exit status {EXIT_INTERRUPTED})"
