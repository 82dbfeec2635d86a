"""dres.compile_step (dres/captured_step.py), the one-line training step of a user's own loop. On the CPU:
the step runs eagerly and says why once, trains exactly as the hand-written loop (a converted timm ViT with
ResidualDroppath, a converted Hugging Face ViT, gradient clipping, an LR scheduler; compiled, closely),
the optimizer made capturable keeps an LR scheduler working, which optimizers can be captured, the
batch's tensors split from the rest of a call, and one-line argument errors. On the device (``gpu``):
captured steps against the eager loop (timm and Hugging Face models under bf16 autocast, fused and
foreach AdamW, compiled too), the replayed lr following a scheduler and a hand-set lr, drop-path masks
advancing per replay, a short batch run eagerly, uncapturable optimizers and failed captures falling back
without losing a step, and what a captured step refuses."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import dres
from dres.captured_step import (GraphedFunction, StaticInputs, capture_blocker, compile_step, fill_arguments,
                                first_difference, make_capturable, optimizer_blocker, split_arguments)
from dres.ops import csrc_backend
from dres.ops.checks import replayed_launches

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# ------------------------------------------------------------------------------------ models and loops
def tiny_timm_vit(device=CPU, drop_path=0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
    rdp = dict(drop_path=drop_path, droppath_mode="residual_droppath") if drop_path else {}
    return dres.convert_timm_vit(vit, alpha_min=0.8, **rdp).to(device).train()


def tiny_layer_scaled_vit(device=CPU) -> torch.nn.Module:
    """A timm ViT with LayerScale (DINOv2's, DeiT III's), which the converted model folds when compiled."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10,
                            init_values=0.1)
    return dres.convert_timm_vit(vit, alpha_min=0.8).to(device).train()


def tiny_hf_vit(device=CPU) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, num_labels=10,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return dres.convert_hf_vit(transformers.ViTForImageClassification(config), alpha_min=0.8).to(device).train()


def tiny_mlp(device=CPU, dropout=0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(32, 10)).to(device).train()


def cross_entropy(model, images, labels):
    return F.cross_entropy(model(images), labels)


def hf_loss(model, pixel_values, labels):
    return model(pixel_values=pixel_values, labels=labels).loss


def under_bf16(loss_fn):
    def bf16_loss(model, *args, **kwargs):
        with torch.autocast("cuda", torch.bfloat16):
            return loss_fn(model, *args, **kwargs)

    return bf16_loss


def batches(n, device=CPU, size=8, image=(3, 32, 32)):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, *image, generator=g).to(device), torch.randint(0, 10, (size,), generator=g).to(device))
            for _ in range(n)]


def feed(fn, images, labels, keywords):
    """``fn(images, labels)``, as Hugging Face's keywords where ``keywords``."""
    return fn(pixel_values=images, labels=labels) if keywords else fn(images, labels)


def on_the_steps_kernels(loss_fn, captured_size=8):
    """``loss_fn`` on the kernels a compile_step's call of it takes: those of its warm-up and capture
    (``replayed_launches``) at the captured batch size, ``backend=None``'s eager choice at another, which it runs
    eagerly (for the small models here without the csrc extension: PyTorch's formulas, rounded apart)."""
    def loss(model, *args, **kwargs):
        images = kwargs["pixel_values"] if "pixel_values" in kwargs else args[0]
        with replayed_launches() if len(images) == captured_size else contextlib.nullcontext():
            return loss_fn(model, *args, **kwargs)

    return loss


def hand_loop(model, optimizer, loss_fn, data, *, keywords=False, scheduler=None, clip=None):
    """The plain training loop compile_step stands for: the losses of each step."""
    losses = []
    for images, labels in data:
        loss = feed(lambda *a, **k: loss_fn(model, *a, **k), images, labels, keywords)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def step_loop(step, data, *, keywords=False, scheduler=None):
    losses = []
    for images, labels in data:
        losses.append(feed(step, images, labels, keywords).clone())  # a captured step's loss lives until the next
        if scheduler is not None:
            scheduler.step()
    return torch.stack(losses)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------ CPU
