"""The train step (dres.train.step) and its replay timing (dres.train.runlog): on the CPU, which configurations capture and
the device LR table; on the device (``gpu``), graphed steps against eager ones (accumulation,
clipping, EMA, ResidualDroppath, fp16 overflow skips, classification metrics, DDP on two GPUs), exact
resume of a graphed run, steps with no host synchronisation, and the replay time each run reports as
its floor."""

import contextlib
import json
import os
import statistics
import time
from unittest import mock

import pytest
import torch
from helpers import process_group

from dres.nn import Mlp
from dres.ops import csrc_backend
from dres.ops.checks import replayed_launches
from dres.train.config import ConfigError, build_config
from dres.train.loop import Trainer
from dres.train.optim import lr_lambda
from dres.train.runlog import RunLog, steady_timing, window_timing
from dres.train.step import (DDP_WARMUP_STEPS, GraphedStep, TrainStep, fused_mlp_choice, graph_plan, graph_warmup_steps,
                             schedule_table)

CUDA = torch.device("cuda", 0)


# ------------------------------------------------------------------------------------------ CPU
def _plan(overrides=(), device=CUDA, precision="bf16", world=1):
    cfg = build_config("mae", None, list(overrides))
    return graph_plan(cfg, device, precision, world)


class _Linear:
    """A task of one linear layer under a mean-squared loss: ``loss(model, batch, cfg) -> (loss, {"err": ...})``."""

    @staticmethod
    def loss(model, batch, cfg):
        err = model(batch["x"]) - batch["y"]
        return err.square().mean(), {"err": err.abs().mean()}


class _Advances:
    iterations = 0

    def next_iteration(self):
        self.iterations += 1


def _train_step(accum, ema_decay=0.0, clip=0.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    cfg = build_config("mae", None, [f"accum_steps={accum}", f"optim.ema_decay={ema_decay}", f"optim.clip_grad={clip}"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ema = {n: p.detach().clone().float() for n, p in model.named_parameters()} if ema_decay else None
    step = TrainStep(_Linear, cfg, model, model, optimizer, scaler, lambda: torch.autocast("cpu", enabled=False),
                     torch.device("cpu"), ema=ema, droppath=_Advances())
    return step, model


def test_the_train_step_accumulates_micro_batches_into_one_update():
    """accum_steps micro-batches of a batch give the update, loss and metrics of the whole batch at once (equal
    micro-batches of a mean loss); the drop-path controller advances once a step."""
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 2, generator=g)}
    (one, m1), (two, m2) = _train_step(1), _train_step(2)
    loss1, metrics1 = one(batch)
    loss2, metrics2 = two(batch)
    torch.testing.assert_close(loss2, loss1)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p)
    assert metrics1.keys() == metrics2.keys() == {"err"}
    torch.testing.assert_close(metrics2["err"], metrics1["err"])  # the mean of equal micro-batches' means
    assert one.droppath.iterations == two.droppath.iterations == 1 and one.bad is not None and not one.bad


def test_the_train_step_keeps_the_ema_and_a_sticky_non_finite_flag():
    step, model = _train_step(1, ema_decay=0.9, clip=1.0)
    before = {n: t.clone() for n, t in step.ema.items()}
    batch = {"x": torch.ones(2, 4), "y": torch.zeros(2, 2)}
    _, metrics = step(batch)
    assert "grad_norm" in metrics  # clipping reports the norm
    for n, p in model.named_parameters():
        torch.testing.assert_close(step.ema[n], before[n] + 0.1 * (p.detach() - before[n]))  # lerp by 1 - decay
    step({"x": torch.full((2, 4), float("nan")), "y": torch.zeros(2, 2)})
    assert bool(step.bad)
    step({"x": torch.ones(2, 4), "y": torch.zeros(2, 2)})  # a finite step after does not clear it
    assert bool(step.bad)


