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
from test_decode import _folder, _folder_run, _loader_config, _shards

STEPS = 12
GPU_STEPS = 48  # a GPU runs 12 tiny steps faster than the poll below can catch a step between them


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An image folder with one damaged file, and dres-prep's shards of it (which leave that file out)."""
    root = tmp_path_factory.mktemp("data")
    (root / "images").mkdir()
    images = _folder(root / "images", bad=(4,))
    prepare_shards(images, str(root / "shards"), short_side=16, shard_size=8, workers=1, log=lambda m: None)
    return {"imagefolder": images, "wds": str(root / "shards")}


def _run(tmp_path, source, path, workers, out, flags=(), extra=(), steps=STEPS):
    return _folder_run(tmp_path, out, steps, flags=flags, extra=[
        f"data.name={source}", f"data.path={path}", f"data.num_workers={workers}", "ckpt.every=2", "ckpt.keep=1",
        *(["data.finish_ahead=0"] if workers == 0 else []), *extra])  # else batches finished 2 ahead


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _logged(out) -> int:
    """Steps in metrics.jsonl while the run writes it (whole lines only)."""
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def _ended(proc, what):
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # a hang fails with where the run's threads were (PYTHONFAULTHANDLER)
        proc.send_signal(signal.SIGABRT)
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"the {what} run still ran after 300 s:\n{stdout[-2000:]}\n{stderr[-8000:]}") from None
    assert proc.returncode == 0, (what, stdout, stderr)
    return stdout + stderr


def _kill_and_resume(tmp_path, source, path, workers, extra=(), steps=STEPS) -> tuple[str, str, str]:
    """An uninterrupted run into ``full`` beside one into ``cut`` killed with SIGKILL after a random step past the
    first checkpoint (no handler runs, no checkpoint of that moment) and resumed with --resume auto from its last
    checkpoint to the end; returns what the uninterrupted run said, what the resumed one said and the kill's step."""
    kill_after = random.randint(3, steps - 4)
    full = _run(tmp_path, source, path, workers, tmp_path / "full", extra=extra, steps=steps)
    cut = tmp_path / "cut"
    killed = _run(tmp_path, source, path, workers, cut, extra=extra, steps=steps)
    while killed.poll() is None and _logged(cut) < kill_after:
        time.sleep(0.01)
    if killed.poll() is not None:
        stdout, stderr = killed.communicate()
        raise AssertionError(f"the run ended (status {killed.returncode}) before the kill after step {kill_after}:\n"
                             f"{stdout[-2000:]}\n{stderr[-4000:]}")
    os.killpg(killed.pid, signal.SIGKILL)
    stdout, stderr = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, (kill_after, stdout, stderr)
    logged = _logged(cut)
    assert logged < steps, f"the run ended before the kill after step {kill_after}"
    said = _ended(_run(tmp_path, source, path, workers, cut, ["--resume", "auto"], extra, steps), "resumed")
    assert "[dres] resumed from" in said, said
    return _ended(full, "uninterrupted"), said, f"killed after step {kill_after} ({logged} logged)"


def _losses_and_lost_data(tmp_path) -> list:
    """Per run (``cut``, ``full``): metrics.jsonl's (step, loss) and summary.json's lost data."""
    return [([(r["step"], r["loss"]) for r in _records(out)],
             json.loads((out / "summary.json").read_text())["lost_data"]) for out in (tmp_path / "cut", tmp_path / "full")]


@pytest.mark.parametrize("source,workers", [("imagefolder", 0), ("imagefolder", 2), ("wds", 0), ("wds", 2)])
def test_a_run_killed_at_a_random_step_resumes_as_if_never_killed(tmp_path, data, source, workers):
    """Killed at a random step and resumed (:func:`_kill_and_resume`), a run's metrics.jsonl (the steps past the
    checkpoint, logged again) and summary.json's lost data are the uninterrupted run's."""
    _, _, context = _kill_and_resume(tmp_path, source, data[source], workers)
    (losses, lost), (want_losses, want_lost) = _losses_and_lost_data(tmp_path)
    assert losses == want_losses and lost == want_lost, context
    assert lost["corrupt_samples"] == (1 if source == "imagefolder" else 0)
    assert len(lost["dropped_by_prep"]) == (1 if source == "wds" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["imagefolder", "wds"])