MODELS = {  # name: (model builder, loss_fn, the batch as Hugging Face's keywords)
    "timm_rdp": (lambda device: tiny_timm_vit(device, drop_path=0.1), cross_entropy, False),
    "hf": (tiny_hf_vit, hf_loss, True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_on_the_cpu_the_step_runs_eagerly_and_trains_as_the_hand_written_loop(name):
    """Bit for bit the loop's losses and parameters (compile=False), with clipping and a scheduler; the reason
    for running eagerly is one line given to log once; a converted model's controller advances every step."""
    build, loss_fn, keywords = MODELS[name]
    data = batches(4)
    results = []
    for use_step in (True, False):
        model = build(CPU)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        if use_step:
            lines = []
            step = compile_step(model, optimizer, loss_fn, compile=False, clip_grad_norm=0.5, log=lines.append)
            losses = step_loop(step, data, keywords=keywords, scheduler=scheduler)
            assert not step.captured and lines == [step.why_eager]
            assert step.why_eager == "dres.compile_step: the step runs eagerly: the device is cpu, not CUDA"
        else:
            losses = hand_loop(model, optimizer, loss_fn, data, keywords=keywords, scheduler=scheduler, clip=0.5)
        results.append((losses, model))
    (step_losses, step_model), (loop_losses, loop_model) = results
    assert torch.equal(step_losses, loop_losses)
    for a, b in zip(step_model.parameters(), loop_model.parameters()):
        assert torch.equal(a, b)
    if name == "timm_rdp":
        assert step_model.droppath.iteration == loop_model.droppath.iteration == len(data)


def test_a_compiled_step_trains_as_the_eager_loop():
    data = [(torch.randn(8, 12, generator=torch.Generator().manual_seed(i)), torch.arange(8)) for i in range(3)]
    compiled, eager = tiny_mlp(), tiny_mlp()
    step = compile_step(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-2), cross_entropy, log=lambda _: None)
    assert step.forward_model is not compiled and step.forward_model._orig_mod is compiled
    losses = step_loop(step, data)
    want = hand_loop(eager, torch.optim.AdamW(eager.parameters(), lr=1e-2), cross_entropy, data)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_capture_false_runs_eagerly_without_a_message():
    model = tiny_mlp()
    lines = []
    step = compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, compile=False,
                        capture=False, log=lines.append)
    step(torch.randn(8, 12), torch.arange(8))
    assert step.why_eager == "dres.compile_step: the step runs eagerly (capture=False)" and lines == []


def test_capture_true_refuses_what_cannot_be_captured_in_one_line():
    model = tiny_mlp()
    with pytest.raises(ValueError) as e:
        compile_step(model, torch.optim.AdamW(model.parameters()), cross_entropy, capture=True)
    assert one_line(e) == ("compile_step: capture=True, but the step cannot be captured: the device is cpu, not CUDA "
                           "(capture='auto' runs it eagerly)")


def test_a_loss_that_is_not_a_scalar_is_one_line():
    model = tiny_mlp()
    step = compile_step(model, torch.optim.AdamW(model.parameters()),
                        lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), compile=False, log=lambda _: None)
    with pytest.raises(TypeError) as e:
        step(torch.randn(8, 12), torch.arange(8))
    assert one_line(e) == "loss_fn must return the loss as a 0-dim tensor, got a tensor of shape (8,)"


def _bad_arguments(**changes):
    model = tiny_mlp()
    args = dict(model=model, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=cross_entropy)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, words", [
    (dict(model=lambda x: x), TypeError, "model must be a torch.nn.Module, got function"),
    (dict(optimizer="adamw"), TypeError, "optimizer must be a torch.optim.Optimizer, got str"),
    (dict(loss_fn=3), TypeError, "loss_fn must be callable"),
    (dict(compile="yes"), TypeError, "compile must be True or False, got 'yes'"),
    (dict(capture="always"), ValueError, "capture must be 'auto', True or False, got 'always'"),
    (dict(capture=1), ValueError, "capture must be 'auto', True or False, got 1"),
    (dict(warmup_steps=0), ValueError, "warmup_steps must be >= 1"),
    (dict(warmup_steps=2.5), ValueError, "warmup_steps must be >= 1"),
    (dict(clip_grad_norm=-1.0), ValueError, "clip_grad_norm must be None or a positive number, got -1.0"),
    (dict(log="stderr"), TypeError, "log must be callable"),
])
def test_bad_arguments_are_one_line_naming_the_argument(changes, error, words):
    args = _bad_arguments(**changes)
    model, optimizer, loss_fn = args.pop("model"), args.pop("optimizer"), args.pop("loss_fn")
    with pytest.raises(error) as e:
        compile_step(model, optimizer, loss_fn, **args)
    assert words in one_line(e)