def test_plan_captures_single_process_cuda_by_default():
    on, why = _plan()
    assert on and why.startswith("on")
    assert _plan(["cuda_graphs=true"])[0]
    assert _plan(["precision=fp16"], precision="fp16")[0]  # GradScaler with the fused AdamW
    assert _plan(["dist=ddp"], world=1)[0]  # a one-process "DDP" run is not wrapped
    assert _plan(["model.drop_path=0.2", "model.droppath_mode=residual_droppath"])[0]  # masks from a device counter


def test_ddp_on_several_processes_is_captured_with_its_all_reduce():
    for setting in ("auto", "true"):
        on, why = _plan(["dist=ddp", f"cuda_graphs={setting}"], world=2)
        assert on and "DDP's gradient all-reduce included" in why and f"{DDP_WARMUP_STEPS} warm-up steps" in why
    assert not _plan(["dist=ddp", "cuda_graphs=false"], world=2)[0]
    cfg = build_config("mae", None, ["dist=ddp"])
    assert graph_warmup_steps(cfg, 2) == DDP_WARMUP_STEPS == 11 and graph_warmup_steps(cfg, 1) == 3
    assert graph_warmup_steps(build_config("mae", None, []), 1) == 3


def test_auto_captures_every_classification_preset():
    for preset in ("classify_resnet50d_cifar10", "classify_resnet50_cifar10", "classify_cifar10"):
        on, why = graph_plan(build_config("classify", preset), CUDA, "bf16", 1)
        assert on and why.startswith("on"), (preset, why)


@pytest.mark.parametrize("overrides,kw,reason", [
    (["cuda_graphs=false"], {}, "cuda_graphs=false"),
    ([], {"device": torch.device("cpu")}, "the device is cpu, not CUDA"),
    (["dist=fsdp"], {}, "FSDP2"),
    (["act_ckpt=selective"], {}, "activation checkpointing"),
    (["precision=fp16", "optim.fused=false"], {"precision": "fp16"}, "fused AdamW"),
])
def test_plan_falls_back_with_a_reason(overrides, kw, reason):
    on, why = _plan(overrides, **kw)
    assert not on and reason in why and "\n" not in why
    if reason != "cuda_graphs=false":
        assert why.endswith("the step runs eagerly")


@pytest.mark.parametrize("overrides,kw,reason", [
    ([], {"device": torch.device("cpu")}, "the device is cpu, not CUDA"),
    (["dist=fsdp"], {}, "FSDP2"),
    (["optim.name=sgd", "optim.fused=false"], {}, "fused kernel"),
])
def test_cuda_graphs_true_captures_or_fails_with_the_reason(overrides, kw, reason):
    with pytest.raises(ConfigError, match=f"cuda_graphs=true, but the step cannot be captured: .*{reason}"):
        _plan(overrides + ["cuda_graphs=true"], **kw)


def test_cuda_graphs_key_accepts_yaml_booleans_and_rejects_others():
    assert build_config("mae", None, ["cuda_graphs=false"]).cuda_graphs == "false"
    assert build_config("mae", None, ["cuda_graphs=true"]).cuda_graphs == "true"
    assert build_config("mae", "mae_cifar10").cuda_graphs == "auto"
    with pytest.raises(ConfigError, match="cuda_graphs"):
        build_config("mae", None, ["cuda_graphs=sometimes"])


def test_schedule_table_equals_lambda_lr():
    total, warmup, base = 50, 7, 3e-4
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=base)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, "cosine", 0.1))
    table = schedule_table(sched, total, "cpu")
    assert table.shape == (2, total + 1) and table.dtype == torch.float32
    for i in range(total + 1):
        assert sched.last_epoch == i
        want = torch.tensor(sched.get_last_lr(), dtype=torch.float32)
        assert torch.equal(table[:, i], want), i
        opt.step()
        sched.step()


