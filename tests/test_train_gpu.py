"""GPU trainer checks (run on the device): bf16 + per-unit compile + fused AdamW on the CIFAR-10
shards, fp16 with GradScaler, activation checkpointing."""

import json
import subprocess
import sys

import pytest
import torch

from dres.data import default_cifar10_dir

pytestmark = pytest.mark.gpu
needs_cifar = pytest.mark.skipif(not (default_cifar10_dir() / "manifest.json").exists(), reason="CIFAR-10 shards absent")


def _run(tmp_path, *sets):
    args = [sys.executable, "-m", "dres.train.mae", "--preset", "mae_cifar10", "--out", str(tmp_path),
            "--set", "log.progress=false", "--set", "data.limit=8192", "--set", "eval.probe_epochs=5",
            "--set", "eval.max_train=4096", "--set", "eval.max_test=1000"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((tmp_path / "summary.json").read_text()), [
        json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@needs_cifar
def test_mae_cifar10_bf16_compile(tmp_path):
    # one warmup epoch (16 steps at data.limit 8192, batch 512): the preset's 20 would keep the
    # learning rate near zero for all 60 steps, and the loss flat at its start (~1, zero-init decoder)
    s, m = _run(tmp_path, "steps=60", "log.every=10", "compile=true", "precision=bf16", "optim.warmup_epochs=1",
                "eval.probe_epochs=50")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
    assert m[-1]["loss"] < m[0]["loss"], [r["loss"] for r in m]
    assert s["img_per_s"] > 0 and s["peak_mem_gib"] > 0
    # The evaluation runs on the compiled model's encoder. After 60 steps its class token carries
    # little: every branch starts at zero (alpha_min 0.6), so at initialisation the token is the same
    # for all images; the probe measures 0.12-0.135 on an H200 against chance 0.10, and 0.35
    # after 300 steps (records/benchmarks). Above chance is what 60 steps can promise.
    assert 0.10 < s["eval"]["linear_probe_acc"] <= 1.0


@needs_cifar
@pytest.mark.parametrize("extra", [["precision=fp16"], ["act_ckpt=selective", "compile=false"],
                                   ["act_ckpt=full", "accum_steps=2", "compile=false"]])
def test_mae_cifar10_precisions_and_checkpointing(tmp_path, extra):
    s, m = _run(tmp_path, "steps=20", "log.every=5", "eval.probe=false", "eval.knn=false", *extra)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