def test_an_optimizer_of_another_model_is_refused():
    model, other = tiny_mlp(), tiny_mlp()
    with pytest.raises(ValueError) as e:
        compile_step(model, torch.optim.AdamW(other.parameters()), cross_entropy)
    assert "optimizer holds parameters that are not model's" in one_line(e)


def test_dres_exports_compile_step():
    assert dres.compile_step is compile_step


def test_which_optimizers_a_step_can_capture():
    params = tiny_mlp().parameters
    assert optimizer_blocker(torch.optim.AdamW(params(), fused=True)) is None
    assert optimizer_blocker(torch.optim.AdamW(params(), foreach=True)) is None
    assert optimizer_blocker(torch.optim.SGD(params(), lr=0.1, fused=True)) is None
    assert "fused=True" in optimizer_blocker(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    assert optimizer_blocker(torch.optim.Adagrad(params())) == \
        "Adagrad has no capturable mode (its step reads its state on the host)"
    model = tiny_mlp()
    assert capture_blocker(model, torch.optim.AdamW(model.parameters())) == "the device is cpu, not CUDA"


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_a_capturable_optimizer_keeps_its_lr_scheduler_working(scheduler_first):
    """make_capturable: capturable groups and a 0-dim float32 lr tensor per group, which an LR scheduler (made
    before or after) fills in place, so a replayed graph reading that tensor follows it."""
    model = tiny_mlp()
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.5}],
                                  lr=1.0)

    def schedule():
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.1 ** s)

    scheduler = schedule() if scheduler_first else None
    lrs = make_capturable(optimizer)
    scheduler = scheduler or schedule()
    assert all(g["capturable"] for g in optimizer.param_groups)
    assert [lr.shape for lr in lrs] == [()] * 2 and all(lr.dtype == torch.float32 for lr in lrs)
    assert make_capturable(optimizer) == lrs  # idempotent: the same tensors
    for s in range(1, 3):
        optimizer.step()
        scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == lrs  # the very tensors, filled in place
        torch.testing.assert_close(torch.stack(lrs), torch.tensor([1.0, 0.5]) * 0.1 ** s)


def test_a_call_splits_into_named_tensors_and_the_rest():
    x, y, z, w = (torch.full((2,), float(i)) for i in range(4))
    args, kwargs = (x, [y, {"mask": z, "k": 3}], "mean"), {"labels": w, "flag": True}
    tensors, skeleton = split_arguments(args, kwargs)
    assert list(tensors) == ["args[0]", "args[1][0]", "args[1][1]['mask']", "labels"]
    assert [t is u for t, u in zip(tensors.values(), (x, y, z, w))] == [True] * 4
    static = StaticInputs(tensors)
    new_args, new_kwargs = fill_arguments(skeleton, static.tensors)
    assert new_args[0] is static.tensors["args[0]"] and new_args[1][1]["mask"] is static.tensors["args[1][1]['mask']"]
    assert (new_args[1][1]["k"], new_args[2], new_kwargs["flag"]) == (3, "mean", True)
    assert first_difference(skeleton, split_arguments(args, kwargs)[1]) is None
    changed = split_arguments((x, [y, {"mask": z, "k": 4}], "mean"), kwargs)[1]
    assert first_difference(skeleton, changed) == ("args[1][1]['k']", 3, 4)
    assert first_difference(skeleton, split_arguments(args, {"labels": w})[1])[0] == "the keywords"
    name, old, new = first_difference(skeleton, split_arguments((3,) + args[1:], kwargs)[1])
    assert (name, repr(old), new) == ("args[0]", "a tensor", 3)