def test_window_timing_sets_replay_time_against_wall_time():
    # 4 replays of 2.5 ms in a 12.5 ms window: the GPU ran the graph 80% of the time
    assert window_timing([2.0, 3.0, 2.5, 2.5], 4, 12.5) == {"gpu_ms_per_step": 2.5, "gpu_bound": 0.8}
    # more replays than timed events: the last ones' mean stands for all of them
    t = window_timing([3.0, 5.0], 6, 30.0)
    assert t["gpu_ms_per_step"] == 4.0 and t["gpu_bound"] == pytest.approx(0.8)
    assert window_timing([], 0, 40.0) == {}  # eager warm-up steps only
    with pytest.raises(ValueError, match="wall_ms"):
        window_timing([1.0], 1, 0.0)


def test_steady_timing_is_the_median_of_the_all_replay_windows_after_the_first_two():
    def w(steps, replays, wall_ms, gpu_ms=None):
        return {"steps": steps, "replays": replays, "wall_ms": wall_ms,
                **window_timing([gpu_ms] * min(replays, 3) if replays else [], replays, wall_ms)}

    windows = [w(10, 0, 900.0), w(10, 10, 30.0, 2.0),  # compilation and capture: left out
               w(10, 10, 21.0, 2.0), w(10, 10, 20.0, 1.6), w(10, 7, 19.0, 2.0), w(5, 5, 11.0, 2.0)]
    # the window with eager steps (7 replays of 10) is left out too; trainer / replay 1.05, 1.25, 1.1
    assert steady_timing(windows) == {"graph_gpu_ms_per_step": 2.0, "trainer_vs_replay": pytest.approx(1.1)}
    assert steady_timing(windows[:2]) == {} and steady_timing([]) == {}
    assert steady_timing(windows[:2] + [w(10, 0, 30.0)]) == {}  # an eager run's windows


def test_cpu_run_reports_no_replay_timing(tmp_path):
    cfg = build_config("mae", None, _TINY + ["device=cpu", "steps=3", f"out={tmp_path}"])
    trainer = Trainer(cfg, _task(), log=lambda m: None).setup()
    with pytest.raises(ValueError, match=r"until must be in 1\.\.3"):
        trainer.fit(until=4)
    trainer.fit()
    trainer.finish()
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(set(r) == {"step", "loss", "lr", "img_per_s", "model_tflops", "mfu", "epoch", "data_ms"} for r in recs)
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and not {"graph_gpu_ms_per_step", "trainer_vs_replay"} & set(summary)


@pytest.mark.parametrize("setting,captured,want", [("auto", True, True), ("auto", False, None),
                                                    ("true", False, True), ("false", True, False)])
def test_fused_mlp_setting_picks_the_mlp_path(setting, captured, want):
    assert fused_mlp_choice(setting, captured) is want


@pytest.mark.parametrize("setting,want", [("auto", None), ("true", True), ("false", False)])
def test_trainer_sets_every_mlp_to_the_fused_mlp_setting(tmp_path, setting, want):
    # on the CPU nothing is captured: auto keeps the module's own rule (fused outside torch.compile)
    cfg = build_config("mae", None, _TINY + ["device=cpu", "steps=1", f"fused_mlp={setting}", f"out={tmp_path}"])
    trainer = Trainer(cfg, _task(), log=lambda m: None).setup()
    mlps = [m for m in trainer.raw_model.modules() if isinstance(m, Mlp)]
    assert len(mlps) == 3 and all(m.fused is want for m in mlps)  # 2 encoder blocks, 1 decoder block


def test_cpu_trainer_runs_eagerly_and_says_why(tmp_path):
    cfg = build_config("mae", None, _TINY + ["device=cpu", "steps=2", f"out={tmp_path}"])
    lines = []
    trainer = Trainer(cfg, _task(), log=lines.append).setup()
    assert trainer.graphed is None and trainer.step_fn == trainer.step_body  # chosen once, in setup
    assert any("cuda graphs: off (the device is cpu, not CUDA)" in m for m in lines), lines


