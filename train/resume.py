"""A trainer's state read back from its checkpoints (:mod:`dres.train.checkpoint`): a resume of training with the
settings it may change applied, the weights alone for an evaluation, and a plain copy of the model to evaluate."""

from __future__ import annotations

from pathlib import Path

from dres.train import checkpoint, rundir
from dres.train.config import ConfigError, dotted_value, to_dict
from dres.train.rundir import fingerprint

# keys a resume may change: applied to the optimizer's groups and the LR schedule after its state is loaded
RESUME_APPLIED = ("steps", "epochs", "accum_steps", "optim.lr", "optim.blr", "optim.min_lr", "optim.weight_decay",
                  "optim.betas", "optim.eps", "optim.momentum", "optim.schedule", "optim.warmup_steps",
                  "optim.warmup_epochs", "optim.clip_grad", "optim.label_smoothing", "optim.fused")
# keys a resume may not change: the checkpoint carries the random streams and data order they decided
RESUME_FIXED = ("seed",)


def resume(trainer, what="auto") -> tuple[int, Path, dict | None] | None:
    """The trainer's state from a checkpoint; returns its step, its path and the last record of metrics.jsonl kept
    (for the trainer to set), or None where there is none. ``what``: ``auto``, the newest readable checkpoint of the
    trainer's run directory (none at all: start fresh); or a path. Unreadable or incompatible checkpoints are
    :class:`~dres.train.checkpoint.CheckpointError`.

    The settings of :data:`RESUME_APPLIED` may differ from the checkpoint's: its optimizer state is loaded, then
    the current config's weight decay, betas, eps and momentum are set on the parameter groups and the LR schedule
    (peak lr, min_lr, warmup, length) is recomputed at the resumed step, so what config.yaml and the logs say is
    what the optimizer uses. :data:`RESUME_FIXED` keys are refused. Records of metrics.jsonl and curves.jsonl past
    the resumed step are moved to ``*.superseded.jsonl``, so the logs hold one history."""
    t = trainer
    target = t.ckpt_dir if what == "auto" else Path(what)
    if what != "auto" and not target.exists():
        raise FileNotFoundError(f"checkpoint not found: {target}")
    built = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]
    extra = checkpoint.load(target, t.model, t.optimizer, ema=t.ema, device=t.device, fingerprint=fingerprint(t.cfg),
                            log=t.log)
    if extra is None:
        t.log(f"[dres] no checkpoint in {target}; starting from scratch")
        return None
    step, path = int(extra["step"]), Path(extra["path"])
    changed = changed_settings(extra.get("config") or {}, to_dict(t.cfg), path)
    if step > t.total_steps:
        raise ConfigError(f"checkpoint {path} is at step {step}, past this run's length ({t.total_steps} steps); "
                          f"resume with --set steps=N, N >= {step}")
    t.scheduler.load_state_dict(extra["scheduler"])
    t.scaler.load_state_dict(extra["scaler"])
    if t.loader is not None and extra.get("data"):
        t.loader.load_state_dict(extra["data"])
    apply_settings(t.optimizer, t.scheduler, built)
    t.log(f"[dres] resumed from {path} at step {step}")
    if changed:
        t.log(f"[dres] settings changed since the checkpoint, applied from step {step} (the lr schedule "
              f"recomputed): {changed}")
    aside = checkpoint.set_aside_after(t.ckpt_dir, step)
    if aside is not None:
        t.log(f"[dres] checkpoints after step {step} (skipped or from an abandoned branch) moved to {aside}")
    last_record = None
    if t.main:
        for name in ("metrics.jsonl", "curves.jsonl"):
            kept, cut = rundir.cut_records(t.out / name, step)
            if cut:
                t.log(f"[dres] {cut} records of {name} after step {step} moved to {rundir.superseded_name(name)}")
            if name == "metrics.jsonl" and kept:
                last_record = kept[-1]
    return step, path, last_record


def changed_settings(saved: dict, now: dict, path) -> str:
    """The :data:`RESUME_APPLIED` keys whose value in the config ``now`` differs from the checkpoint's config
    ``saved`` (one line), after refusing a change of a :data:`RESUME_FIXED` key."""
    for key in RESUME_FIXED:
        was, is_now = dotted_value(saved, key), dotted_value(now, key)
        if saved and was != is_now:
            raise ConfigError(f"{key} cannot change on resume: checkpoint {path} continues the random streams "
                              f"and data order of {key}={was!r} (now {is_now!r}); resume with "
                              f"--set {key}={was}, or start a new run")
    return ", ".join(f"{k} {dotted_value(saved, k)!r} -> {dotted_value(now, k)!r}" for k in RESUME_APPLIED
                     if saved and dotted_value(saved, k) != dotted_value(now, k))


def apply_settings(optimizer, scheduler, built: list[dict]) -> None:
    """Set the hyper-parameters ``built`` from the current config on the parameter groups (loading the optimizer
    state replaced them with the checkpoint's), and recompute the schedule's lr at its position."""
    for g, fresh in zip(optimizer.param_groups, built):
        g.update(fresh)
    scheduler.base_lrs = [fresh["initial_lr"] for fresh in built]
    scheduler.last_epoch -= 1  # step() advances it back, setting each group's lr for that position
    scheduler.step()


def load_weights(trainer, path) -> tuple[int, str]:
    """The model (and EMA) of the checkpoint ``path`` (a file or a run's checkpoint folder), for an evaluation;
    returns the checkpoint's step and path."""
    t = trainer
    extra = checkpoint.load(path, t.model, None, ema=t.ema, device=t.device, restore_rng=False,
                            fingerprint=fingerprint(t.cfg), log=t.log)
    if extra is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    t.log(f"[dres] loaded weights of step {extra['step']} from {extra['path']}")
    return int(extra["step"]), extra["path"]


def full_state_copy(trainer):
    """A plain (unsharded) copy of the trainer's model for evaluation on one rank; EMA weights if kept."""
    from torch.distributed.tensor import DTensor

    model, ema = trainer.raw_model, trainer.ema
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded and ema is None:
        return model
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if ema is not None:
        state.update({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ema.items()})
    fresh = trainer.kernel_paths(trainer.task.build_model(trainer.cfg).to(trainer.device))
    fresh.load_state_dict(state)
    return fresh.eval()
