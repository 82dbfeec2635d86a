"""Exact resume of runs that read image files (a folder, or dres-prep's shards): killed at any step, a run resumed
from its last checkpoint logs the losses of the run never killed, bit for bit, and counts the same lost data."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from dres.data import build_loader
from dres.data.prep import prepare_shards
from test_decode import TINY_FOLDER_RUN, _folder, _loader_config, _shards

STEPS = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An image folder with one damaged file, and dres-prep's shards of it (which leave that file out)."""
    root = tmp_path_factory.mktemp("data")
    (root / "images").mkdir()
    images = _folder(root / "images", bad=(4,))
    prepare_shards(images, str(root / "shards"), short_side=16, shard_size=8, workers=1, log=lambda m: None)
    return {"imagefolder": images, "wds": str(root / "shards")}


def _run(tmp_path, source, path, workers, out, flags=()):
    sets = [s for s in TINY_FOLDER_RUN if not s.startswith(("data.name=", "data.num_workers="))]
    sets += [f"data.name={source}", f"data.path={path}", f"data.num_workers={workers}", f"steps={STEPS}",
             "ckpt.every=2", "ckpt.keep=1"] + (["data.finish_ahead=0"] if workers == 0 else [])  # else 2 ahead
    cmd = [sys.executable, "-m", "dres.train.mae", "--preset", "quickstart", "--out", str(out), *flags]
    cmd += [a for kv in sets for a in ("--set", kv)]
    return subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ended(proc, what):
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, (what, stdout, stderr)
    return stdout + stderr


@pytest.mark.parametrize("source,workers", [("imagefolder", 0), ("imagefolder", 2), ("wds", 0), ("wds", 2)])
def test_a_run_killed_at_a_random_step_resumes_as_if_never_killed(tmp_path, data, source, workers):
    """SIGKILL (no handler runs, no checkpoint of that moment) after a random step past the first checkpoint; the
    run resumed with --resume auto goes on from its last checkpoint to the end. Its metrics.jsonl (the steps
    past the checkpoint, logged again) and summary.json's lost data are the uninterrupted run's."""
    kill_after = random.randint(3, STEPS - 4)
    full = _run(tmp_path, source, data[source], workers, tmp_path / "full")
    cut = tmp_path / "cut"
    killed = _run(tmp_path, source, data[source], workers, cut)
    while killed.poll() is None and not ((cut / "metrics.jsonl").exists() and len(_records(cut)) >= kill_after):
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)
    stdout, stderr = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, (kill_after, stdout, stderr)
    logged = len(_records(cut))
    assert logged < STEPS, f"the run ended before the kill after step {kill_after}"
    said = _ended(_run(tmp_path, source, data[source], workers, cut, ["--resume", "auto"]), "resumed")
    assert "[dres] resumed from" in said, said
    _ended(full, "uninterrupted")
    context = f"killed after step {kill_after} ({logged} logged)"
    assert [(r["step"], r["loss"]) for r in _records(cut)] == [(r["step"], r["loss"]) for r in _records(tmp_path / "full")], context
    lost = [json.loads((out / "summary.json").read_text())["lost_data"] for out in (cut, tmp_path / "full")]
    assert lost[0] == lost[1], context
    assert lost[0]["corrupt_samples"] == (1 if source == "imagefolder" else 0)
    assert len(lost[0]["dropped_by_prep"]) == (1 if source == "wds" else 0)


@pytest.mark.parametrize("source", ["imagefolder", "wds"])
def test_the_loss_count_saved_with_the_position_is_that_of_the_batches_taken(tmp_path, source):
    """The thread finishing batches ahead and the workers meet a lost sample before the step takes its batch; it
    is counted as its batch is handed over, so the state saved after a step holds the losses of the batches taken,
    and a loader resumed from it counts on from there (a loss met before the position is not met again)."""
    # shards of 24 samples: an epoch of several batches (a new epoch starts new workers)
    path = (_folder(tmp_path, bad=(4,)) if source == "imagefolder" else
            _shards(tmp_path, n_shards=2, per_shard=24, bad=("k1-3",)))
    states = {}
    for ahead in (0, 2):
        loader = build_loader(_loader_config(source, path, ahead), "train", 8, seed=3)
        states[ahead] = [(loader.next(), loader.state_dict()) for _ in range(5)]
        loader.close()
    assert [s for _, s in states[0]] == [s for _, s in states[2]]
    counts = [s["lost"]["count"] for _, s in states[2]]
    taken = counts.index(1) + 1  # batches taken when the loss was counted
    assert taken < len(counts) and counts[:taken - 1] == [0] * (taken - 1), counts
    resumed = build_loader(_loader_config(source, path, 2), "train", 8, seed=3)
    resumed.load_state_dict(states[2][taken - 1][1])
    assert resumed.counter.count == 1
    for batch, state in states[2][taken:]:
        again = resumed.next()
        assert torch.equal(again["image"], batch["image"]) and resumed.state_dict() == state
    assert resumed.counter.summary()["examples"] == [states[2][-1][1]["lost"]["examples"][0]]
    resumed.close()


def test_another_ranks_count_is_not_taken_over(tmp_path):
    """The trainer saves rank 0's loader state: rank 1 takes its position and counts its own losses afresh."""
    config = dataclasses.replace(_loader_config("imagefolder", _folder(tmp_path, bad=(4,)), 0), num_workers=0)
    ranks = [build_loader(config, "train", 8, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(3):  # an epoch: every file met once
        for loader in ranks:
            loader.next()
    saved = ranks[0].state_dict()
    assert saved["lost"]["count"] + ranks[1].counter.count == 1
    resumed = build_loader(config, "train", 8, seed=3, rank=1, world=2)
    resumed.load_state_dict(saved)
    assert (resumed.epoch, resumed.batch) == (ranks[1].epoch, ranks[1].batch) and resumed.counter.count == 0
    assert torch.equal(resumed.next()["image"], ranks[1].next()["image"])
    for loader in (*ranks, resumed):
        loader.close()


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["imagefolder", "wds"])
def test_a_loader_decoding_on_the_gpu_resumes_exactly(tmp_path, source):
    """GPU decode keeps the CPU decode's position and loss bookkeeping: the batches after a resume are those of
    the loader never stopped, bit for bit, and so is its state."""
    path = (_folder(tmp_path, bad=(4,)) if source == "imagefolder" else
            _shards(tmp_path, n_shards=2, per_shard=24, bad=("k1-3",)))
    config = dataclasses.replace(_loader_config(source, path, 2), decode="gpu", img_size=16)
    loader = build_loader(config, "train", 8, seed=3, device="cuda")
    assert loader.finisher.backend is not None and loader.prep.gpu
    taken = [(loader.next(), loader.state_dict()) for _ in range(5)]
    loader.close()
    resumed = build_loader(config, "train", 8, seed=3, device="cuda")
    resumed.load_state_dict(taken[1][1])
    for batch, state in taken[2:]:
        again = resumed.next()
        assert torch.equal(again["image"], batch["image"]) and torch.equal(again["label"], batch["label"])
        assert resumed.state_dict() == state
    resumed.close()