def test_evaluations_take_the_kernels_the_captured_step_trains_with(tmp_path):
    """A captured step trains on the Triton kernels and the fused MLP; the run's evaluations, of its EMA copy too,
    and of its checkpoint (setup without training) take them as well: they reproduce each other's figures."""
    from dres.nn import Mlp

    def paths(model):
        mlps = [m.fused for m in model.modules() if isinstance(m, Mlp)]
        backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
        return set(mlps), backends

    cfg = build_config("mae", None, _TINY + ["device=cpu", "steps=2", f"out={tmp_path}", "optim.ema_decay=0.9"])
    trainer = Trainer(cfg, _task(), log=lambda m: None).setup(train=False)
    assert not trainer.captures_step and paths(trainer.raw_model) == ({None}, {None})  # on the CPU: the defaults
    trainer.captures_step = True  # as graph_plan says on a GPU
    assert paths(trainer.kernel_paths(trainer.raw_model)) == ({True}, {"triton"})
    copy = trainer.full_state_copy()
    assert copy is not trainer.raw_model and paths(copy) == ({True}, {"triton"})


# ------------------------------------------------------------------------------------------ GPU
# a tiny official-variant MAE (decayed) on random 16x16 images, resident on the device
_TINY = ["data.name=synthetic", "data.synthetic_size=512", "data.img_size=16", "data.crop_min=0.3",
         "model.variant=official", "model.img_size=16", "model.patch_size=4", "model.embed_dim=64", "model.depth=2",
         "model.num_heads=2", "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2",
         "model.alpha_min=0.6", "batch_size=64", "optim.blr=1e-3", "optim.warmup_steps=3", "log.every=1",
         "log.progress=false", "log.tensorboard=false", "eval.probe=false", "eval.knn=false", "ckpt.every=0"]
_CLASSIFY = ["data.name=synthetic", "data.synthetic_size=512", "data.img_size=16", "model.img_size=16",
             "model.patch_size=4", "model.embed_dim=64", "model.depth=2", "model.num_heads=2", "model.num_classes=10",
             "batch_size=64", "optim.lr=1e-3", "optim.warmup_steps=3", "log.every=1", "log.progress=false",
             "log.tensorboard=false", "ckpt.every=0"]


def _task(name="mae"):
    import importlib

    return importlib.import_module(f"dres.train.{name}").TASK


def _fit(out, overrides, steps, task="mae", warmup=None, scaler_init=None, log=None):
    """A trainer after ``steps`` steps; ``warmup``: its graph's eager steps (more than the run has: the same
    body, never captured; None: step.graph_warmup_steps's); ``scaler_init``: the fp16 loss scale it starts from."""
    base = _CLASSIFY if task == "classify" else _TINY
    cfg = build_config(task, None, base + list(overrides) + [f"steps={steps}", f"out={out}"])
    eager_steps = mock.patch("dres.train.loop.graph_warmup_steps", lambda cfg, world: warmup)
    with eager_steps if warmup is not None else contextlib.nullcontext():
        trainer = Trainer(cfg, _task(task), log=log or (lambda m: None)).setup()
    if scaler_init is not None:  # as a resume sets the scaler's state
        trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": scaler_init})
    trainer.fit()
    return trainer


def _deterministic(tmp_path, overrides, task):
    """Whether two eager runs agree bit for bit (then graphed runs must too)."""
    a = _fit(tmp_path / "det_a", overrides + ["cuda_graphs=false"], 4, task)
    b = _fit(tmp_path / "det_b", overrides + ["cuda_graphs=false"], 4, task)
    return [h["loss"] for h in a.history] == [h["loss"] for h in b.history]


def _logged(trainer, keys):
    return torch.tensor([[h[k] for k in keys] for h in trainer.history], dtype=torch.float64)


def _params(trainer):
    return [p.detach().clone() for p in trainer.raw_model.parameters()]