def test_a_run_decoding_on_the_gpu_killed_at_a_random_step_resumes_as_if_never_killed(tmp_path, data, source):
    """The same on a GPU with data.decode=gpu (the workers pass the JPEG bytes, the training process decodes the
    batch with nvJPEG and crops it with its kernel, finished 2 batches ahead): the resumed run logs the
    uninterrupted run's losses and lost data. Bit for bit where two uninterrupted runs agree bit for bit (the
    GPU's kernels deterministic); else to float32 rounding, and the step count and lost data exactly."""
    gpu = ["device=cuda", "data.decode=gpu"]
    said, _, context = _kill_and_resume(tmp_path, source, data[source], 2, gpu, GPU_STEPS)
    assert f"[dres] data: {source}, decoded on the GPU (" in said, said
    (losses, lost), (want_losses, want_lost) = _losses_and_lost_data(tmp_path)
    assert lost == want_lost and [s for s, _ in losses] == [s for s, _ in want_losses] == list(range(1, GPU_STEPS + 1))
    _ended(_run(tmp_path, source, data[source], 2, tmp_path / "again", extra=gpu, steps=GPU_STEPS),
           "a second uninterrupted run")
    again = [(r["step"], r["loss"]) for r in _records(tmp_path / "again")]
    if again == want_losses:
        assert losses == want_losses, context
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{context}: {m}")


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
    """A checkpoint of fewer ranks gives the ranks it lacks rank 0's loader state (checkpoint.of_rank): they take
    its position and count their own losses afresh."""
    config = dataclasses.replace(_loader_config("imagefolder", _folder(tmp_path, bad=(4,)), 0), num_workers=0)
    ranks = [build_loader(config, "train", 8, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(3):  # an epoch: every file met once
        for loader in ranks:
            loader.next()
    saved = ranks[0].state_dict()
    assert saved["lost"]["count"] == 1 and ranks[1].counter.count == 0  # rank 0 met the damaged file
    resumed = build_loader(config, "train", 8, seed=3, rank=1, world=2)
    resumed.load_state_dict(saved)
    assert (resumed.epoch, resumed.batch) == (ranks[1].epoch, ranks[1].batch) and resumed.counter.count == 0
    assert torch.equal(resumed.next()["image"], ranks[1].next()["image"])
    for loader in (*ranks, resumed):
        loader.close()


def _ranks_worker(rank, group, root, out):
    os.environ.update(group, RANK=str(rank))
    import torch.distributed as dist

    from dres.train import checkpoint
    from dres.train.results import lost_data_of_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    config = dataclasses.replace(_loader_config("imagefolder", root, 0), num_workers=0)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_loader(config, "train", 8, seed=3, rank=rank, world=world)
    for _ in range(3):  # an epoch: every file met once, by one rank
        loader.next()
    saved = loader.state_dict()
    checkpoint.save(f"{out}/checkpoints", 3, model, optimizer, {"data": saved}, dcp_format=False)
    resumed = build_loader(config, "train", 8, seed=3, rank=rank, world=world)
    resumed.load_state_dict(checkpoint.load(f"{out}/checkpoints", model, optimizer)["data"])
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"saved": saved, "resumed": resumed.state_dict(), "summary": lost_data_of_ranks(loader.counter)}, f)
    for each in (loader, resumed):
        each.close()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's static destructors (test_train_fsdp.py's _worker says why)


def test_every_ranks_lost_data_count_survives_a_resume(tmp_path):
    """Two gloo processes save one checkpoint: it holds each rank's loader state, and each rank resumes its own
    position and the lost data it counted (each met damaged files the other never saw); summary.json's lost data
    holds both ranks'."""
    import torch.multiprocessing as mp
    from helpers import process_group

    (tmp_path / "images").mkdir()
    root = _folder(tmp_path / "images", bad=(2, 4, 13, 16))
    with process_group(2) as group:
        mp.spawn(_ranks_worker, args=(group, root, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["resumed"] == got["saved"] and got["saved"]["rank"] == r
    counts = [got["saved"]["lost"]["count"] for got in ranks]
    assert counts == [2, 2], counts  # the four damaged files, two met by each rank
    assert not set(ranks[0]["saved"]["lost"]["keys"]) & set(ranks[1]["saved"]["lost"]["keys"])
    for got in ranks:
        assert got["summary"]["corrupt_samples"] == 4 and len(got["summary"]["lost_files"]) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("source", ["imagefolder", "wds"])
def test_a_loader_decoding_on_the_gpu_resumes_exactly(tmp_path, source, threads):
    """GPU decode keeps the CPU decode's position and loss bookkeeping, with one thread finishing batches ahead or
    two at once (each with its own decoder and stream): the batches after a resume are those of the loader never
    stopped, bit for bit, and so is its state."""
    path = (_folder(tmp_path, bad=(4,)) if source == "imagefolder" else
            _shards(tmp_path, n_shards=2, per_shard=24, bad=("k1-3",)))
    config = dataclasses.replace(_loader_config(source, path, 2), decode="gpu", img_size=16, finish_threads=threads)
    loader = build_loader(config, "train", 8, seed=3, device="cuda")
    assert loader.finisher.backend is not None and loader.prep.gpu
    taken = [(loader.next(), loader.state_dict()) for _ in range(5)]
    assert len(loader._replicas) == threads - 1
    loader.close()
    resumed = build_loader(config, "train", 8, seed=3, device="cuda")
    resumed.load_state_dict(taken[1][1])
    for batch, state in taken[2:]:
        again = resumed.next()
        assert torch.equal(again["image"], batch["image"]) and torch.equal(again["label"], batch["label"])
        assert resumed.state_dict() == state
    resumed.close()


def test_a_loader_with_workers_imports_the_cpu_decoder_before_they_fork(tmp_path):
    """Forked workers inherit the decoder's module instead of importing it each (seconds) at every epoch's start."""
    script = "\n".join([
        "import dataclasses, pathlib, sys",
        "from dres.data import build_loader",
        "from test_decode import _folder, _loader_config",
        f"config = _loader_config('imagefolder', _folder(pathlib.Path({str(tmp_path)!r})), 0)",
        "build_loader(dataclasses.replace(config, num_workers=0), 'train', 8)",
        "print('torchvision.io' in sys.modules)",
        "build_loader(config, 'train', 8)",
        "print('torchvision.io' in sys.modules)"])
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
