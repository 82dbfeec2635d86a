"""The drop-path controller advances once per optimizer step by itself (dres.nn.droppath): the
micro-batches of a step share masks, ResidualDroppath's odd step reuses the even step's masks, a
step the GradScaler skips or a model that did not train in the step stays, a caller that counts by
hand (the trainers) is not advanced twice, a forgotten hand call warns once, and a captured step
advances on every replay."""

import copy
import warnings

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import dres
from dres.nn import ResidualDroppath


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles timm's forward afresh: that code object's compiles by earlier tests of the process count
    against Dynamo's recompile limit, which fullgraph=True turns into an error."""
    torch._dynamo.reset()


def converted_vit(mode="residual_droppath", **kw):
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    return dres.convert_timm_vit(vit, drop_path=0.5, droppath_mode=mode, backend="torch", **kw).train()


def batch(size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 3, (size,), generator=g)


def train_step(model, optimizer, micro_batches=1, hand_call=None):
    """One optimizer step over ``micro_batches`` forwards; returns the masks each forward used.
    hand_call: "after" / "before" the optimizer step, or None."""
    used = []
    device = next(model.parameters()).device
    for i in range(micro_batches):
        imgs, labels = (t.to(device) for t in batch(seed=i))
        torch.nn.functional.cross_entropy(model(imgs), labels).backward()
        used.append(model.droppath.masks)
    if hand_call == "before":
        model.droppath.next_iteration()
    optimizer.step()
    optimizer.zero_grad()
    if hand_call == "after":
        model.droppath.next_iteration()
    return used


@pytest.mark.parametrize("mode", ["residual_droppath", "drop_path"])
def test_optimizer_steps_advance_the_masks(mode):
    model = converted_vit(mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = [train_step(model, optimizer, micro_batches=2) for _ in range(4)]
    assert model.droppath.iteration == 4 and not model.droppath.advanced_by_hand
    for micro in steps:
        assert torch.equal(micro[0], micro[1])  # the micro-batches of a step share the masks
    draws = [micro[0] for micro in steps]
    if mode == "residual_droppath":  # the odd step reuses the even one's masks; the next even step draws anew
        assert torch.equal(draws[0], draws[1]) and torch.equal(draws[2], draws[3])
        assert not torch.equal(draws[0], draws[2])
    else:
        assert all(not torch.equal(a, b) for a, b in zip(draws, draws[1:]))


@pytest.mark.parametrize("hand_call", ["after", "before"])
def test_a_caller_that_counts_by_hand_is_not_advanced_twice(hand_call):
    """The old loop (next_iteration once per step, after the step or before it): one advance a step,
    no warning."""
    auto, by_hand = converted_vit(), converted_vit()
    auto_opt, hand_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (auto, by_hand))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            want = train_step(auto, auto_opt)
            got = train_step(by_hand, hand_opt, hand_call=hand_call)
            assert torch.equal(got[0], want[0])
    assert by_hand.droppath.advanced_by_hand and by_hand.droppath.iteration == auto.droppath.iteration == 3


def test_a_forgotten_hand_call_warns_once():
    model = converted_vit()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step(model, optimizer, hand_call="after")
    with pytest.warns(UserWarning, match="optimizer step was taken between them") as caught:
        train_step(model, optimizer)
        train_step(model, optimizer)
        train_step(model, optimizer)
    assert len([w for w in caught if "ResidualDroppath" in str(w.message)]) == 1
    assert model.droppath.iteration == 1  # the count is the caller's