CASES = {
    "plain": ([], "mae"),
    "accum_clip_ema": (["accum_steps=2", "optim.clip_grad=0.5", "optim.ema_decay=0.9"], "mae"),
    "residual_droppath": (["model.drop_path=0.3", "model.droppath_mode=residual_droppath", "accum_steps=2"], "mae"),
    "drop_path": (["model.drop_path=0.3", "model.droppath_mode=drop_path"], "mae"),
    "fp16": (["precision=fp16", "optim.clip_grad=1.0"], "mae"),
    "classify": (["model.drop_path=0.2", "model.droppath_mode=residual_droppath"], "classify"),
    # timm's SGD recipe (dres.train.optim): the fused kernel reads the graph's device lr
    "sgd": (["optim.name=sgd", "optim.lr=0.05", "optim.label_smoothing=0.1", "model.drop_path=0.2",
             "model.droppath_mode=residual_droppath"], "classify"),
    "sgd_fp16": (["optim.name=sgd", "optim.lr=0.05", "precision=fp16"], "classify"),
    # the whole forward one compiled region, drop path's two parities included; fused_mlp=true: the MLP path
    # a captured compiled step takes (auto), in the eager run too
    "compiled_model": (["compile=true", "compile_scope=model", "model.drop_path=0.3",
                        "model.droppath_mode=residual_droppath", "fused_mlp=true"], "mae"),
    "compiled_model_classify": (["compile=true", "compile_scope=model", "optim.name=sgd", "optim.lr=0.05",
                                 "fused_mlp=true"], "classify"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_graphed_steps_match_eager_steps(tmp_path, case):
    overrides, task = CASES[case]
    # with the C++ extension built, eager calls take its kernels and captured ones Triton's (dres.ops.checks):
    # one backend for all three runs, so that what differs is the graph and not two kernels' rounding
    overrides = overrides + (["model.backend=triton"] if csrc_backend.available() else [])
    steps = 16 if case == "fp16" else 9  # 3 eager warm-up steps, then replays (both parities)
    # fp16: a huge first scale overflows, so the first steps are skipped and the scale backs off
    scaler_init = 2.0 ** 24 if case == "fp16" else None
    lines = []
    graphed = _fit(tmp_path / "graphed", overrides + ["cuda_graphs=true"], steps, task, scaler_init=scaler_init,
                   log=lines.append)
    if graphed.graphed is None:  # a configuration the graph cannot take must say so
        assert any("cuda graphs: off (" in m for m in lines), lines
        pytest.skip(next(m for m in lines if "cuda graphs: off" in m))
    assert graphed.graphed.graph is not None and any("captured the train step" in m for m in lines)
    body = _fit(tmp_path / "body", overrides + ["cuda_graphs=true"], steps, task, warmup=steps + 1,
                scaler_init=scaler_init)
    # compiled outside a captured step, a launch-bound model takes Inductor's formulas (dres.ops.checks): the eager
    # run traces the kernels the captured step replays, so that what differs is the graph
    with replayed_launches():
        eager = _fit(tmp_path / "eager", overrides + ["cuda_graphs=false"], steps, task, scaler_init=scaler_init)
    assert body.graphed.graph is None and eager.graphed is None
    keys = [k for k in graphed.history[0] if k not in ("img_per_s", "model_tflops", "mfu", "lr", "step", "epoch",
                                                        "gpu_ms_per_step", "gpu_bound", "data_ms", "peak_mem_gib")]
    assert "loss" in keys and (task != "classify" or "train_acc" in keys)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in graphed.history)
    # replays compute what the same step computes eagerly: bitwise where the kernels are deterministic
    # (fp16's overflowed steps log a non-finite grad_norm: NaN equals NaN here)
    if _deterministic(tmp_path, overrides, task):
        torch.testing.assert_close(_logged(graphed, keys), _logged(body, keys), rtol=0, atol=0, equal_nan=True)
        for a, b in zip(_params(graphed), _params(body)):
            assert torch.equal(a, b)
    # the eager trainer rounds nothing to float32 in its learning rate: equal to float32 rounding
    g, e = torch.tensor([h["loss"] for h in graphed.history]), torch.tensor([h["loss"] for h in eager.history])
    torch.testing.assert_close(g, e, rtol=2e-4, atol=1e-6)
    for a, b in zip(_params(graphed), _params(eager)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert [h["lr"] for h in graphed.history] == [h["lr"] for h in eager.history]
    if graphed.ema is not None:
        for k in graphed.ema:
            torch.testing.assert_close(graphed.ema[k], eager.ema[k], rtol=1e-3, atol=1e-5)
    if graphed.droppath is not None:
        assert graphed.droppath.iteration == eager.droppath.iteration == steps
    if case == "fp16":
        assert graphed.scaler.get_scale() == eager.scaler.get_scale() < scaler_init  # the same skips and backoffs
        st = graphed.optimizer.state[next(iter(graphed.raw_model.parameters()))]["step"]
        assert st.item() == eager.optimizer.state[next(iter(eager.raw_model.parameters()))]["step"].item() < steps


@pytest.mark.gpu
@pytest.mark.parametrize("task", ["mae", "classify"])
def test_fused_mlp_in_a_captured_compiled_step_trains_as_inductors_mlp(tmp_path, task):
    # auto takes the fused MLP in a captured compiled step: the same training as Inductor's MLP code up to
    # bf16 rounding (the two round GELU's output to bf16 from the same fp32 values, in different kernels)
    run = ["compile=true", "compile_scope=model", "cuda_graphs=true", "precision=bf16"]
    auto = _fit(tmp_path / "auto", run, 9, task)
    plain = _fit(tmp_path / "plain", run + ["fused_mlp=false"], 9, task)
    assert auto.graphed.graph is not None and plain.graphed.graph is not None
    assert all(m.fused is True for m in auto.raw_model.modules() if isinstance(m, Mlp))
    assert all(m.fused is False for m in plain.raw_model.modules() if isinstance(m, Mlp))
    a, p = _logged(auto, ["loss"]), _logged(plain, ["loss"])
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, p, rtol=2e-3, atol=1e-4)
    for x, y in zip(_params(auto), _params(plain)):  # an optimizer step moves a weight ~lr at most: 9 steps
        torch.testing.assert_close(x, y, rtol=0, atol=2 * 9 * auto.lr)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["accum_clip_ema", "residual_droppath", "fp16"])
