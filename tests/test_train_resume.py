"""Exact resume and atomic checkpoints (single process, fixed seeds, CPU)."""

from unittest import mock

import pytest
import torch

from dres.train import checkpoint
from dres.train.config import build_config
from dres.train.loop import Trainer
from dres.train.step import NonFiniteLoss
from dres.train.mae import TASK

# a tiny MAE (official variant, decayed) with ResidualDroppath, on 8x8 digits with augmentation
OVR = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.mean=[0.3]", "data.std=[0.4]",
       "data.crop_min=0.5", "model.variant=official", "model.img_size=8", "model.patch_size=4", "model.in_chans=1",
       "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.decoder_embed_dim=32",
       "model.decoder_depth=1", "model.decoder_num_heads=2", "model.alpha_min=0.6", "model.drop_path=0.3",
       "model.droppath_mode=residual_droppath", "batch_size=32", "accum_steps=2", "optim.blr=1e-2",
       "optim.warmup_steps=2", "optim.clip_grad=1.0", "log.every=1", "log.progress=false",
       "log.tensorboard=false", "eval.probe=false"]


def _trainer(out, steps, extra=(), log=lambda m: None):
    cfg = build_config("mae", None, OVR + [f"steps={steps}", f"out={out}"] + list(extra))
    return Trainer(cfg, TASK, log=log).setup()


def test_exact_resume_matches_uninterrupted_run(tmp_path):
    full = _trainer(tmp_path / "full", 8, ["ckpt.every=0"])
    full.fit()
    # first half: a run that would go to 8 steps, stopped after 4 (the checkpoint at step 4)
    half = _trainer(tmp_path / "half", 8, ["ckpt.every=4"])
    half.fit(until=4)
    assert half.droppath.iteration == 4
    resumed = _trainer(tmp_path / "half", 8, ["ckpt.every=4"])
    assert resumed.resume("auto") and resumed.step == 4
    assert resumed.droppath.iteration == 4  # the alternation continues (even iteration next)
    resumed.fit()
    losses_full = [h["loss"] for h in full.history]
    losses_resumed = [h["loss"] for h in half.history] + [h["loss"] for h in resumed.history]
    assert losses_full == losses_resumed
    for (n, a), (_, b) in zip(full.raw_model.state_dict().items(), resumed.raw_model.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
    assert full.droppath.iteration == resumed.droppath.iteration == 8
    assert torch.equal(full.droppath.masks, resumed.droppath.masks)
    # optimizer moments and the lr schedule position continue exactly too
    assert full.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()


def test_killed_save_leaves_previous_checkpoint_usable(tmp_path):
    trainer = _trainer(tmp_path, 6, ["ckpt.every=0", "ckpt.keep=5"])
    trainer.fit(until=2)  # saves step 2 at its end
    good = trainer.last_good
    ref = {k: v.clone() for k, v in trainer.raw_model.state_dict().items() if isinstance(v, torch.Tensor)}
    real_save = torch.save

    class Killed(BaseException):  # as a kill runs no handler, it passes the save's own
        pass

    def dies_mid_write(obj, f):  # the process dies after writing part of the file, before the rename
        real_save(obj, f)
        f.truncate(f.tell() // 2)
        raise Killed

    with mock.patch.object(checkpoint.torch, "save", dies_mid_write), pytest.raises(Killed):
        trainer.fit(until=4)  # train on, then die while saving step 4
    assert [p.name for p in checkpoint.list_checkpoints(trainer.ckpt_dir)] == [good.name]
    assert list(trainer.ckpt_dir.glob(".step_*tmp"))  # the partial write exists but is ignored
    again = _trainer(tmp_path, 6)
    assert again.resume("auto") and again.step == 2
    for k, v in again.raw_model.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, ref[k]), k


def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path):
    trainer = _trainer(tmp_path, 4, ["ckpt.every=2", "ckpt.keep=3"])
    trainer.fit()
    names = [p.name for p in checkpoint.list_checkpoints(trainer.ckpt_dir)]
    assert names == ["step_00000002.pt", "step_00000004.pt"]
    (trainer.ckpt_dir / names[-1]).write_bytes(b"garbage")
    lines = []
    again = _trainer(tmp_path, 6, ["ckpt.every=2", "ckpt.keep=2"], log=lines.append)
    assert again.resume("auto")
    assert again.step == 2
    assert any("step_00000004.pt is unreadable" in m and "trying an older one" in m for m in lines), lines
    # the damaged step 4 is moved aside, not deleted, and rotation keeps this run's own line of checkpoints
    aside = [d for d in again.ckpt_dir.iterdir() if d.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step_00000004.pt").read_bytes() == b"garbage"
    again.fit()
    assert [p.name for p in checkpoint.list_checkpoints(again.ckpt_dir)] == ["step_00000004.pt", "step_00000006.pt"]
    assert checkpoint.load(again.ckpt_dir / "step_00000004.pt", _trainer(tmp_path / "other", 6).raw_model)["step"] == 4


def test_resuming_an_older_checkpoint_sets_the_later_branch_aside(tmp_path):
    trainer = _trainer(tmp_path, 6, ["ckpt.every=2", "ckpt.keep=5"])
    trainer.fit()
    older = trainer.ckpt_dir / "step_00000002.pt"
    again = _trainer(tmp_path, 6, ["ckpt.every=2", "ckpt.keep=5"])
    assert again.resume(str(older)) and again.step == 2
    assert [p.name for p in checkpoint.list_checkpoints(again.ckpt_dir)] == ["step_00000002.pt"]
    again.fit()
    # the new line of checkpoints is the folder's; the abandoned steps 4 and 6 are kept aside
    assert [p.name for p in checkpoint.list_checkpoints(again.ckpt_dir)] == [f"step_0000000{i}.pt" for i in (2, 4, 6)]
    (aside,) = [d for d in again.ckpt_dir.iterdir() if d.name.startswith("superseded-")]
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000004.pt", "step_00000006.pt"]


@pytest.mark.parametrize("log_every", [1, 2, 100])  # log steps between saves, at the saves, none before the end
def test_non_finite_loss_stops_with_clear_message_and_keeps_last_checkpoint(tmp_path, log_every):
    trainer = _trainer(tmp_path, 8, ["ckpt.every=2", f"log.every={log_every}"])
    trainer.fit(until=2)
    assert trainer.last_good is not None and trainer.last_good.name == "step_00000002.pt"
    real_loss = TASK.loss
    try:
        TASK.loss = lambda model, batch, cfg: (real_loss(model, batch, cfg)[0] * float("nan"), {})
        with pytest.raises(NonFiniteLoss, match="non-finite loss.*step_00000002"):
            trainer.fit()
    finally:
        TASK.loss = real_loss
    assert [p.name for p in checkpoint.list_checkpoints(trainer.ckpt_dir)] == ["step_00000002.pt"]
