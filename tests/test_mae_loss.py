"""The fused MAE loss against the float64 reference: loss and gradient, norm_pix on and off, pred
dtypes, strided images, odd patch grids, masks, gradient scaling, poisoned outputs, determinism,
opcheck, torch.compile, bad input, and equality with ``MAE.forward_loss``. On CPU the Triton kernel
runs under TRITON_INTERPRET=1 (tests/conftest.py); ``gpu``-marked tests add realistic shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dres.ops as ops
from dres.ops import reference
from dres.ops.mae_loss import mae_loss_op
from dres.ops.utils import patchify, unpatchify
from helpers import (BF16, F16, F32, TOLERANCE, assert_close, assert_graph_runs, inductor_caches_off, recording_backend,
                     rel_err)
from tiny_models import tiny_mae

# (patch_size, channels, grid_h, grid_w): CIFAR-like patches of 2 on an odd 3x5 grid, one channel,
# and a p=16 ImageNet patch (P = 768, not a power of two).
GEOMETRIES = [(2, 3, 3, 5), (4, 1, 2, 3), (16, 3, 1, 2)]


def make_case(batch, patch_size, channels, grid_h, grid_w, pred_dtype, device, mask_kind="random", seed=0):
    """(pred, imgs, mask) drawn fresh: images with a non-zero mean per patch, masks with 1 = counted."""
    gen = torch.Generator().manual_seed(seed)
    num_patches = grid_h * grid_w
    imgs = 0.5 + torch.randn(batch, channels, grid_h * patch_size, grid_w * patch_size, generator=gen)
    pred = torch.randn(batch, num_patches, patch_size * patch_size * channels, generator=gen).to(pred_dtype)
    if mask_kind == "random":
        mask = (torch.rand(batch, num_patches, generator=gen) < 0.75).float()
        mask[0, 0], mask[-1, -1] = 1.0, 0.0  # both kinds of patch present whatever the draw
    elif mask_kind == "ones":
        mask = torch.ones(batch, num_patches)
    elif mask_kind == "one_row":
        mask = torch.zeros(batch, num_patches)
        mask[batch - 1, num_patches // 2] = 1.0
    else:
        raise ValueError(mask_kind)
    return pred.to(device), imgs.to(device), mask.to(device)


def fused_loss_and_grad(pred, imgs, mask, patch_size, norm_pix, grad_output=1.0, backend="triton"):
    """(loss, d(grad_output * loss)/dpred) from mae_loss."""
    leaf = pred.detach().clone().requires_grad_(True)
    loss = ops.mae_loss(leaf, imgs, mask, patch_size, norm_pix, backend=backend)
    (loss * grad_output).backward()
    return loss, leaf.grad


def float64_loss_and_grad(pred, imgs, mask, patch_size, norm_pix, grad_output=1.0):
    leaf = pred.detach().double().requires_grad_(True)
    loss = reference.mae_loss(leaf, imgs.double(), mask.double(), patch_size, norm_pix)
    (loss * grad_output).backward()
    return loss, leaf.grad


def assert_matches_float64(pred, imgs, mask, patch_size, norm_pix, grad_output=1.0):
    loss, dpred = fused_loss_and_grad(pred, imgs, mask, patch_size, norm_pix, grad_output)
    loss6, dpred6 = float64_loss_and_grad(pred, imgs, mask, patch_size, norm_pix, grad_output)
    assert loss.dtype == F32 and loss.shape == ()
    assert dpred.dtype == pred.dtype and dpred.shape == pred.shape
    # The loss is fp32 arithmetic on exactly the values the reference gets, whatever pred's dtype.
    assert_close("loss", loss, loss6, F32)
    assert_close("dpred", dpred, dpred6, pred.dtype)
    return dpred


# ---------------------------------------------------------------------------------------------
# Against float64


@pytest.mark.parametrize("pred_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("norm_pix", [True, False])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "p{}c{}_{}x{}".format(*g))
def test_matches_float64(triton_device, geometry, norm_pix, pred_dtype):
    patch_size, channels, grid_h, grid_w = geometry
    pred, imgs, mask = make_case(3, patch_size, channels, grid_h, grid_w, pred_dtype, triton_device,
                                 seed=hash((geometry, norm_pix, str(pred_dtype))) % 2**31)
    assert_matches_float64(pred, imgs, mask, patch_size, norm_pix)


@pytest.mark.parametrize("mask_kind", ["random", "ones", "one_row"])
def test_masks(triton_device, mask_kind):
    pred, imgs, mask = make_case(4, 2, 3, 3, 5, BF16, triton_device, mask_kind, seed=1)
    dpred = assert_matches_float64(pred, imgs, mask, 2, True)
    # Uncounted patches get exactly zero gradient, not a rounding residue.
    assert (dpred[mask == 0] == 0).all()
    assert (dpred[mask == 1] != 0).any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_zero_mask_gives_zero_loss_and_zero_gradient(triton_device, backend):
    """No counted patch (mask_ratio 0, or a batch with nothing masked): the loss is 0 with a zero
    gradient on every backend, not 0 / 0 = NaN."""
    for norm_pix in (True, False):
        pred, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device, seed=14)
        for zeros in (torch.zeros_like(mask), torch.zeros_like(mask, dtype=torch.bool)):
            loss, dpred = fused_loss_and_grad(pred, imgs, zeros, 2, norm_pix, backend=backend)
            assert loss.item() == 0.0 and loss.dtype == F32
            assert torch.equal(dpred, torch.zeros_like(pred))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_eps_must_be_a_positive_float(triton_device, backend):
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device)
    with pytest.raises(TypeError, match="eps must be a positive float, got str"):
        ops.mae_loss(pred, imgs, mask, 2, eps="1e-6", backend=backend)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps must be a positive finite float"):
            ops.mae_loss(pred, imgs, mask, 2, eps=bad, backend=backend)


def test_bool_mask_equals_float_mask(triton_device):
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device, seed=2)
    as_float = fused_loss_and_grad(pred, imgs, mask, 2, True)
    as_bool = fused_loss_and_grad(pred, imgs, mask.bool(), 2, True)
    for a, b in zip(as_float, as_bool):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_output", [3.7, -0.25])
def test_gradient_scales_with_grad_output(triton_device, grad_output):
    pred, imgs, mask = make_case(2, 4, 3, 2, 3, BF16, triton_device, seed=3)
    assert_matches_float64(pred, imgs, mask, 4, True, grad_output)


def test_widest_patch(triton_device):
    """p = 32 with 3 channels: P = 3072 values per patch, one row per program."""
    pred, imgs, mask = make_case(2, 32, 3, 1, 1, BF16, triton_device, mask_kind="ones", seed=4)
    assert_matches_float64(pred, imgs, mask, 32, True)


def test_strided_inputs(triton_device):
    """imgs channels_last, cropped and transposed; pred a slice past a class token (as MAE's decoder
    output ``[:, 1:, :]``); mask transposed: all read in place with their strides."""
    patch_size, batch, grid_h, grid_w = 2, 3, 3, 5
    pred, imgs, mask = make_case(batch, patch_size, 3, grid_h, grid_w, F32, triton_device, seed=5)
    H, W = imgs.shape[2:]
    wide = torch.randn(batch, 3, H + 3, W + 2, device=triton_device)
    wide[:, :, 1:H + 1, 2:] = imgs
    strided_imgs = {
        "channels_last": imgs.contiguous(memory_format=torch.channels_last),
        "crop": wide[:, :, 1:H + 1, 2:],
        "transposed": imgs.transpose(2, 3).contiguous().transpose(2, 3),
    }
    loss6, dpred6 = float64_loss_and_grad(pred, imgs, mask, patch_size, True)
    with_token = torch.randn(batch, grid_h * grid_w + 1, pred.shape[-1], device=triton_device)
    with_token[:, 1:] = pred
    mask_t = mask.t().contiguous().t()
    for name, strided in strided_imgs.items():
        assert not strided.is_contiguous()
        leaf = with_token.clone().requires_grad_(True)
        loss = ops.mae_loss(leaf[:, 1:, :], strided, mask_t, patch_size, True, backend="triton")
        loss.backward()
        assert_close(f"{name} loss", loss, loss6, F32)
        assert_close(f"{name} dpred", leaf.grad[:, 1:], dpred6, F32)
        assert (leaf.grad[:, 0] == 0).all()


def test_no_gradient_written_in_evaluation(triton_device):
    """Without a gradient to compute the kernel skips dpred; the loss is the same either way."""
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, BF16, triton_device, seed=6)
    training, _ = fused_loss_and_grad(pred, imgs, mask, 2, True)
    with torch.no_grad():
        no_grad = ops.mae_loss(pred.clone().requires_grad_(True), imgs, mask, 2, backend="triton")
    no_leaf = ops.mae_loss(pred, imgs, mask, 2, backend="triton")
    assert torch.equal(no_grad, training) and torch.equal(no_leaf, training)
    assert not no_leaf.requires_grad


def test_autograd_saves_only_the_gradient(triton_device):
    """One saved tensor, shaped like pred: neither pred nor the target is kept for the backward."""
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, BF16, triton_device, seed=7)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.mae_loss(pred.requires_grad_(True), imgs, mask, 2, backend="triton")
    assert [(t.shape, t.dtype) for t in saved] == [(pred.shape, pred.dtype)]


# ---------------------------------------------------------------------------------------------
# Poisoned outputs, determinism


def test_every_output_element_is_written(triton_device, poisoned_allocations):
    """Fill every fresh allocation with NaN: a kernel that skips an element leaves a NaN behind."""
    for patch_size, channels, grid_h, grid_w in GEOMETRIES:
        pred, imgs, mask = make_case(3, patch_size, channels, grid_h, grid_w, BF16, triton_device, seed=8)
        loss, dpred = fused_loss_and_grad(pred, imgs, mask, patch_size, True)
        assert not torch.isnan(loss), f"p={patch_size}: loss is NaN (an unwritten row loss)"
        assert not torch.isnan(dpred).any(), f"p={patch_size}: dpred has unwritten (NaN) elements"


def test_deterministic(triton_device):
    pred, imgs, mask = make_case(5, 2, 3, 3, 5, BF16, triton_device, seed=9)
    first, second = (fused_loss_and_grad(pred, imgs, mask, 2, True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Registration: opcheck and torch.compile


def test_opcheck(triton_device):
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, BF16, triton_device, seed=10)
    pred.requires_grad_(True)
    for args in [(pred, imgs, mask, 2, True, 1e-6, True), (pred, imgs, mask, 2, False, 1e-6, False)]:
        torch.library.opcheck(mae_loss_op, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def _decoder_head_loss(tokens, weight, imgs, mask):
    """MAE's last step: a linear head, the class token dropped, the loss."""
    pred = (tokens @ weight.t())[:, 1:, :]
    return ops.mae_loss(pred, imgs, mask, 2, backend="triton")