def test_graphed_run_resumes_exactly(tmp_path, case):
    overrides, task = CASES[case]
    k = 6  # the checkpoint falls after replays; the resumed run warms up again, then replays
    run = overrides + ["cuda_graphs=true", f"ckpt.every={k}"]
    full = _fit(tmp_path / "full", run, 2 * k, task)
    rng_full = torch.cuda.get_rng_state()  # the philox offset the replays advanced
    if full.graphed is None:
        pytest.skip("this configuration runs eagerly (see test_graphed_steps_match_eager_steps)")
    cfg = build_config(task, None, _TINY + run + [f"steps={2 * k}", f"out={tmp_path / 'half'}"])
    half = Trainer(cfg, _task(task), log=lambda m: None).setup()
    half.fit(until=k)  # a 2k-step run stopped after its checkpoint at k
    resumed = Trainer(cfg, _task(task), log=lambda m: None).setup()
    assert resumed.resume("auto") and resumed.step == k
    resumed.fit()
    assert resumed.graphed.graph is not None
    assert torch.equal(torch.cuda.get_rng_state(), rng_full)  # the resumed run drew the same random numbers
    got = [h["loss"] for h in half.history + resumed.history]
    want = [h["loss"] for h in full.history]
    if _deterministic(tmp_path, overrides, task):
        assert got == want
        for a, b in zip(_params(full), _params(resumed)):
            assert torch.equal(a, b)
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-6)
    assert full.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()
    assert full.scaler.state_dict() == resumed.scaler.state_dict()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["true", "false"])