def test_static_inputs_name_the_first_tensor_they_cannot_take():
    static = StaticInputs({"x": torch.zeros(4, 3), "y": torch.zeros(4, dtype=torch.int64)})
    assert static.misfit({"x": torch.ones(4, 3), "y": torch.ones(4, dtype=torch.int64)}) is None
    assert static.misfit({"x": torch.ones(2, 3), "y": torch.ones(2, dtype=torch.int64)}) == "x"
    assert static.misfit({"x": torch.ones(4, 3), "y": torch.ones(4)}) == "y"
    assert static.misfit({"z": torch.ones(4, 3)}) == "z"
    x = torch.ones(4, 3)
    static.load({"x": x})
    assert torch.equal(static.tensors["x"], x) and static.tensors["x"] is not x
    assert static.describe() == {"x": ((4, 3), "torch.float32"), "y": ((4,), "torch.int64")}


# ------------------------------------------------------------------------------------ GPU
ADAMW = {"fused_adamw": dict(fused=True), "foreach_adamw": dict(foreach=True)}
GPU_MODELS = {"timm": (tiny_timm_vit, cross_entropy, False), "hf": (tiny_hf_vit, hf_loss, True)}
STEPS = 8
# against the hand-written loop: its lr is a float (the step's a float32 tensor) and a foreach AdamW steps without
# capturable's arithmetic; bf16 activations turn those roundings into up to ~2e-3 of a loss (seen on an H200).
# Parameters are compared as a whole: AdamW scales a gradient of rounding noise (an attention key's bias) to a
# full step, so single weights may differ by a few steps' size
BF16_LOSS_TOL, PARAMS_REL_TOL = dict(rtol=5e-3, atol=1e-5), 2e-3


