"""fp8=true (train/float8.py): which Linear layers become float8 matmuls, that the model still computes
what it did within float8's rounding, keeps its state-dict keys, and trains; the one-line refusals. On the
CPU torch emulates the float8 matmul; the GPU test compares a compiled, captured float8 run with bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from dres.models import MAE
from dres.train import float8

pytest.importorskip("torchao")


def _tiny_mae():
    torch.manual_seed(0)
    # baseline, alpha 1: no zero-initialised branch ends, so every Linear carries signal
    return MAE(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=2, decoder_embed_dim=32, decoder_depth=1,
               decoder_num_heads=2, variant="baseline", alpha_min=1.0)


def test_only_the_blocks_linears_are_converted_and_the_keys_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = _tiny_mae()
    keys = list(model.state_dict())
    names = float8.block_linears(model)
    # qkv, proj, fc1, fc2 in each of the 2 encoder blocks and the 1 decoder block
    assert len(names) == 12 and all(n.rsplit(".", 1)[-1] in ("qkv", "proj", "fc1", "fc2") for n in names)
    assert float8.apply_float8(model, torch.device("cpu")) == 12
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == names
    assert not any(isinstance(m, Float8Linear) for n, m in model.named_modules() if n not in names)
    assert list(model.state_dict()) == keys  # checkpoints and exports unchanged
    assert all(m.fused is False for m in model.modules() if type(m).__name__ == "Mlp")  # the fused MLP would bypass it


def test_a_converted_model_computes_what_it_did_within_float8_rounding():
    ref, fp8 = _tiny_mae(), _tiny_mae()
    float8.apply_float8(fp8, torch.device("cpu"))
    x = torch.randn(4, 3, 16, 16)
    torch.manual_seed(1)
    loss_ref, pred_ref, _ = ref(x)
    torch.manual_seed(1)
    loss_fp8, pred_fp8, _ = fp8(x)
    # e4m3 keeps 3 mantissa bits: a few percent per matmul (and not nothing: the matmuls did change)
    assert 1e-3 < (pred_fp8 - pred_ref).norm() / pred_ref.norm() < 0.1
    loss_ref.backward()
    loss_fp8.backward()
    for (n, a), b in zip(ref.named_parameters(), fp8.parameters()):
        if a.grad is not None and a.grad.norm() > 0:
            assert (b.grad - a.grad).norm() / a.grad.norm() < 0.25, n


def test_refusals_are_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    with pytest.raises(float8.Float8Unavailable, match=r"^fp8=true needs torchao: pip install 'dres\[fp8\]'"):
        float8.apply_float8(_tiny_mae(), torch.device("cpu"))
    monkeypatch.undo()
    plain = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(float8.Float8Unavailable, match="has no transformer-block Linear layers to convert"):
        float8.apply_float8(plain, torch.device("cpu"))


_TINY = ["data.name=synthetic", "data.synthetic_size=256", "data.img_size=16", "model.img_size=16", "model.patch_size=4",
         "model.embed_dim=64", "model.depth=2", "model.num_heads=2", "model.decoder_embed_dim=32", "model.decoder_depth=1",
         "model.decoder_num_heads=2", "model.variant=baseline", "model.alpha_min=1.0", "batch_size=32", "log.every=1",
         "log.progress=false", "log.tensorboard=false", "eval.probe=false", "eval.knn=false", "ckpt.every=0"]


def _fit(out, overrides, steps):
    from dres.train.config import build_config
    from dres.train.loop import Trainer
    from dres.train.mae import MAETask

    lines = []
    cfg = build_config("mae", None, _TINY + list(overrides) + [f"steps={steps}", f"out={out}"])
    trainer = Trainer(cfg, MAETask(), log=lines.append).setup()
    trainer.fit()
    return trainer, lines


def test_the_trainer_trains_with_float8_matmuls(tmp_path):
    trainer, lines = _fit(tmp_path, ["device=cpu", "fp8=true"], 3)
    assert any("fp8: 12 Linear layers of the blocks run float8 matmuls" in m for m in lines), lines
    assert len(trainer.history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history)


def test_a_model_without_blocks_is_refused_in_one_line(tmp_path):
    from dres.train.config import ConfigError, build_config
    from dres.train.loop import Trainer
    from dres.train.classify import ClassifyTask

    cfg = build_config("classify", "classify_resnet50d_cifar10", ["device=cpu", "fp8=true", "data.name=synthetic",
                                                                  "data.synthetic_size=64", "batch_size=16",
                                                                  f"out={tmp_path}"])
    with pytest.raises(ConfigError, match="has no transformer-block Linear layers to convert"):
        Trainer(cfg, ClassifyTask(), log=lambda m: None).setup()


@pytest.mark.gpu
def test_gpu_compiled_captured_float8_run_follows_the_bf16_run(tmp_path):
    if torch.cuda.get_device_capability() < float8.FLOAT8_MIN_CAPABILITY:
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    common = ["compile=true", "compile_scope=model", "cuda_graphs=true", "optim.blr=1e-3", "optim.warmup_steps=3"]
    fp8, _ = _fit(tmp_path / "fp8", common + ["fp8=true"], 20)
    bf16, _ = _fit(tmp_path / "bf16", common, 20)
    assert fp8.graphed is not None and fp8.graphed.graph is not None  # the float8 step was captured
    a, b = (torch.tensor([h["loss"] for h in t.history]) for t in (fp8, bf16))
    assert torch.isfinite(a).all() and (a - b).abs().max() < 0.05 * b.abs().max()