def test_skipped_steps_other_models_and_evaluation_do_not_advance():
    model = converted_vit()
    frozen = copy.deepcopy(model).eval()  # an evaluation copy: no training forward draws its masks
    idle = converted_vit()  # trained one step, then not trained in the steps that follow
    train_step(idle, torch.optim.SGD(idle.parameters(), lr=0.01))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    imgs, labels = batch()
    scaler.scale(torch.nn.functional.cross_entropy(model(imgs), labels) * float("inf")).backward()
    scaler.step(optimizer)  # non-finite gradients: the step is skipped
    scaler.update()
    optimizer.zero_grad()
    assert model.droppath.iteration == 0
    train_step(model, optimizer)
    frozen(imgs)
    assert model.droppath.iteration == 1 and frozen.droppath.iteration == 0 and idle.droppath.iteration == 1


def test_two_optimizers_after_one_forward_advance_once():
    model = converted_vit()
    params = list(model.parameters())
    first, second = torch.optim.SGD(params[:4], lr=0.01), torch.optim.AdamW(params[4:], lr=1e-3)
    for _ in range(2):
        imgs, labels = batch()
        torch.nn.functional.cross_entropy(model(imgs), labels).backward()
        first.step()
        second.step()
    assert model.droppath.iteration == 2


def test_state_after_a_step_resumes_exactly():
    """The advance happens at the step, so a checkpoint written after step k holds iteration k."""
    model = converted_vit()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        train_step(model, optimizer)
    resumed = converted_vit()
    resumed.load_state_dict(model.state_dict(), strict=True)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.01)
    assert resumed.droppath.iteration == 3
    for _ in range(2):
        assert torch.equal(train_step(resumed, resumed_opt)[0], train_step(model, optimizer)[0])


def test_the_trainer_advances_once_per_step(tmp_path):
    """The trainer calls next_iteration after its optimizer step: one advance per step, accumulation included."""
    from dres.train.classify import TASK
    from dres.train.config import build_config
    from dres.train.loop import Trainer

    cfg = build_config("classify", None, [
        "data.name=synthetic", "data.synthetic_size=32", "data.img_size=8", "model.img_size=8", "model.patch_size=4",
        "model.embed_dim=16", "model.depth=2", "model.num_heads=2", "model.num_classes=10", "model.drop_path=0.3",
        "model.droppath_mode=residual_droppath", "batch_size=8", "accum_steps=2", "optim.lr=1e-3", "log.every=1",
        "log.progress=false", "log.tensorboard=false", "ckpt.every=0", "steps=3", f"out={tmp_path}"])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    trainer.fit()
    assert trainer.droppath.iteration == 3 and trainer.droppath.advanced_by_hand


def test_a_controller_without_an_owner_follows_the_steps():
    dp = ResidualDroppath(0.5, 4, depth_linear=False)
    weight = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    dp.scales(8, "cpu")
    (weight * 2).backward()
    optimizer.step()
    assert dp.iteration == 1
    optimizer.step()  # no training forward drew masks since: nothing to advance
    assert dp.iteration == 1