def test_batches_made_on_a_side_stream_train_as_on_the_step_stream(tmp_path, graphs):
    # the batch's gather and augmentation overlap the running step; the step must still see each batch whole
    overrides = ["model.drop_path=0.3", "model.droppath_mode=residual_droppath", f"cuda_graphs={graphs}"]
    side = _fit(tmp_path / "side", overrides + ["data.side_stream=true"], 9)
    same = _fit(tmp_path / "same", overrides + ["data.side_stream=false"], 9)
    assert side.data_stream is not None and same.data_stream is None
    keys = ["loss"]
    if _deterministic(tmp_path, overrides, "mae"):
        assert torch.equal(_logged(side, keys), _logged(same, keys))
        assert all(torch.equal(a, b) for a, b in zip(_params(side), _params(same)))
    else:
        torch.testing.assert_close(_logged(side, keys), _logged(same, keys), rtol=2e-4, atol=1e-6)


def test_a_side_stream_on_the_cpu_changes_nothing(tmp_path):
    overrides = ["device=cpu", "cuda_graphs=false"]
    side = _fit(tmp_path / "side", overrides + ["data.side_stream=true"], 3)
    same = _fit(tmp_path / "same", overrides + ["data.side_stream=false"], 3)
    assert side.data_stream is None
    assert torch.equal(_logged(side, ["loss"]), _logged(same, ["loss"]))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,scope", [("true", "blocks"), ("false", "blocks"), ("true", "model")])
def test_steps_do_not_synchronise_with_the_host(tmp_path, graphs, scope):
    # mae_cifar10-like: compiled, bf16, augmentation on the device; RRC + flip on every batch
    cfg = build_config("mae", None, _TINY + ["compile=true", f"compile_scope={scope}", f"cuda_graphs={graphs}",
                                             "steps=20",
                                             "model.drop_path=0.2", "model.droppath_mode=residual_droppath",
                                             "optim.clip_grad=1.0", "optim.ema_decay=0.99", f"out={tmp_path}"])
    trainer = Trainer(cfg, _task(), log=lambda m: None).setup()
    trainer.model.train()
    t0 = time.perf_counter()
    for _ in range(4):  # warm-up steps and the capture synchronise; they are not measured
        trainer.train_step(trainer.loader.next())
    torch.cuda.synchronize()
    acc = torch.zeros((), device=trainer.device)
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(8):  # replays record their timing events without a sync
            loss, _ = trainer.train_step(trainer.loader.next())
            acc += loss
        # a log step closes its window without a sync: reduced and copied to the host behind the step,
        # read by the loop only after the next step is issued
        window = RunLog(tmp_path / "metrics.jsonl", main=False, tb=None, show_progress=False, total=20, initial=0,
                        kept=str, batch_size=cfg.batch_size, rate=lambda ips: {},
                        timer=trainer.graphed.timer if trainer.graphed is not None else None).close_window(
            step=12, steps=12, lr=0.0, epoch=None, loss_sum=acc, n=8, metrics={}, stop_asked=False,
            bad=trainer.step_body.bad)
        trainer.train_step(trainer.loader.next())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(acc) and acc > 0
    window["ready"].synchronize()
    assert window["host"].tolist() == pytest.approx([(acc / 8).item(), 0.0, 0.0])  # mean loss, stop asked, bad
    if trainer.graphed is not None:  # the window's replays: the capture step's and 8 more
        timing = trainer.graphed.timer.read_window(window["replays"], 12, (time.perf_counter() - t0) * 1e3)
        assert trainer.graphed.timer.windows[-1]["replays"] == 9 and timing["gpu_ms_per_step"] > 0


