"""Multi-node launch on the CPU: two ``dres-launch --nnodes 2 --node_rank 0|1 --nproc_per_node 1`` processes
(gloo, static rendezvous at 127.0.0.1), as docs/usage.md's multi-node command starts them on two machines.
The trainer starts through its CLI, the two ranks train disjoint halves of every global batch, their
DDP replicas end identical, and both exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import free_port

REPO = Path(__file__).resolve().parent.parent

# Each node runs the real CLI (dres.train.cli.main) with the classify task wrapped so that every rank
# records a digest of each image it trains on and a checksum of its final parameters.
NODE_ENTRY = textwrap.dedent('''
    import hashlib, json, os, sys
    from unittest import mock

    import torch

    from dres.train import cli
    from dres.train.classify import TASK

    seen = []


    class RecordingTask:
        def __getattr__(self, name):
            return getattr(TASK, name)

        def loss(self, model, batch, cfg):
            seen.extend(hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in batch["image"])
            return TASK.loss(model, batch, cfg)

        def evaluate(self, trainer):
            params = torch.cat([p.detach().flatten().double() for p in trainer.raw_model.parameters()])
            with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
                json.dump({"seen": seen, "world": trainer.info.world, "param_sum": params.sum().item(),
                           "param_abs_sum": params.abs().sum().item()}, f)
            return {}


    with mock.patch.object(cli, "get_task", lambda name: RecordingTask()):
        status = cli.main(sys.argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    # past the run, its process group destroyed: gloo's threads can still abort the interpreter's teardown
    # ("terminate called without an active exception", a node's status -6; test_train_fsdp.py says when)
    os._exit(status or 0)
''')

STEPS, GLOBAL_BATCH = 3, 16
OVERRIDES = ["device=cpu", "data.name=synthetic", "data.synthetic_size=64", "data.img_size=8", "data.in_chans=1",
             "data.mean=[0.5]", "data.std=[0.25]", "data.aug=none", "model.img_size=8", "model.patch_size=4",
             "model.in_chans=1", "model.embed_dim=16", "model.depth=1", "model.num_heads=2", "model.num_classes=10",
             f"batch_size={GLOBAL_BATCH}", f"steps={STEPS}", "optim.lr=1e-3", "optim.warmup_steps=0", "log.every=1",
             "log.progress=false", "log.tensorboard=false", "ckpt.every=0", "compile=false", "dist=ddp", "threads=1"]


@pytest.mark.slow
def test_two_nodes_shard_the_data_and_finish(tmp_path):
    entry = tmp_path / "node_entry.py"
    entry.write_text(NODE_ENTRY)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    sets = [a for kv in OVERRIDES for a in ("--set", kv)]
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "dres.train.launch", "--nnodes", "2", "--node_rank", str(node_rank),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(entry), str(tmp_path), "classify", "--preset", "classify_cifar10", "--out", str(tmp_path / "run"), *sets]
        nodes.append(subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, out in zip(nodes, outputs):
        assert p.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    seen0, seen1 = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    # each rank trains its half of every global batch; no sample twice within the epoch
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == STEPS * GLOBAL_BATCH // 2
    assert len(seen0) == len(seen1) == STEPS * GLOBAL_BATCH // 2
    assert not seen0 & seen1
    # DDP kept the replicas in step
    assert ranks[0]["param_sum"] == pytest.approx(ranks[1]["param_sum"], rel=1e-6, abs=1e-6)
    assert ranks[0]["param_abs_sum"] == pytest.approx(ranks[1]["param_abs_sum"], rel=1e-6)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))


def test_several_processes_with_dist_none_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE > 1) dist=none would train one separate model per process: refused
    before any process group is joined or anything is written."""
    from dres.train import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    argv = ["classify", "--preset", "classify_cifar10", "--out", str(out)]
    argv += [a for kv in OVERRIDES if not kv.startswith("dist=") for a in ("--set", kv)] + ["--set", "dist=none"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 processes with dist=none" in err and "dist=ddp" in err
    assert not out.exists()