@pytest.mark.gpu
def test_a_captured_step_advances_on_every_replay():
    """A whole training step captured in a CUDA graph (forward, backward, a capturable optimizer's
    step): the optimizer step's advance is captured with it, so each replay uses the masks an eager
    run uses at that step."""
    eager = converted_vit().cuda()
    captured = copy.deepcopy(eager)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-3, capturable=True)
    opt = torch.optim.Adam(captured.parameters(), lr=1e-3, capturable=True)
    imgs, labels = (t.cuda() for t in batch())
    static_masks = torch.zeros(4, 8, device="cuda")

    def step():
        torch.nn.functional.cross_entropy(captured(imgs), labels).backward()
        static_masks.copy_(captured.droppath.masks_on(8, "cuda"))
        opt.step()
        opt.zero_grad(set_to_none=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up steps, eager
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        train_step(eager, eager_opt)
    for _ in range(4):
        graph.replay()
        want = train_step(eager, eager_opt)[0]
        assert torch.equal(static_masks, want)
    assert captured.droppath.iteration == eager.droppath.iteration == 7


@pytest.mark.parametrize("mode, micro_batches, hand_call", [
    ("residual_droppath", 2, None), ("drop_path", 1, None), ("residual_droppath_literal", 1, "after"),
])
def test_a_compiled_model_draws_in_its_graph_and_trains_as_the_eager_one(mode, micro_batches, hand_call):
    """torch.compile traces the draw with the model (fullgraph: no graph break), and the op it puts in the
    graph notes each training forward on every call: the compiled model's masks, advances and weights follow
    the eager model's step by step (micro-batches sharing a step's masks, odd steps reusing the even ones',
    a caller counting by hand); compiled once: nothing a call stores (the batch's sample slots, the rank) is read
    while tracing, where it would recompile the model at its second call."""
    eager = converted_vit(mode)
    compiled_model = copy.deepcopy(eager)
    compiles = []
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counting_aot_eager(compiles))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    for step in range(4):
        for model, forward, optimizer in zip((eager, compiled_model), (eager, compiled), optimizers):
            for i in range(micro_batches):
                imgs, labels = batch(seed=10 * step + i)
                torch.nn.functional.cross_entropy(forward(imgs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            if hand_call == "after":
                model.droppath.next_iteration()
        assert compiled_model.droppath.iteration == eager.droppath.iteration == step + 1
        assert torch.equal(compiled_model.droppath.masks, eager.droppath.masks)
        for a, b in zip(compiled_model.parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(compiles) == 1


def counting_aot_eager(compiles: list):
    """The aot_eager backend, appending each graph it compiles to ``compiles``."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(graph, example_inputs):
        compiles.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    return backend


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_compiled_model_refuses_another_batch_size_on_every_call(dynamic):
    """The batch check runs when the graph runs, not while it is traced: a batch of another size than the run's
    first is refused, also by a graph compiled for symbolic sizes, which a check at tracing never saw."""
    model = converted_vit()
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    compiled(batch(8)[0])
    with pytest.raises(ValueError, match="batch size 4 differs from the 8 sample slots"):
        compiled(batch(4)[0])


def test_a_copy_of_a_compiled_model_notes_its_own_forwards():
    """A deepcopy is a controller of its own: its compiled forwards advance it, not the original."""
    original = converted_vit()
    copied = copy.deepcopy(original)
    assert copied.droppath._key != original.droppath._key
    compiled = torch.compile(copied, fullgraph=True, backend="aot_eager")
    optimizer = torch.optim.SGD(copied.parameters(), lr=0.1)
    imgs, labels = batch()
    torch.nn.functional.cross_entropy(compiled(imgs), labels).backward()
    optimizer.step()
    assert copied.droppath.iteration == 1 and original.droppath.iteration == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_model_compiled_on_a_gpu_trains_as_the_eager_one(mode):
    """On CUDA, Inductor's code and torch.compile's own CUDA graphs (reduce-overhead, which leaves the op
    noting each forward out of its replays): masks, advances and losses follow the eager model's."""
    eager = converted_vit().cuda()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, mode=mode)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    for step in range(5):
        imgs, labels = (t.cuda() for t in batch(seed=step))
        losses = []
        for forward, optimizer in zip((eager, compiled), optimizers):
            loss = torch.nn.functional.cross_entropy(forward(imgs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
        assert compiled_model.droppath.iteration == eager.droppath.iteration == step + 1
        assert torch.equal(compiled_model.droppath.masks, eager.droppath.masks)


def test_a_controller_unpickled_in_a_fresh_process_draws(tmp_path):
    """A pickled model loads in a process that built no controller yet and draws the masks it drew."""
    import subprocess
    import sys

    model = converted_vit()
    imgs, labels = batch()
    torch.nn.functional.cross_entropy(model(imgs), labels).backward()
    torch.save({"model": model, "masks": model.droppath.masks}, tmp_path / "model.pt")
    code = ("import sys, torch; saved = torch.load(sys.argv[1], weights_only=False); "
            "assert torch.equal(saved['model'].droppath.masks, saved['masks'])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")], check=True, timeout=300)
