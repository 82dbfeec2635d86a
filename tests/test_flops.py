"""Training FLOPs (dres.models.flops) against torch.utils.flop_counter.FlopCounterMode's count of one
forward + backward of every model family the trainers build, and the model TFLOP/s and MFU the trainer
reports (metrics.jsonl, summary.json, log lines; the dense bf16 peak by card name).

FlopCounterMode counts the fused SDPA kernels' backward with the recomputed attention scores (5 matmuls
against the forward's 2, and the CPU flash kernel not at all); the counts here run attention on the math
backend, whose backward is the 4 matmuls of the model FLOPs convention (3x the forward)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dres.eval import VPSDE, noise_prediction_loss
from dres.models import ResNetClassifier
from dres.models.flops import conv_out_size, training_flops
from dres.train import common
from dres.train.config import build_config
from dres.train.loop import Trainer
from dres.train.mae import TASK as MAE_TASK
from tiny_models import tiny_classifier, tiny_mae, tiny_uvit

BATCH = 3


def counted(loss_fn) -> int:
    """FlopCounterMode's FLOPs of ``loss_fn()`` and its backward."""
    torch.manual_seed(0)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        loss_fn().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("variant", ["baseline", "official", "paper"])
@pytest.mark.parametrize("mask_ratio", [0.75, 0.6])
def test_mae_flops_match_the_counter(variant, mask_ratio):
    # 16 patches: 4 visible at 0.75, int(6.4) = 6 at 0.6; 3 decoder blocks take the skips of encoder blocks 3 and 1
    model = tiny_mae(variant=variant, img_size=16, depth=4, decoder_depth=3,
                       decoder_embed_dim=48, mask_ratio=mask_ratio)
    imgs = torch.randn(BATCH, 3, 16, 16)
    assert training_flops(model, BATCH) == counted(lambda: model(imgs)[0])


@pytest.mark.parametrize("overrides", [{}, {"mlp_time_embed": True, "num_classes": 5}, {"conv": False}])
def test_uvit_flops_match_the_counter(overrides):
    model = tiny_uvit(**overrides)
    x = torch.randn(BATCH, 3, 8, 8)
    y = torch.randint(0, 5, (BATCH,)) if overrides.get("num_classes") else None
    assert training_flops(model, BATCH) == counted(lambda: noise_prediction_loss(model, x, VPSDE(), y=y))


@pytest.mark.parametrize("global_pool", ["cls", "avg"])
def test_vit_classifier_flops_match_the_counter(global_pool):
    model = tiny_classifier(global_pool=global_pool)
    x, labels = torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))
    assert training_flops(model, BATCH) == counted(lambda: F.cross_entropy(model(x), labels))


# 28 px: odd map sides (7 after the stem, 4 after a stride-2 stage), where ResNet-D's ceil-mode average
# pool and the strided convolutions round differently
@pytest.mark.parametrize("arch,img_size", [("resnet18", 32), ("resnet50", 28), ("resnet50d", 28)])
def test_resnet_flops_match_the_counter(arch, img_size):
    model = ResNetClassifier(arch, num_classes=10)
    x, labels = torch.randn(2, 3, img_size, img_size), torch.randint(0, 10, (2,))
    assert training_flops(model, 2, img_size) == counted(lambda: F.cross_entropy(model(x), labels))


def test_conv_out_size_follows_torch():
    for size in range(5, 12):
        for kernel, stride, padding, ceil_mode in [(3, 2, 1, False), (2, 2, 0, True), (3, 2, 1, True), (7, 2, 3, False)]:
            pool = torch.nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode)
            assert pool(torch.zeros(1, 1, size, size)).shape[-1] == conv_out_size(size, kernel, stride, padding,
                                                                                  ceil_mode=ceil_mode)


def test_unknown_models_have_no_count_and_a_resnet_needs_its_image_size():
    assert training_flops(torch.nn.Linear(4, 4), 2) is None
    with pytest.raises(ValueError, match="img_size"):
        training_flops(ResNetClassifier("resnet18"), 2)


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05),
    ("NVIDIA L4", 121.0), ("NVIDIA GeForce RTX 4090", None)])
def test_dense_bf16_peak_by_card_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert common.dense_bf16_peak(torch.device("cuda", 0)) == (name, tflops)


def test_cpu_has_no_peak_and_mfu_is_per_gpu():
    assert common.dense_bf16_peak(torch.device("cpu")) == ("cpu", None)
    # 4,000 img/s of 60 GFLOP over 2 GPUs: 120 TFLOP/s per GPU, 0.12 of a 1,000 TFLOP/s card
    rates = common.model_flops_rate(4000.0, 60e9, 2, 1000.0)
    assert rates == {"model_tflops": pytest.approx(120.0), "mfu": pytest.approx(0.12)}
    assert common.flops_rate_text(rates) == ", 120.0 model TFLOP/s per GPU, MFU 12.0%"
    assert common.model_flops_rate(4000.0, 60e9, 2, None) == {"model_tflops": pytest.approx(120.0), "mfu": None}
    assert common.model_flops_rate(4000.0, None, 1, 1000.0) == {"model_tflops": None, "mfu": None}
    assert common.flops_rate_text({"model_tflops": None, "mfu": None}) == ""
    assert common.flops_rate_text({"model_tflops": 0.0123, "mfu": None}) == ", 12.30 model GFLOP/s per GPU"


def test_trainer_reports_model_tflops_and_says_why_mfu_is_missing_on_cpu(tmp_path):
    overrides = ["data.name=synthetic", "data.synthetic_size=256", "data.img_size=16", "model.variant=official",
                 "model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                 "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2", "batch_size=32",
                 "accum_steps=2", "log.every=1", "log.progress=false", "log.tensorboard=false", "eval.probe=false",
                 "eval.knn=false", "ckpt.every=0", "device=cpu", "steps=2", f"out={tmp_path}"]
    lines = []
    trainer = Trainer(build_config("mae", None, overrides), MAE_TASK, log=lines.append).setup()
    # the count is of one micro-batch of 16 images (the official decoder embeds its start once a batch)
    per_image = training_flops(trainer.raw_model, 16) / 16
    assert trainer.flops_per_image == per_image and trainer.peak_tflops is None
    assert any(f"model FLOPs: {per_image / 1e9:.4g} GFLOP per training image" in m
               and "mfu is not reported, no dense bf16 peak is known for cpu" in m for m in lines), lines
    trainer.fit()
    trainer.finish()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for r in recs + [summary]:
        assert r["model_tflops"] == pytest.approx(r["img_per_s"] * per_image / 1e12) and r["mfu"] is None
    assert summary["gflop_per_image"] == pytest.approx(per_image / 1e9) and summary["peak_bf16_tflops"] is None
    # a CPU run's closing line gives no FLOP rate (the metrics keep model_tflops) and no MFU
    assert any(m.startswith("[dres] done:") and "FLOP/s" not in m and "MFU" not in m for m in lines), lines