@pytest.mark.gpu
def test_graphed_run_reports_its_replay_floor(tmp_path):
    # log windows of 2 steps: warm-up steps 1-3, capture and first replay at step 4
    _fit(tmp_path / "graphed", ["cuda_graphs=true", "log.every=2"], 10).finish()
    with open(tmp_path / "graphed" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert "gpu_bound" not in recs[0] and "gpu_ms_per_step" not in recs[0]
    for r in recs[1:]:
        assert 0 < r["gpu_bound"] <= 1.05 and r["gpu_ms_per_step"] > 0, r
    with open(tmp_path / "graphed" / "summary.json") as f:
        summary = json.load(f)
    assert summary["graph_gpu_ms_per_step"] == statistics.median(r["gpu_ms_per_step"] for r in recs[2:])
    assert summary["trainer_vs_replay"] >= 0.95
    # an eager step reports no floor (events around it would time the host's launches)
    _fit(tmp_path / "eager", ["cuda_graphs=false", "log.every=2"], 6).finish()
    with open(tmp_path / "eager" / "metrics.jsonl") as f:
        assert all("gpu_bound" not in json.loads(line) for line in f)
    with open(tmp_path / "eager" / "summary.json") as f:
        assert "trainer_vs_replay" not in json.load(f)


@pytest.mark.gpu
def test_run_releases_the_captured_graph_before_the_process_group_goes(tmp_path, monkeypatch):
    """run() frees the captured graph when training ends (a graph holding NCCL collectives keeps the
    communicator alive, and destroying the process group then hangs); release() is idempotent."""
    from dres.train.driver import run

    seen = []
    release = GraphedStep.release

    def spy(self):
        seen.append(self.graph is not None)
        release(self)
        seen.append(self.graph is None)

    monkeypatch.setattr(GraphedStep, "release", spy)
    cfg = build_config("mae", None, _TINY + ["cuda_graphs=true", "steps=6", f"out={tmp_path / 'run'}"])
    run(cfg, _task("mae"), log=lambda m: None)
    assert seen == [True, True]
    trainer = _fit(tmp_path / "again", ["cuda_graphs=true"], 5)
    trainer.graphed.release()
    trainer.graphed.release()
    assert trainer.graphed.graph is None


def _ddp_worker(rank, group, out, graphs, steps, extra=()):
    os.environ.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
    from dres.train import distributed

    lines = []
    overrides = ["dist=ddp", f"cuda_graphs={graphs}", "accum_steps=2", "optim.clip_grad=0.5",
                 "model.drop_path=0.3", "model.droppath_mode=residual_droppath", *extra]
    trainer = _fit(f"{out}/{graphs}", overrides, steps, log=lines.append)
    captured = trainer.graphed is not None and trainer.graphed.graph is not None
    if captured:  # as the trainer's run(): the graph goes before the process group, or destroying the group hangs
        trainer.graphed.release()
    if rank == 0:
        with open(f"{out}/{graphs}.json", "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.history], "lines": lines, "captured": captured,
                       "params": [p.detach().double().sum().item() for p in trainer.raw_model.parameters()]}, f)
    distributed.cleanup()
    os._exit(0)  # as test_train_fsdp's workers: skip static destructors of the process group's threads


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("extra", [(), ("compile=true", "compile_scope=model")], ids=["eager_model", "compiled_model"])
def test_graphed_ddp_steps_match_eager_ddp_steps(tmp_path, extra):
    """DDP on two GPUs with the whole step captured (the all-reduce inside the graph) against eager DDP:
    11 warm-up steps, then replays of both ResidualDroppath parities with accumulation and clipping; also
    with the DDP wrapper compiled as one region (Dynamo splits it at the gradient buckets)."""
    import torch.multiprocessing as mp

    steps = DDP_WARMUP_STEPS + 4
    res = {}
    for graphs in ("true", "false"):
        with process_group(2) as group:
            mp.spawn(_ddp_worker, args=(group, str(tmp_path), graphs, steps, extra), nprocs=2, join=True)
        with open(tmp_path / f"{graphs}.json") as f:
            res[graphs] = json.load(f)
    assert res["true"]["captured"] and not res["false"]["captured"], res["true"]["lines"]
    assert any("DDP's gradient all-reduce included" in m for m in res["true"]["lines"])
    g, e = torch.tensor(res["true"]["losses"]), torch.tensor(res["false"]["losses"])
    assert len(g) == steps and torch.isfinite(g).all() and g[0] != g[-1]
    # as the one-GPU test: equal up to the float32 rounding of the graph's device learning rate
    torch.testing.assert_close(g, e, rtol=2e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(res["true"]["params"]), torch.tensor(res["false"]["params"]),
                               rtol=1e-3, atol=1e-4)
