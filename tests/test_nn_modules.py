"""dres.nn's module wrappers of the fused ops: each computes what the PyTorch modules it stands in for
compute (outputs and gradients of inputs and parameters; float64 on the reference backend, float32
under the Triton interpreter), loads their state dicts, and is reached by set_backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dres.nn import FusedLayerNorm, FusedMLP, ResidualAct, ResidualAdd, ResidualLayerNorm, set_backend

# (backend, dtype, tolerance): exact in float64 on the reference, fp32 rounding under the interpreter
CASES = [("torch", torch.float64, dict(rtol=1e-12, atol=1e-12)), ("triton", torch.float32, dict(rtol=1e-4, atol=1e-4))]
IDS = ["reference-float64", "triton-float32"]


def leaves(*shapes, dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype).to(device).requires_grad_() for s in shapes]


def grads_of(outputs, inputs):
    """d(sum of squares of the outputs) / d(inputs), per input."""
    loss = sum(o.square().sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


def assert_all_close(got, want, tol):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def randomized_(module: nn.Module, dtype, device) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return module.to(device=device, dtype=dtype)


@pytest.mark.parametrize("backend,dtype,tol", CASES, ids=IDS)
def test_fused_layer_norm_is_layer_norm(triton_device, backend, dtype, tol):
    device = triton_device if backend == "triton" else "cpu"
    plain = randomized_(nn.LayerNorm(24), dtype, device)
    fused = FusedLayerNorm(24, backend=backend).to(device=device, dtype=dtype)
    fused.load_state_dict(plain.state_dict())
    (x,) = leaves((3, 5, 24), dtype=dtype, device=device)
    want, got = plain(x), fused(x)
    torch.testing.assert_close(got, want, **tol)
    assert_all_close(grads_of([got], [x, fused.weight, fused.bias]), grads_of([want], [x, plain.weight, plain.bias]),
                     tol)


@pytest.mark.parametrize("backend,dtype,tol", CASES, ids=IDS)
def test_residual_layer_norm_is_add_then_layer_norm(triton_device, backend, dtype, tol):
    device = triton_device if backend == "triton" else "cpu"
    plain = randomized_(nn.LayerNorm(24, eps=1e-6), dtype, device)
    fused = ResidualLayerNorm.from_layer_norm(plain, alpha=0.75, backend=backend).to(device)
    assert fused.weight is plain.weight and fused.bias is plain.bias and fused.eps == 1e-6
    x, h = leaves((4, 5, 24), (4, 5, 24), dtype=dtype, device=device)
    out, y = fused(x, h)
    want_out = 0.75 * x + h
    want = [want_out, plain(want_out)]
    torch.testing.assert_close(out, want[0], **tol)
    torch.testing.assert_close(y, want[1], **tol)
    params = [plain.weight, plain.bias]
    assert_all_close(grads_of([out, y], [x, h] + params), grads_of(want, [x, h] + params), tol)
    stream, y = fused(x)  # no branch yet: the stream and its plain LayerNorm
    assert stream is x
    torch.testing.assert_close(y, plain(x), **tol)
    # per-sample scales: ResidualDroppath's odd iteration (value of the plain add, gradient (1-m) into h)
    m = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=dtype, device=device)
    out, y = fused(x, h, grad_scale=1 - m)
    torch.testing.assert_close(out, want[0], **tol)
    (dh,) = torch.autograd.grad(y.sum() + out.sum(), [h])
    (dh_plain,) = torch.autograd.grad(plain(want_out).sum() + want_out.sum(), [h])
    torch.testing.assert_close(dh, (1 - m).view(-1, 1, 1) * dh_plain, **tol)


@pytest.mark.parametrize("backend,dtype,tol", CASES, ids=IDS)
def test_residual_add_and_act(triton_device, backend, dtype, tol):
    device = triton_device if backend == "triton" else "cpu"
    x, h = leaves((2, 6, 4, 4), (2, 6, 4, 4), dtype=dtype, device=device)
    scale = torch.tensor([2.0, 0.0], dtype=dtype, device=device)  # drop path: m / keep
    add = ResidualAdd(alpha=0.5, backend=backend).to(device)
    act = ResidualAct("relu", alpha=0.5, backend=backend).to(device)
    got = [add(x.flatten(2), h.flatten(2), row_scale=scale), act(x, h)]
    want = [0.5 * x.flatten(2) + scale.view(-1, 1, 1) * h.flatten(2), F.relu(0.5 * x + h)]
    assert_all_close(got, want, tol)
    assert_all_close(grads_of(got, [x, h]), grads_of(want, [x, h]), tol)
    identity = ResidualAct("identity", backend=backend).to(device)
    torch.testing.assert_close(identity(x, h), x + h, **tol)


@pytest.mark.parametrize("backend,dtype,tol", CASES, ids=IDS)
def test_fused_mlp_is_timms_mlp(triton_device, backend, dtype, tol):
    from timm.layers import Mlp

    device = triton_device if backend == "triton" else "cpu"
    plain = randomized_(Mlp(16, 48, 8), dtype, device)
    fused = FusedMLP(16, 48, 8, backend=backend).to(device=device, dtype=dtype)
    fused.load_state_dict(plain.state_dict())
    (x,) = leaves((3, 7, 16), dtype=dtype, device=device)
    want, got = plain(x), fused(x)
    torch.testing.assert_close(got, want, **tol)
    params = lambda m: [m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]  # noqa: E731
    assert_all_close(grads_of([got], [x] + params(fused)), grads_of([want], [x] + params(plain)), tol)


def test_alpha_is_a_buffer_outside_the_state_dict_and_set_backend_reaches_the_modules():
    model = nn.ModuleList([FusedLayerNorm(8), ResidualLayerNorm(8, alpha=0.5), ResidualAdd(0.5), ResidualAct(),
                           FusedMLP(8, 16)])
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias", "4.fc1.weight", "4.fc1.bias",
                                       "4.fc2.weight", "4.fc2.bias"}
    model[1].alpha.fill_(0.25)
    x, h = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(model[1](x, h)[0], 0.25 * x + h)
    set_backend(model, "triton")
    assert all(m.backend == "triton" for m in model)
    assert "alpha=0.25" in repr(model[1])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="act must be"):
        ResidualAct("gelu")
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        FusedLayerNorm((4, 8))
    with pytest.raises(TypeError, match="norm must be an nn.LayerNorm"):
        ResidualLayerNorm.from_layer_norm(nn.RMSNorm(8))