def _train(build, loss_fn, keywords, data, *, step_args=None, optimizer_args=None, compile_loop=False):
    """(losses, model, step) of ``build(CUDA)`` trained on ``data`` with AdamW and a LambdaLR: by a
    compile_step made with ``step_args`` where given, else by the hand-written loop on the step's kernels (its
    model compiled where ``compile_loop``: it traces the kernels the capture traced, not Inductor's formulas);
    step is None for the loop."""
    model = build(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, **(optimizer_args or {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.5 * s))
    if step_args is None:
        forward = torch.compile(model, dynamic=False) if compile_loop else model
        return (hand_loop(forward, optimizer, on_the_steps_kernels(loss_fn), data, keywords=keywords,
                          scheduler=scheduler), model, None)
    step = compile_step(model, optimizer, loss_fn, **step_args)
    return step_loop(step, data, keywords=keywords, scheduler=scheduler), model, step


def params_rel_err(model, want_model) -> float:
    """||params - want's|| / ||want's||, over all parameters."""
    pairs = list(zip(model.parameters(), want_model.parameters()))
    return (sum((a - b).double().square().sum() for a, b in pairs).sqrt() /
            sum(b.double().square().sum() for _, b in pairs).sqrt()).item()


def _assert_trained_alike(got, want):
    (losses, model), (want_losses, want_model) = got, want
    torch.testing.assert_close(losses, want_losses, **BF16_LOSS_TOL)
    assert params_rel_err(model, want_model) < PARAMS_REL_TOL


def _trained_equal(a, b) -> bool:
    (losses_a, model_a), (losses_b, model_b) = a, b
    return torch.equal(losses_a, losses_b) and all(torch.equal(p, q) for p, q in
                                                   zip(model_a.parameters(), model_b.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", list(ADAMW))
@pytest.mark.parametrize("model", list(GPU_MODELS))
def test_captured_steps_train_as_the_eager_loop(model, optimizer):
    """bf16 autocast inside loss_fn, an lr falling by a LambdaLR stepped on the host: 3 eager warm-up steps, the
    capture, replays; the losses and parameters of the hand-written loop's steps, and for the timm model bit for
    bit those of the same step run eagerly throughout where two such runs agree bit for bit (deterministic
    kernels; the Hugging Face model's replays were seen to differ from its eager steps by rounding alone)."""
    build, loss_fn, keywords = GPU_MODELS[model]
    loss_fn, data = under_bf16(loss_fn), batches(STEPS, CUDA)
    lines = []
    losses, trained, step = _train(build, loss_fn, keywords, data, optimizer_args=ADAMW[optimizer],
                                   step_args=dict(compile=False, log=lines.append))
    assert step.captured and step.why_eager is None and lines == []
    want = _train(build, loss_fn, keywords, data, optimizer_args=ADAMW[optimizer])
    _assert_trained_alike((losses, trained), want[:2])
    # with the extension built, eager calls take its kernels and a capture Triton's: the same sums, rounded apart
    if model != "timm" or csrc_backend.available():
        return
    uncaptured = [_train(build, loss_fn, keywords, data, optimizer_args=ADAMW[optimizer],
                         step_args=dict(compile=False, warmup_steps=STEPS + 1, log=pytest.fail))[:2] for _ in range(2)]
    if _trained_equal(*uncaptured):
        assert _trained_equal((losses, trained), uncaptured[0])


@pytest.mark.gpu
@pytest.mark.parametrize("build", [tiny_timm_vit, tiny_layer_scaled_vit])
def test_a_compiled_captured_step_trains_as_the_compiled_eager_loop(build):
    loss_fn, keywords = GPU_MODELS["timm"][1:]
    loss_fn, data = under_bf16(loss_fn), batches(STEPS, CUDA)
    losses, trained, step = _train(build, loss_fn, keywords, data, optimizer_args=dict(fused=True),
                                   step_args=dict(log=pytest.fail))
    assert step.captured and isinstance(step.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    want = _train(build, loss_fn, keywords, data, optimizer_args=dict(fused=True), compile_loop=True)
    _assert_trained_alike((losses, trained), want[:2])


@pytest.mark.gpu
def test_warm_up_and_capture_trace_for_replayed_launches(monkeypatch):
    """What the warm-up and the capture run (and torch.compile traces there) keeps the dres kernels where a
    launch-bound compiled op outside them takes its PyTorch formula: the replays do not pay the launches."""
    from dres.ops.checks import resolve_backend_by_work

    small = torch.zeros(8, 32, device=CUDA, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while torch.compile traces
    choices = []

    def fn():
        choices.append(resolve_backend_by_work(None, small))
        return small + 1

    graphed = GraphedFunction(fn, CUDA, warmup_steps=1)
    graphed.warm_up()
    graphed.capture()
    graphed.replay()
    assert choices == ["triton", "triton"] and resolve_backend_by_work(None, small) == "torch"


@pytest.mark.gpu
def test_replays_read_the_lr_a_scheduler_or_a_hand_sets():
    """The lr falls to 0 after five steps (LambdaLR): replays leave the parameters as they are; an lr then set
    by hand (a float) is the next replay's, and the group holds the device tensor again."""
    model = tiny_mlp(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 5 else 0.0)
    step = compile_step(model, optimizer, cross_entropy, compile=False, log=pytest.fail)
    x, y = torch.randn(8, 12, device=CUDA), torch.arange(8, device=CUDA)
    params = []
    for _ in range(7):
        step(x, y)
        scheduler.step()
        params.append([p.detach().clone() for p in model.parameters()])
    assert step.captured
    assert not all(torch.equal(a, b) for a, b in zip(params[3], params[4]))  # the capture's step, lr 1e-2
    assert all(torch.equal(a, b) for a, b in zip(params[4], params[6]))  # replays at lr 0
    lr = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 1e-2
    step(x, y)
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-2)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(params[6], model.parameters()))


@pytest.mark.gpu
def test_drop_path_masks_advance_per_replay_as_in_the_eager_loop():
    """A converted timm ViT with ResidualDroppath: after every step (warm-up, capture, replays) the controller's
    iteration and masks are the eager loop's, and so are the losses that used them."""
    data = batches(STEPS, CUDA)
    loss_fn = under_bf16(cross_entropy)
    models, optimizers = [], []
    for _ in range(2):
        models.append(tiny_timm_vit(CUDA, drop_path=0.1))
        optimizers.append(torch.optim.AdamW(models[-1].parameters(), lr=1e-3, fused=True))
    step = compile_step(models[0], optimizers[0], loss_fn, compile=False, log=pytest.fail)
    eager, eager_optimizer = models[1], optimizers[1]
    for k, (images, labels) in enumerate(data, 1):
        loss = step(images, labels)
        want = hand_loop(eager, eager_optimizer, loss_fn, [(images, labels)])[0]
        torch.testing.assert_close(loss, want, **BF16_LOSS_TOL)
        assert models[0].droppath.iteration == eager.droppath.iteration == k
        assert torch.equal(models[0].droppath.masks, eager.droppath.masks)
    assert step.captured


@pytest.mark.gpu
def test_a_short_batch_runs_eagerly_and_says_so_once():
    build, loss_fn, keywords = GPU_MODELS["hf"]
    loss_fn = under_bf16(loss_fn)
    full, short = batches(6, CUDA), batches(2, CUDA, size=4)
    data = full[:4] + short[:1] + full[4:] + short[1:]
    lines = []
    losses, trained, step = _train(build, loss_fn, keywords, data, optimizer_args=dict(fused=True),
                                   step_args=dict(compile=False, log=lines.append))
    assert step.captured and step.why_eager is None, lines
    assert lines == ["dres.compile_step: pixel_values is (4, 3, 32, 32) torch.float32, not (8, 3, 32, 32) "
                     "torch.float32 as in the captured step: such steps run eagerly"]
    want = _train(build, loss_fn, keywords, data, optimizer_args=dict(fused=True))
    _assert_trained_alike((losses, trained), want[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_sgd_is_captured_only_with_its_fused_kernel(fused):
    model, reference = tiny_mlp(CUDA), tiny_mlp(CUDA)
    data = [(torch.randn(8, 12, device=CUDA), torch.arange(8, device=CUDA)) for _ in range(STEPS)]
    lines = []
    step = compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused), cross_entropy,
                        compile=False, log=lines.append)
    losses = step_loop(step, data)
    want = hand_loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, fused=fused),
                     cross_entropy, data)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    if fused:
        assert step.captured and lines == []
    else:
        assert not step.captured and lines == [step.why_eager]
        assert step.why_eager.startswith("dres.compile_step: the step runs eagerly: SGD reads a device learning rate")


def _syncing_loss(model, images, labels):
    """A loss_fn that reads a value on the host (as a loop that prints its loss does): nothing a graph can hold."""
    loss = F.cross_entropy(model(images), labels)
    assert loss.item() < 1e6
    return loss


@pytest.mark.gpu
def test_a_failed_capture_falls_back_without_losing_the_step():
    """The capture fails on the host read: the step it was capturing runs eagerly, as do all later ones, and the
    losses (dropout's draws included) are the eager loop's."""
    data = [(torch.randn(8, 12, device=CUDA), torch.arange(8, device=CUDA)) for _ in range(6)]
    lines = []
    model = tiny_mlp(CUDA, dropout=0.2)
    torch.manual_seed(1)
    step = compile_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _syncing_loss, compile=False,
                        log=lines.append)
    losses = step_loop(step, data)
    assert not step.captured and lines == [step.why_eager]
    assert step.why_eager.startswith("dres.compile_step: the step runs eagerly: capturing the step failed (")
    reference = tiny_mlp(CUDA, dropout=0.2)
    torch.manual_seed(1)
    want = hand_loop(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), _syncing_loss, data)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_capture_true_raises_the_reason_a_capture_failed():
    model = tiny_mlp(CUDA)
    step = compile_step(model, torch.optim.AdamW(model.parameters()), _syncing_loss, compile=False, capture=True,
                        warmup_steps=1)
    x, y = torch.randn(8, 12, device=CUDA), torch.arange(8, device=CUDA)
    step(x, y)
    with pytest.raises(RuntimeError) as e:
        step(x, y)
    assert one_line(e).startswith("compile_step: capturing the step failed (")


@pytest.mark.gpu
def test_a_captured_step_refuses_other_arguments_and_a_replaced_optimizer_state():
    model = tiny_mlp(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)

    def smoothed(m, x, y, smoothing):
        return F.cross_entropy(m(x), y, label_smoothing=smoothing)

    step = compile_step(model, optimizer, smoothed, compile=False, warmup_steps=1, log=pytest.fail)
    x, y = torch.randn(8, 12, device=CUDA), torch.arange(8, device=CUDA)
    step(x, y, 0.1)
    with pytest.raises(ValueError) as e:
        step(x, y, 0.2)
    assert one_line(e) == ("compile_step: args[2] is 0.2, but the captured step was called with 0.1: arguments other "
                           "than tensors must be the same at every call")
    step(x, y, 0.1)
    assert step.captured
    optimizer.load_state_dict(optimizer.state_dict())
    with pytest.raises(RuntimeError) as e:
        step(x, y, 0.1)
    assert "the optimizer's state or parameter groups were replaced after the step was captured" in one_line(e)
