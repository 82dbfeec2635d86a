"""The optimizer switch (dres.train.optim: optim.name adamw | sgd), label smoothing for classify, their
config checks, the CUDA-graph decision for SGD, and the fingerprint that keeps a run on its optimizer.
On the device (``gpu``): graphed SGD steps make no host synchronisation (graphed against eager steps:
test_step.py's 'sgd' cases)."""

import json
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dres.train import cli, rundir
from dres.train.classify import TASK as CLASSIFY
from dres.train.config import ConfigError, build_config, to_dict
from dres.train.rundir import fingerprint, fingerprint_diff
from dres.train.step import graph_plan
from dres.train.loop import Trainer
from dres.train.optim import param_groups
from dres.train.optim import build_optimizer, peak_lr
from dres.train.tasks import config_for

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class _Net(nn.Module):
    """Conv + BN + Linear: 4-D and 2-D weights decay, biases and BN affine do not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def _cfg(*overrides):
    return build_config("classify", None, ["model.num_classes=10"] + list(overrides))


def _groups(model, cfg):
    return param_groups(model, cfg.optim.weight_decay)[0]


# ---------------------------------------------------------------------------------- construction
def test_adamw_is_built_as_before():
    cfg = _cfg("optim.lr=3e-4", "optim.weight_decay=0.05", "optim.betas=[0.9,0.999]", "optim.eps=1e-7")
    model = _Net()
    for device, capturable in [(CPU, False), (CUDA, False), (CUDA, True)]:
        opt = build_optimizer(cfg, _groups(model, cfg), device, "bf16", capturable=capturable)
        # the construction the trainer had before optim.name existed, argument for argument
        want = torch.optim.AdamW(_groups(model, cfg), lr=3e-4, betas=(0.9, 0.999), eps=1e-7,
                                 **({"fused": True} if device.type == "cuda" else {}),
                                 **({"capturable": True} if capturable else {}))
        assert type(opt) is torch.optim.AdamW and opt.defaults == want.defaults
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
               [{k: v for k, v in g.items() if k != "params"} for g in want.param_groups]


def test_sgd_is_nesterov_momentum_with_the_trainer_groups():
    cfg = _cfg("optim.name=sgd", "optim.blr=0.1", "batch_size=512", "optim.weight_decay=2e-5",
               "optim.momentum=0.8")
    model = _Net()
    opt = build_optimizer(cfg, _groups(model, cfg), CPU, "bf16", capturable=False)
    assert type(opt) is torch.optim.SGD and peak_lr(cfg) == pytest.approx(0.2)  # 0.1 x 512 / 256
    decay, no_decay = opt.param_groups
    assert [id(p) for p in decay["params"]] == [id(model.conv.weight), id(model.fc.weight)]
    assert {id(p) for p in no_decay["params"]} == {id(model.bn.weight), id(model.bn.bias), id(model.fc.bias)}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (2e-5, 0.0)
    for g in opt.param_groups:
        assert (g["lr"], g["momentum"], g["nesterov"], g["dampening"]) == (pytest.approx(0.2), 0.8, True, 0)
        assert not g["fused"]  # CPU
    assert build_optimizer(cfg, _groups(model, cfg), CUDA, "bf16", capturable=True).defaults["fused"]
    assert not build_optimizer(_cfg("optim.name=sgd", "optim.fused=false"), _groups(model, cfg), CUDA, "bf16",
                               capturable=False).defaults["fused"]


def test_sgd_under_fsdp_is_not_fused_and_a_graph_needs_the_fused_kernel():
    model = _Net()
    cfg = _cfg("optim.name=sgd", "dist=fsdp")  # DTensor has no sharding rule for the fused SGD kernel
    assert not build_optimizer(cfg, _groups(model, cfg), CUDA, "bf16", capturable=False).defaults["fused"]
    with pytest.raises(ValueError, match="fused kernel"):
        build_optimizer(_cfg("optim.name=sgd", "optim.fused=false"), _groups(model, cfg), CUDA, "bf16", capturable=True)


@pytest.mark.parametrize("overrides,precision", [(["optim.name=sgd", "optim.fused=false"], "bf16"),
                                                 (["optim.fused=false", "precision=fp16"], "fp16")])
def test_a_capturable_optimizer_is_refused_for_graph_plans_reason(overrides, precision):
    cfg = _cfg(*overrides)
    on, why = graph_plan(cfg, CUDA, precision, 1)
    with pytest.raises(ValueError) as refused:
        build_optimizer(cfg, _groups(_Net(), cfg), CUDA, precision, capturable=True)
    assert not on and f"off ({refused.value}); " in why  # one rule, one message
    assert build_optimizer(cfg, _groups(_Net(), cfg), CUDA, precision, capturable=False)  # eager: built


def test_sgd_steps_like_timms_sgd():
    timm = pytest.importorskip("timm")
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    ours, theirs = _Net(), _Net()
    theirs.load_state_dict(ours.state_dict())
    cfg = _cfg("optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=1e-2")  # wd large enough to matter
    opt_a = build_optimizer(cfg, _groups(ours, cfg), CPU, "bf16", capturable=False)
    opt_b = create_optimizer_v2(theirs, "sgd", lr=0.05, weight_decay=1e-2, momentum=0.9)
    assert timm.__version__ and all(g["nesterov"] for g in opt_b.param_groups)
    x, y = torch.randn(6, 3, 7, 7), torch.randint(0, 5, (6,))
    for _ in range(3):
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_fused_sgd_gets_the_device_lr_tensor_itself():
    """The graphed step hands each group a float32 tensor lr: the fused SGD must pass that tensor (not a
    Python number: no .item()) to torch._fused_sgd_, whose CUDA kernel reads it on the device."""
    p = nn.Parameter(torch.randn(8))
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, fused=True)
    opt.param_groups[0]["lr"] = lr
    seen = []
    real = torch._fused_sgd_

    def spy(*args, **kwargs):
        seen.append(kwargs["lr"])
        return real(*args, **kwargs)

    for _ in range(2):  # the first step creates the momentum buffers; replays see the second kind
        p.grad = torch.randn(8)
        with mock.patch.object(torch, "_fused_sgd_", spy):
            opt.step()
    assert len(seen) == 2 and all(s is lr for s in seen)


# -------------------------------------------------------------------------------- label smoothing
def test_label_smoothing_matches_torch_and_the_formula():
    torch.manual_seed(1)
    logits = torch.randn(7, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (7,))

    class Head(nn.Module):
        def forward(self, img):
            return logits

    for s in (0.0, 0.1, 0.35):
        cfg = _cfg(f"optim.label_smoothing={s}")
        loss, metrics = CLASSIFY.loss(Head(), {"image": torch.zeros(7), "label": labels}, cfg)
        want = F.cross_entropy(logits, labels, label_smoothing=s)
        logp = logits.log_softmax(1)  # (1 - s) * NLL + s * mean over classes of -log p
        formula = ((1 - s) * -logp.gather(1, labels[:, None])[:, 0] - s * logp.mean(1)).mean()
        # the task takes the cross-entropy of fp32 logits: exactly torch's, and the float64 formula to fp32
        torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels, label_smoothing=s), rtol=0, atol=0)
        torch.testing.assert_close(want, formula, rtol=1e-12, atol=0)
        torch.testing.assert_close(loss.double(), formula, rtol=1e-6, atol=0)
        assert "train_acc" in metrics
    assert _cfg().optim.label_smoothing == 0.0  # off unless asked


# --------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("overrides,task,key", [
    (["optim.momentum=-0.1"], "classify", "optim.momentum"),
    (["optim.name=sgd", "optim.momentum=0"], "classify", "optim.momentum"),
    (["optim.momentum=1.0"], "classify", "optim.momentum"),
    (["optim.label_smoothing=1.0"], "classify", "optim.label_smoothing"),
    (["optim.label_smoothing=-0.1"], "classify", "optim.label_smoothing"),
    (["optim.label_smoothing=0.1"], "mae", "optim.label_smoothing"),
    (["optim.label_smoothing=0.1"], "uvit", "optim.label_smoothing"),
    (["optim.label_smoothing=0.1", "optim.name=sgd"], "mae", "optim.label_smoothing"),
    (["optim.name=adam"], "classify", "optim.name"),
])
def test_bad_values_are_one_line_errors(overrides, task, key):
    base = ["model.num_classes=10"] if task == "classify" else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        config_for(task, None, base + overrides)  # the run's config, its task's checks included
    assert "\n" not in str(e.value)


def test_cli_reports_a_bad_optimizer_value_with_exit_2(tmp_path, capsys):
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(tmp_path), "--set", "optim.label_smoothing=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optim.label_smoothing" in err and "classify" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------ CUDA graphs
def test_graph_plan_for_sgd():
    on, why = graph_plan(_cfg("optim.name=sgd", "cuda_graphs=true"), CUDA, "bf16", 1)
    assert on and why.startswith("on")  # the fused SGD reads the graph's device lr
    assert graph_plan(_cfg("optim.name=sgd"), CUDA, "bf16", 1)[0]  # auto as well
    on, why = graph_plan(_cfg("optim.name=sgd", "optim.fused=false"), CUDA, "bf16", 1)
    assert not on and "fused kernel" in why and why.endswith("the step runs eagerly") and "\n" not in why
    on, why = graph_plan(_cfg("optim.name=sgd", "optim.fused=false"), CUDA, "fp16", 1)
    assert not on and "SGD" in why
    assert graph_plan(_cfg("optim.name=sgd", "precision=fp16", "cuda_graphs=true"), CUDA, "fp16", 1)[0]  # GradScaler + fused SGD
    assert not graph_plan(_cfg("optim.name=sgd"), CPU, "fp32", 1)[0]


# ------------------------------------------------------------------------------ a CPU training run
_CLASSIFY = ["data.name=synthetic", "data.synthetic_size=64", "data.img_size=16", "model.img_size=16",
             "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
             "model.num_classes=10", "batch_size=16", "optim.warmup_steps=1", "log.every=1",
             "log.progress=false", "log.tensorboard=false", "ckpt.every=0", "device=cpu"]


def test_cpu_classify_run_with_sgd_and_label_smoothing(tmp_path):
    cfg = build_config("classify", None, _CLASSIFY + ["optim.name=sgd", "optim.blr=0.1", "optim.weight_decay=2e-5",
                                                      "optim.label_smoothing=0.1", "steps=3", f"out={tmp_path}"])
    # a second trainer of the same config starts from the same weights, data order and random state
    ref = Trainer(cfg, CLASSIFY, log=lambda m: None).setup()
    ref.raw_model.train()
    batch = ref.loader.next()
    with torch.no_grad():
        first_loss = F.cross_entropy(ref.raw_model(batch["image"]).float(), batch["label"], label_smoothing=0.1)
    trainer = Trainer(cfg, CLASSIFY, log=lambda m: None).setup()
    assert type(trainer.optimizer) is torch.optim.SGD and trainer.graphed is None and trainer.step_fn == trainer.step_body
    before = [p.detach().clone() for p in trainer.raw_model.parameters()]
    trainer.fit()
    assert len(trainer.history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history)
    assert trainer.history[0]["loss"] == pytest.approx(first_loss.item(), rel=1e-6)
    # 1 warmup step, then cosine over the 2 others (the value after each step is logged)
    assert [h["lr"] for h in trainer.history] == pytest.approx([peak_lr(cfg) * f for f in (1.0, 0.5, 0.0)], abs=1e-12)
    for p, b in zip(trainer.raw_model.parameters(), before):
        assert "momentum_buffer" in trainer.optimizer.state[p] and not torch.equal(p, b)
    assert json.loads((tmp_path / "fingerprint.json").read_text())["optim.name"] == "sgd"


# ----------------------------------------------------------------------------------- fingerprint
def test_fingerprint_keeps_a_run_on_its_optimizer(tmp_path):
    adamw, sgd = _cfg(), _cfg("optim.name=sgd", "optim.label_smoothing=0.1", "optim.momentum=0.8")
    assert fingerprint(adamw)["optim.name"] == "adamw" and fingerprint(sgd)["optim.name"] == "sgd"
    diff = fingerprint_diff(fingerprint(adamw), fingerprint(sgd))
    assert diff == "optim.name 'adamw' (saved) vs 'sgd' (now)"  # smoothing and momentum may change
    # a record from before optim.name existed was an AdamW run
    old = {k: v for k, v in fingerprint(adamw).items() if k != "optim.name"}
    assert fingerprint_diff(old, fingerprint(adamw)) == ""
    assert "optim.name 'adamw' (saved) vs 'sgd' (now)" in fingerprint_diff(old, fingerprint(sgd))
    old_config = to_dict(adamw)
    del old_config["optim"]["name"]
    assert fingerprint_diff(fingerprint(old_config), fingerprint(adamw)) == ""
    # resuming an AdamW run directory with optim.name=sgd stops with one line naming the key
    out = tmp_path / "run"
    out.mkdir()
    rundir.write_fingerprint(out, fingerprint(adamw))
    rundir.claim(out, adamw, resume="auto", log=lambda m: None)
    with pytest.raises(rundir.RunDirError, match="optim.name 'adamw' \\(saved\\) vs 'sgd' \\(now\\)"):
        rundir.claim(out, sgd, resume="auto", log=lambda m: None)


# -------------------------------------------------------------------------------------------- GPU
# graphed SGD steps against eager ones: test_step.py's CASES 'sgd' and 'sgd_fp16'
@pytest.mark.gpu
def test_graphed_sgd_steps_do_not_synchronise_with_the_host(tmp_path):
    from test_step import _CLASSIFY as GPU_CLASSIFY, _task

    cfg = build_config("classify", None, GPU_CLASSIFY + ["optim.name=sgd", "optim.label_smoothing=0.1",
                                                         "cuda_graphs=true", "steps=12", f"out={tmp_path}"])
    trainer = Trainer(cfg, _task("classify"), log=lambda m: None).setup()
    trainer.model.train()
    for _ in range(4):  # warm-up steps and the capture synchronise; they are not measured
        trainer.train_step(trainer.loader.next())
    torch.cuda.synchronize()
    assert trainer.graphed.graph is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [trainer.train_step(trainer.loader.next())[0].clone() for _ in range(6)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(torch.stack(losses)).all()
