"""GPU checks (marked ``gpu``; skipped without CUDA): the ViT-B/16 MAE (official variant, alpha_min 0.6)
and U-ViT-S/2 (alpha_min 0.7), forward + backward under bf16 autocast, through the Triton kernels in
eager mode and under torch.compile, against the same model through the PyTorch reference backend.

bf16 tolerance: the branches run in bf16, so the two backends may round a normalised activation
differently (1 bf16 ulp = 0.4%) and the difference grows through depth; we require relative L2
errors below 1e-2 for the loss and 3e-2 for the prediction and every parameter gradient (whole
tensors, parameters whose reference gradient is not ~0).
"""

import pytest
import torch

from dres.models import create_classifier, create_mae, create_uvit
from dres.nn import set_backend
from test_nn import perturb_

pytestmark = pytest.mark.gpu


def rel_err(got, want):
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def step(model, run, call):
    """One bf16-autocast forward + backward through ``run`` (the model or its compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, out = call(run)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), out.detach().float(), grads


def compare(model, call, compiled):
    set_backend(model, "torch")
    ref_loss, ref_out, ref_grads = step(model, model, call)
    set_backend(model, "triton")  # None: at these sizes, launch-bound, PyTorch's ops
    run = torch.compile(model) if compiled else model
    loss, out, grads = step(model, run, call)
    assert torch.isfinite(loss) and torch.isfinite(out).all()
    assert rel_err(loss, ref_loss) < 1e-2
    assert rel_err(out, ref_out) < 3e-2
    assert grads.keys() == ref_grads.keys()
    bad = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads
           if ref_grads[n].norm() > 1e-6 and rel_err(grads[n], ref_grads[n]) >= 3e-2}
    assert not bad, f"gradients off by more than 3e-2 (relative L2): {bad}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_mae_vit_b16_bf16_matches_reference(compiled):
    torch.manual_seed(0)
    model = perturb_(create_mae("mae_vit_base_patch16", variant="official", alpha_min=0.6), std=0.02).cuda()
    imgs = torch.randn(8, 3, 224, 224, device="cuda")
    noise = torch.rand(8, 196, device="cuda")

    def call(run):
        loss, pred, _ = run(imgs, noise=noise)
        return loss, pred

    compare(model, call, compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_uvit_s2_bf16_matches_reference(compiled):
    torch.manual_seed(1)
    model = perturb_(create_uvit("uvit_small_2", alpha_min=0.7), std=0.02).cuda()
    x = torch.randn(16, 3, 32, 32, device="cuda")
    t = torch.rand(16, device="cuda") * 999
    target = torch.randn_like(x)

    def call(run):
        pred = run(x, t)
        return (pred.float() - target).square().mean(), pred

    compare(model, call, compiled)


def test_residual_droppath_compiled_bf16_two_steps():
    torch.manual_seed(2)
    model = create_classifier("vit_small_cifar", drop_path=0.2, droppath_mode="residual_droppath").cuda().train()
    compiled = torch.compile(model)
    imgs, labels = torch.randn(32, 3, 32, 32, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    masks = []
    for _ in range(2):  # even, then odd iteration
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(compiled(imgs), labels)
        loss.backward()
        assert torch.isfinite(loss)
        masks.append(model.droppath.masks)
        model.droppath.next_iteration()
    assert model.droppath.iteration == 2 and model.droppath.counter.is_cuda
    assert masks[0].is_cuda and torch.equal(masks[0], masks[1])  # the odd iteration reuses the even one's masks