def test_compile_fullgraph_equals_eager(triton_device):
    """Dynamo + AOTAutograd trace the op and its backward with no graph break."""
    _, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device, seed=11)
    tokens = torch.randn(2, 16, 8, device=triton_device)
    weight = torch.randn(12, 8, device=triton_device)
    forward_targets, backward_targets = set(), set()
    torch._dynamo.reset()  # compile afresh, so that the recording backend sees the graphs
    compiled = torch.compile(_decoder_head_loss, fullgraph=True,
                             backend=recording_backend(forward_targets, backward_targets))
    results = []
    for fn in (_decoder_head_loss, compiled):
        w = weight.clone().requires_grad_(True)
        loss = fn(tokens, w, imgs, mask)
        (loss * 1.5).backward()
        results.append((loss, w.grad))
    torch.testing.assert_close(results[1], results[0])
    assert_graph_runs(forward_targets, ["mae_loss"], triton_device)


def test_inductor_lowers_the_op_through_a_registered_fallback(triton_device, monkeypatch):
    """The fake kernel registers Inductor's fallback for dres::mae_loss (dres.ops.registration: the
    implicit fallback prints the IR of the op's inputs eagerly before torch 2.12, minutes for a deep decoder)."""
    from torch._inductor.lowering import lowerings

    import dres.ops.registration as registration

    op = torch.ops.dres.mae_loss.default
    monkeypatch.delitem(lowerings, op, raising=False)  # start from an Inductor that has never seen the op
    monkeypatch.setattr(registration, "FALLBACKS_REGISTERED", set())
    _, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device, seed=12)
    tokens, weight = torch.randn(2, 16, 8, device=triton_device), torch.randn(12, 8, device=triton_device)
    compiled = torch.compile(_decoder_head_loss, fullgraph=True, backend="inductor")
    w = weight.clone().requires_grad_(True)
    with inductor_caches_off():
        loss = compiled(tokens, w, imgs, mask)
        loss.backward()
    assert "dres::mae_loss" in registration.FALLBACKS_REGISTERED and op in lowerings
    w_eager = weight.clone().requires_grad_(True)
    want = _decoder_head_loss(tokens, w_eager, imgs, mask)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(w.grad, w_eager.grad)


# ---------------------------------------------------------------------------------------------
# MAE's patch layout and forward_loss


def test_patchify_layout():
    """Column (pp*p + q)*C + c of patch (i, j) holds imgs[b, c, i*p + pp, j*p + q] (MAE's layout)."""
    p, C, H, W = 2, 3, 4, 6
    imgs = torch.randn(2, C, H, W)
    got = patchify(imgs, p)
    assert got.shape == (2, (H // p) * (W // p), p * p * C)
    for b, i, j, pp, q, c in itertools.product(range(2), range(H // p), range(W // p), range(p), range(p), range(C)):
        assert got[b, i * (W // p) + j, (pp * p + q) * C + c] == imgs[b, c, i * p + pp, j * p + q]
    square = torch.randn(2, C, 6, 6)
    assert torch.equal(unpatchify(patchify(square, 3), C), square)
    with pytest.raises(ValueError, match="cannot unpatchify"):
        unpatchify(got, C)  # a 2 x 3 grid of patches is not square


@pytest.mark.parametrize("norm_pix", [True, False])
def test_mae_forward_loss_fused_and_unfused(triton_device, norm_pix):
    """A real MAE forward (pred is the decoder's output past the class token, mask from
    random_masking): the model's loss through the fused kernel and through the unfused formula
    agree, value and gradient into pred; fused_loss=None picks the kernel on CUDA (eager)."""
    torch.manual_seed(13)
    model = tiny_mae(norm_pix_loss=norm_pix).to(triton_device)
    imgs = torch.randn(3, 3, 8, 8, device=triton_device)
    model.fused_loss = False
    loss, pred, mask = model(imgs, mask_ratio=0.5)
    model.fused_loss = True
    if triton_device.type == "cpu":  # backend None is the reference on CPU: force the kernel
        model.encoder.transformer.backend = "triton"
    fused = model.forward_loss(imgs, pred, mask)
    assert_close("loss", fused, loss.detach().double(), F32)
    (want,) = torch.autograd.grad(loss, pred, retain_graph=True)
    (got,) = torch.autograd.grad(fused, pred)
    assert_close("dpred", got, want, F32)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_errors_name_the_argument(triton_device, backend):
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, F32, triton_device)
    defaults = dict(pred=pred, imgs=imgs, mask=mask, patch_size=2, backend=backend)
    call = lambda **kw: ops.mae_loss(**{**defaults, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="imgs must have shape \\(B, C, H, W\\)"):
        call(imgs=imgs[0])
    with pytest.raises(ValueError, match="imgs has H x W = 6 x 10, not divisible by patch_size = 4"):
        call(patch_size=4)
    with pytest.raises(ValueError, match="pred has shape \\(2, 15, 11\\); expected"):
        call(pred=pred[..., :11])
    with pytest.raises(ValueError, match="pred has shape"):
        call(pred=pred[:1])
    with pytest.raises(ValueError, match="mask has shape \\(2, 14\\); expected \\(B, L\\) = \\(2, 15\\)"):
        call(mask=mask[:, :14])
    with pytest.raises(TypeError, match="pred has dtype torch.int64"):
        call(pred=pred.long())
    with pytest.raises(TypeError, match="imgs has dtype torch.uint8"):
        call(imgs=imgs.to(torch.uint8))
    with pytest.raises(TypeError, match="mask has dtype torch.int64"):
        call(mask=mask.long())
    with pytest.raises(TypeError, match="patch_size must be an int"):
        call(patch_size=2.0)
    with pytest.raises(ValueError, match="patch_size must be positive"):
        call(patch_size=0)
    with pytest.raises(ValueError, match="imgs requires grad"):
        call(imgs=imgs.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="mask requires grad"):
        call(mask=mask.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="norm_pix needs more than one value per patch"):
        call(pred=pred[:, :, :1], imgs=imgs[:, :1, :3, :5], patch_size=1)
    if backend == "triton":
        with pytest.raises(TypeError, match="pred has dtype torch.float64"):
            call(pred=pred.double())


def test_patch_above_kernel_maximum(triton_device):
    from dres.kernels import MAX_PATCH_DIM

    side = 74  # 74 * 74 * 3 = 16428 values per patch
    assert side * side * 3 > MAX_PATCH_DIM
    imgs = torch.randn(1, 3, side, side, device=triton_device)
    pred = torch.randn(1, 1, side * side * 3, device=triton_device)
    with pytest.raises(ValueError, match=f"above the kernel's maximum of {MAX_PATCH_DIM}"):
        ops.mae_loss(pred, imgs, torch.ones(1, 1, device=triton_device), side, backend="triton")


def test_unknown_backend_and_cpu_without_interpreter(monkeypatch):
    pred, imgs, mask = make_case(1, 2, 3, 1, 1, F32, "cpu", mask_kind="ones")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.mae_loss(pred, imgs, mask, 2, backend="apex")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend in ("triton", "cuda"):  # no csrc kernel for this op: "cuda" means Triton
        with pytest.raises(ValueError, match=r"pred is on cpu\); set TRITON_INTERPRET=1"):
            ops.mae_loss(pred, imgs, mask, 2, backend=backend)


def test_default_backend_is_reference_on_cpu():
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, torch.float64, "cpu")
    loss = ops.mae_loss(pred, imgs.double(), mask, 2)
    assert loss.dtype == torch.float64  # float64 works only through the reference
    assert torch.equal(loss, reference.mae_loss(pred, imgs.double(), mask, 2))


@pytest.mark.gpu
def test_tensors_on_different_devices():
    pred, imgs, mask = make_case(2, 2, 3, 3, 5, F32, "cuda")
    with pytest.raises(ValueError, match="imgs is on cpu but pred is on cuda"):
        ops.mae_loss(pred, imgs.cpu(), mask, 2)
    with pytest.raises(ValueError, match="mask is on cpu but pred is on cuda"):
        ops.mae_loss(pred, imgs, mask.cpu(), 2)


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, Inductor under autocast


def mae_mask(batch: int, num_patches: int) -> torch.Tensor:
    """MAE's masking on the GPU: 75% of each image's patches, chosen by argsort of noise (1 = masked)."""
    rank = torch.rand(batch, num_patches, device="cuda").argsort(dim=1).argsort(dim=1)
    return (rank >= num_patches // 4).float()


@pytest.mark.gpu
@pytest.mark.parametrize("norm_pix", [True, False])
@pytest.mark.parametrize("batch,img_size,patch_size", [(256, 224, 16), (256, 32, 2), (64, 224, 32)])
def test_gpu_realistic_shapes(batch, img_size, patch_size, norm_pix):
    grid = img_size // patch_size
    pred, imgs, _ = make_case(batch, patch_size, 3, grid, grid, BF16, "cuda", seed=img_size + patch_size)
    mask = mae_mask(batch, grid * grid)
    assert_matches_float64(pred, imgs, mask, patch_size, norm_pix)


@pytest.mark.gpu
def test_gpu_compile_inductor_under_autocast():
    torch.manual_seed(0)
    head = torch.nn.Linear(512, 768).cuda()
    tokens = torch.randn(32, 197, 512, device="cuda")
    imgs = torch.rand(32, 3, 224, 224, device="cuda")
    mask = mae_mask(32, 196)

    def step(tokens):
        with torch.autocast("cuda", dtype=BF16):
            return ops.mae_loss(head(tokens)[:, 1:, :], imgs, mask, 16)

    compiled = torch.compile(step, fullgraph=True)
    eager_loss = step(tokens)
    eager_grad = torch.autograd.grad(eager_loss, head.weight)[0]
    loss = compiled(tokens)
    grad = torch.autograd.grad(loss, head.weight)[0]
    assert rel_err(loss, eager_loss) < 1e-5
    assert rel_err(grad, eager_grad) < TOLERANCE[BF16]
