"""The fused ops against the float64 reference: forward and backward, every mode of the brief's (docs/brief.md)
table, mixed dtypes, odd sizes, strided gradients, poisoned outputs, determinism, opcheck and bad
input. On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); the same tests
run on the GPU, where ``gpu``-marked ones add realistic shapes, torch.compile and CUDA graphs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import dres.ops as ops
from dres.ops import csrc_backend, reference
from helpers import (BF16, F16, F32, MODES, as_f64, assert_close, assert_direct_launch_equals_tritons_own,
                     assert_graph_runs, capture_graph, f64, grads, inductor_caches_off, leaves, make_case,
                     mode_scales, philox_kept, recording_backend, rel_err)


def rln_against_float64(x, h, w, b, alpha, row_scale=None, grad_scale=None, backend=None):
    """(out, y, dx, dh, dw, db) of the op and of the float64 reference, for one random cotangent."""
    xl, hl, wl, bl = leaves(x, h, w, b)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, alpha, row_scale=row_scale, grad_scale=grad_scale, backend=backend)
    g_out, g_y = torch.randn_like(out), torch.randn_like(y)
    got = grads((out, y), (g_out, g_y), (xl, hl, wl, bl))
    x6, h6, w6, b6 = as_f64(x, h, w, b)
    out6, y6 = reference.residual_layer_norm(x6, h6, w6, b6, alpha, row_scale=f64(row_scale), grad_scale=f64(grad_scale))
    want = grads((out6, y6), (g_out.double(), g_y.double()), (x6, h6, w6, b6))
    return (out, y, *got), (out6, y6, *want)


# ---------------------------------------------------------------------------------------------
# residual_layer_norm


@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, F32), (F32, BF16), (BF16, BF16), (F16, F16)])
@pytest.mark.parametrize("mode", MODES)
def test_residual_layer_norm_matches_float64(triton_device, x_dtype, h_dtype, mode):
    torch.manual_seed(hash((str(x_dtype), str(h_dtype), mode)) % 2**31)
    shape = (5, 7, 200)  # 35 rows: not a multiple of any row block; D=200 not a power of two
    alpha = 0.75
    x, h, w, b = make_case(shape, x_dtype, h_dtype, triton_device)
    row_scale, grad_scale = mode_scales(mode, shape[0], triton_device)
    (out, y, dx, dh, dw, db), (out6, y6, dx6, dh6, dw6, db6) = rln_against_float64(
        x, h, w, b, alpha, row_scale, grad_scale, backend="triton")
    assert out.dtype == x_dtype and y.dtype == h_dtype and out.shape == shape == y.shape

    assert_close("out", out, out6, x_dtype)
    # y normalises the stored (rounded) out, so it also carries out's rounding.
    assert_close("y", y, y6, h_dtype if x_dtype == F32 else BF16 if BF16 in (x_dtype, h_dtype) else F16)
    assert_close("dx", dx, dx6, x_dtype)
    assert_close("dh", dh, dh6, h_dtype)
    assert_close("dweight", dw, dw6, F32 if h_dtype == F32 else BF16)
    assert_close("dbias", db, db6, F32 if h_dtype == F32 else BF16)


@pytest.mark.parametrize("dim", [48, 1000])
@pytest.mark.parametrize("rows", [1, 33, 130])
def test_odd_sizes(triton_device, dim, rows):
    torch.manual_seed(dim * 1000 + rows)
    x, h, w, b = make_case((rows, dim), F32, F32, triton_device)
    got, want = rln_against_float64(x, h, w, b, 0.6, backend="triton")
    for name, a, r in zip(("out", "y", "dx", "dh", "dw", "db"), got, want):
        assert_close(name, a, r, F32)


def test_alpha_tensor_gets_gradient(triton_device):
    torch.manual_seed(1)
    x, h, w, b = make_case((4, 3, 64), F32, BF16, triton_device)
    alpha = torch.tensor(0.8, device=triton_device)
    xl, hl, wl, bl, al = leaves(x, h, w, b, alpha)
    row_scale, _ = mode_scales("rdp_even", 4, triton_device)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, al, row_scale=row_scale, backend="triton")
    g_out, g_y = torch.randn_like(out), torch.randn_like(y)
    got = grads((out, y), (g_out, g_y), (xl, hl, wl, bl, al))
    x6, h6, w6, b6, a6 = as_f64(x, h, w, b, alpha)
    out6, y6 = reference.residual_layer_norm(x6, h6, w6, b6, a6, row_scale=row_scale.double())
    want = grads((out6, y6), (g_out.double(), g_y.double()), (x6, h6, w6, b6, a6))
    assert got[4].shape == alpha.shape
    assert_close("dalpha", got[4], want[4], BF16)  # g comes from bf16 y's gradient path
    assert_close("dx", got[0], want[0], F32)


def test_alpha_tensor_changes_without_recompiling(triton_device):
    """A tensor alpha is read by the kernel: a new value gives a new result with no new kernel."""
    x, h, w, b = make_case((6, 32), F32, F32, triton_device)
    a = torch.tensor(1.0, device=triton_device)
    out1, _ = ops.residual_layer_norm(x, h, w, b, a, backend="triton")
    a.fill_(0.5)
    out2, _ = ops.residual_layer_norm(x, h, w, b, a, backend="triton")
    torch.testing.assert_close(out1, x + h)
    torch.testing.assert_close(out2, 0.5 * x + h)


def test_weight_and_bias_optional(triton_device):
    x, h, _, _ = make_case((9, 40), F32, F32, triton_device)
    xl, hl = leaves(x, h)
    out, y = ops.residual_layer_norm(xl, hl, None, None, backend="triton")
    g = torch.randn_like(y)
    y.backward(g)
    x6, h6 = as_f64(x, h)
    out6, y6 = reference.residual_layer_norm(x6, h6, None, None)
    y6.backward(g.double())
    assert_close("y", y, y6, F32)
    assert_close("dx", xl.grad, x6.grad, F32)


def test_dtype_overrides(triton_device):
    """residual_dtype / out_dtype choose the stored dtypes; y normalises the rounded out."""
    x, h, w, b = make_case((8, 3, 96), F32, F32, triton_device)
    out, y = ops.residual_layer_norm(x, h, w, b, 0.9, residual_dtype=BF16, out_dtype=F16, backend="triton")
    assert out.dtype == BF16 and y.dtype == F16
    ref_out, _ = reference.residual_layer_norm(x, h, w, b, 0.9, residual_dtype=BF16, out_dtype=F16)
    # The kernel may round an fp32 value on the other side of a bf16 tie (FMA vs separate ops):
    # at most one bf16 unit in the last place apart.
    ulp = torch.finfo(BF16).eps * ref_out.float().abs().clamp_min(torch.finfo(BF16).tiny)
    assert ((out.float() - ref_out.float()).abs() <= ulp).all()
    # y is the LayerNorm of exactly the stored bf16 out, to fp16 precision.
    y_of_out = reference.layer_norm(out.double(), w.double(), b.double())
    assert_close("y", y, y_of_out, F16)


# ---------------------------------------------------------------------------------------------
# The detach semantics of ResidualDroppath's odd iteration


def test_odd_iteration_detach_semantics(triton_device):
    torch.manual_seed(3)
    batch = 6
    x, h, w, b = make_case((batch, 5, 64), F32, F32, triton_device)
    m = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], device=triton_device)
    xl, hl = leaves(x, h)
    # X + f.detach() * m + f * (1 - m): the value of a plain residual ...
    out, y = ops.residual_layer_norm(xl, hl, w, b, 0.7, row_scale=None, grad_scale=1 - m, backend="triton")
    plain_out, plain_y = ops.residual_layer_norm(x, h, w, b, 0.7, backend="triton")
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(y, plain_y, rtol=0, atol=0)
    # ... but gradient into h only for the dropped samples, and exactly zero for kept ones.
    (out.sum() + (y * torch.randn_like(y)).sum()).backward()
    kept, dropped = m.bool(), ~m.bool()
    assert torch.count_nonzero(hl.grad[kept]) == 0
    assert (hl.grad[dropped].abs().amax(dim=(1, 2)) > 0).all()
    torch.testing.assert_close(hl.grad[dropped], xl.grad[dropped] / 0.7, rtol=1e-5, atol=1e-6)
    # The even iteration with the same mask: value m*h, gradient m*g (zero for dropped samples).
    hl.grad = None
    out_even, _ = ops.residual_layer_norm(x, hl, w, b, 0.7, row_scale=m, backend="triton")
    torch.testing.assert_close(out_even[dropped], 0.7 * x[dropped])
    out_even.sum().backward()
    assert torch.count_nonzero(hl.grad[dropped]) == 0
    assert torch.equal(hl.grad[kept], torch.ones_like(hl.grad[kept]))


# ---------------------------------------------------------------------------------------------
# residual_add and layer_norm


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, BF16), (BF16, BF16)])
def test_residual_add_matches_float64(triton_device, mode, x_dtype, h_dtype):
    torch.manual_seed(7)
    x, h, _, _ = make_case((6, 11, 48), x_dtype, h_dtype, triton_device)
    row_scale, grad_scale = mode_scales(mode, 6, triton_device)
    xl, hl = leaves(x, h)
    out = ops.residual_add(xl, hl, 0.6, row_scale, grad_scale, backend="triton")
    g = torch.randn_like(out)
    dx, dh = grads(out, g, (xl, hl))
    x6, h6 = as_f64(x, h)
    out6 = reference.residual_add(x6, h6, 0.6, f64(row_scale), f64(grad_scale))
    dx6, dh6 = grads(out6, g.double(), (x6, h6))
    assert_close("out", out, out6, x_dtype)
    assert_close("dx", dx, dx6, x_dtype)
    assert_close("dh", dh, dh6, h_dtype)


def test_residual_add_alpha_tensor_gradient(triton_device):
    x, h, _, _ = make_case((4, 2, 32), F32, F32, triton_device)
    alpha = torch.tensor(0.5, device=triton_device, requires_grad=True)
    out = ops.residual_add(x, h, alpha, backend="triton")
    g = torch.randn_like(out)
    out.backward(g)
    torch.testing.assert_close(alpha.grad, (g * x).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_dtype,out_dtype", [(F32, None), (BF16, None), (F32, BF16)])
@pytest.mark.parametrize("dim", [48, 1000])
def test_layer_norm_matches_float64(triton_device, x_dtype, out_dtype, dim):
    torch.manual_seed(dim)
    x, _, w, b = make_case((3, 13, dim), x_dtype, x_dtype, triton_device)
    xl, wl, bl = leaves(x, w, b)
    y = ops.layer_norm(xl, wl, bl, out_dtype=out_dtype, backend="triton")
    assert y.dtype == (out_dtype or x_dtype)
    g = torch.randn_like(y)
    dx, dw, db = grads(y, g, (xl, wl, bl))
    x6, w6, b6 = as_f64(x, w, b)
    y6 = reference.layer_norm(x6, w6, b6)
    dx6, dw6, db6 = grads(y6, g.double(), (x6, w6, b6))
    assert_close("y", y, y6, y.dtype)
    assert_close("dx", dx, dx6, x_dtype if y.dtype == F32 else BF16)
    assert_close("dweight", dw, dw6, F32 if y.dtype == F32 else BF16)
    assert_close("dbias", db, db6, F32 if y.dtype == F32 else BF16)


# ---------------------------------------------------------------------------------------------
# Strides, poisoned outputs, determinism, unused outputs


def test_gradients_with_any_strides(triton_device):
    torch.manual_seed(11)
    rows, dim = 24, 40
    x, h, w, b = make_case((rows, dim), F32, F32, triton_device)
    big = torch.randn(rows, 2 * dim, device=triton_device)
    cotangents = {
        "slice": (big[:, :dim], big[:, dim:]),                               # row stride 2*dim
        "expanded": (torch.randn(1, dim, device=triton_device).expand(rows, dim),  # row stride 0
                     torch.randn(dim, 1, device=triton_device).expand(dim, rows).t()),  # stride(-1) != 1
        "transposed": (torch.randn(dim, rows, device=triton_device).t(), torch.randn(rows, dim, device=triton_device)),
    }
    for name, (g_out, g_y) in cotangents.items():
        x6, h6, w6, b6 = as_f64(x, h, w, b)
        out6, y6 = reference.residual_layer_norm(x6, h6, w6, b6, 0.9)
        xl, hl, wl, bl = leaves(x, h, w, b)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, 0.9, backend="triton")
        got = grads((out, y), (g_out, g_y), (xl, hl, wl, bl))
        want = grads((out6, y6), (g_out.double(), g_y.double()), (x6, h6, w6, b6))
        for what, a, r in zip(("dx", "dh", "dw", "db"), got, want):
            assert_close(f"{name} {what}", a, r, F32)


def test_strided_inputs(triton_device):
    """x and h may be views with a row stride (e.g. a slice of a wider activation)."""
    wide = torch.randn(10, 3, 2 * 64, device=triton_device)
    x, h = wide[..., :64], wide[..., 64:]
    w, b = torch.randn(64, device=triton_device), torch.randn(64, device=triton_device)
    out, y = ops.residual_layer_norm(x, h, w, b, 0.5, backend="triton")
    ref_out, ref_y = reference.residual_layer_norm(x, h, w, b, 0.5)
    assert_close("out", out, ref_out, F32)
    assert_close("y", y, ref_y, F32)


def test_every_output_element_is_written(triton_device, poisoned_allocations):
    """Fill every fresh allocation with NaN: a kernel that skips an element leaves a NaN behind."""
    torch.manual_seed(5)
    x, h, w, b = make_case((7, 9, 72), F32, BF16, triton_device)
    row_scale, grad_scale = mode_scales("drop_path", 7, triton_device)
    xl, hl, wl, bl = leaves(x, h, w, b)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, 0.8, row_scale=row_scale, grad_scale=grad_scale, backend="triton")
    dx, dh, dw, db = grads((out, y), (torch.randn_like(out), torch.randn_like(y)), (xl, hl, wl, bl))
    z = ops.residual_add(x, h, 0.8, backend="triton")
    yn = ops.layer_norm(x, w, b, backend="triton")
    for name, t in dict(out=out, y=y, dx=dx, dh=dh, dw=dw, db=db, add=z, ln=yn).items():
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"


def test_weight_gradients_are_deterministic(triton_device):
    torch.manual_seed(13)
    x, h, w, b = make_case((257, 96), F32, BF16, triton_device)
    g_out, g_y = torch.randn(257, 96, device=triton_device), torch.randn(257, 96, device=triton_device).to(BF16)
    results = []
    for _ in range(2):
        xl, hl, wl, bl = leaves(x, h, w, b)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, backend="triton")
        results.append(grads((out, y), (g_out, g_y), (xl, hl, wl, bl)))
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_backward_scratch_is_reused_and_fully_rewritten(triton_device):
    """The backward's partial sums live in scratch kept between calls (no allocation per call): a
    second call reuses the buffer, and stale contents (poisoned with NaN here) never leak into
    the weight gradients or dalpha."""
    from dres.kernels import utils as kernels

    torch.manual_seed(17)
    x, h, w, b = make_case((5, 41, 96), F32, BF16, triton_device)
    alpha = torch.tensor(0.7, device=triton_device)
    cot = (torch.randn(5, 41, 96, device=triton_device), torch.randn(5, 41, 96, device=triton_device).to(BF16))

    def gradients():
        xl, hl, wl, bl, al = leaves(x, h, w, b, alpha)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, al, backend="triton")
        return grads((out, y), cot, (xl, hl, wl, bl, al))

    first = gradients()
    buffers = {key: buf.data_ptr() for key, buf in kernels._SCRATCH.items()}
    assert buffers, "the backward allocated no scratch to reuse"
    for buf in kernels._SCRATCH.values():
        buf.fill_(float("nan"))
    second = gradients()
    assert {key: buf.data_ptr() for key, buf in kernels._SCRATCH.items()} == buffers
    for name, a, c in zip(("dx", "dh", "dweight", "dbias", "dalpha"), first, second):
        assert torch.equal(a, c), f"{name} changed when the scratch held stale values"


def test_unused_out_or_y(triton_device):
    """Only y used (the residual stream unused later) or only out used: the missing gradient is zero."""
    x, h, w, b = make_case((12, 32), F32, F32, triton_device)
    for pick in (0, 1):
        x6, h6, w6, b6 = as_f64(x, h, w, b)
        out6, y6 = reference.residual_layer_norm(x6, h6, w6, b6)
        xl, hl, wl, bl = leaves(x, h, w, b)
        res = ops.residual_layer_norm(xl, hl, wl, bl, backend="triton")
        g = torch.randn_like(res[pick])
        res[pick].backward(g)
        (out6, y6)[pick].backward(g.double())
        assert_close(f"dx (output {pick})", xl.grad, x6.grad, F32)
        assert wl.grad is not None and torch.isfinite(wl.grad).all()


# ---------------------------------------------------------------------------------------------
# Registration: opcheck and torch.compile


# ---------------------------------------------------------------------------------------------
# Dropout of h inside the add: the mask drawn by the kernels (Philox of the element index), drawn
# again in the backward


def kept_mask(shape, p, seed, device):
    """The mask (1 kept, 0 dropped) the kernels draw for ``shape`` and ``p`` after torch.manual_seed(seed):
    residual_add of zeros and ones returns it scaled by 1 / (1 - p)."""
    torch.manual_seed(seed)
    ones = torch.ones(shape, device=device)
    return ops.residual_add(torch.zeros_like(ones), ones, dropout_p=p, backend="triton") * (1 - p)


@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, F32), (F32, BF16), (BF16, BF16)])
@pytest.mark.parametrize("mode", MODES)
def test_dropout_matches_float64_with_the_kernels_mask(triton_device, x_dtype, h_dtype, mode):
    """out = alpha*x + row_scale*dropout(h) and its LayerNorm, forward and backward, against the float64
    reference fed h * mask / (1 - p): the backward draws the forward's mask."""
    torch.manual_seed(hash((str(x_dtype), str(h_dtype), mode, "dropout")) % 2**31)
    shape, p, alpha = (5, 7, 200), 0.3, 0.75
    x, h, w, b = make_case(shape, x_dtype, h_dtype, triton_device)
    row_scale, grad_scale = mode_scales(mode, shape[0], triton_device)
    g_out, g_y = torch.randn(shape, device=triton_device).to(x_dtype), torch.randn(shape, device=triton_device)
    keep = kept_mask(shape, p, 7, triton_device).double()
    assert 0 < keep.mean().item() < 1
    xl, hl, wl, bl = leaves(x, h, w, b)
    torch.manual_seed(7)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, alpha, row_scale=row_scale, grad_scale=grad_scale, dropout_p=p,
                                     backend="triton")
    dx, dh, dw, db = grads((out, y), (g_out, g_y.to(y.dtype)), (xl, hl, wl, bl))
    x6, h6, w6, b6 = as_f64(x, h, w, b)
    out6, y6 = reference.residual_layer_norm(x6, h6 * keep / (1 - p), w6, b6, alpha, row_scale=f64(row_scale),
                                             grad_scale=f64(grad_scale))
    dx6, dh6, dw6, db6 = grads((out6, y6), (g_out.double(), g_y.to(y.dtype).double()), (x6, h6, w6, b6))
    assert_close("out", out, out6, x_dtype)
    assert_close("y", y, y6, h_dtype if x_dtype == F32 else BF16)
    assert_close("dx", dx, dx6, x_dtype)
    assert_close("dh", dh, dh6, h_dtype)
    assert torch.equal(dh == 0, (keep == 0) | (dh6 == 0))  # dropped elements get no gradient, exactly
    assert_close("dweight", dw, dw6, F32 if h_dtype == F32 else BF16)
    assert_close("dbias", db, db6, F32 if h_dtype == F32 else BF16)


def test_dropout_of_residual_add_and_noncontiguous_gradient(triton_device):
    torch.manual_seed(12)
    shape, p = (3, 33, 48), 0.5
    x, h = torch.randn(shape, device=triton_device), torch.randn(shape, device=triton_device).to(BF16)
    keep = kept_mask(shape, p, 9, triton_device)
    g = torch.randn(shape[:-1] + (2 * shape[-1],), device=triton_device)[..., ::2]  # every second element
    xl, hl = leaves(x, h)
    torch.manual_seed(9)
    out = ops.residual_add(xl, hl, 0.5, dropout_p=p, backend="triton")
    dx, dh = grads(out, g, (xl, hl))
    x6, h6 = as_f64(x, h)
    out6 = reference.residual_add(x6, h6 * keep.double() / (1 - p), 0.5)
    dx6, dh6 = grads(out6, g.double(), (x6, h6))
    assert_close("out", out, out6, F32)
    assert_close("dx", dx, dx6, F32)
    assert_close("dh", dh, dh6, BF16)


@pytest.mark.parametrize("dim", [48, 50])  # one Philox call per four elements of a row, one per element
def test_dropout_mask_is_the_documented_philox_stream(triton_device, dim):
    from dres.ops.residual_norm import residual_add_op

    shape, p = (3, 5, dim), 0.3
    for seed in (7, 2**40 + 5):  # a seed's high word is part of the key
        ones = torch.ones(shape, device=triton_device)
        scaled = residual_add_op(torch.zeros_like(ones), ones, None, 1.0, None, None, None, p,
                                 torch.tensor(seed, device=triton_device))
        assert torch.equal((scaled != 0).cpu(), philox_kept(shape, p, seed))


def test_dropout_keeps_one_minus_p_and_draws_a_new_mask_each_call(triton_device):
    shape, p = (64, 96), 0.25
    first, again, other = (kept_mask(shape, p, seed, triton_device) for seed in (3, 3, 4))
    assert set(first.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(first, again) and not torch.equal(first, other)
    n = first.numel()
    assert abs(first.sum().item() - n * (1 - p)) < 5 * (n * p * (1 - p)) ** 0.5
    # no structure along rows or columns: each row and each column draws its own elements
    assert len({tuple(r.tolist()) for r in first}) == shape[0]
    assert len({tuple(c.tolist()) for c in first.t()}) == shape[1]
    # two calls without re-seeding draw different masks
    ones = torch.ones(shape, device=triton_device)
    a, b = (ops.residual_add(torch.zeros_like(ones), ones, dropout_p=p, backend="triton") for _ in range(2))
    assert not torch.equal(a, b)
    # p = 0 is the op without dropout, bit for bit
    x, h, w, bias = make_case((4, 5, 48), F32, BF16, triton_device)
    without = ops.residual_layer_norm(x, h, w, bias, 0.9, backend="triton")
    with_zero = ops.residual_layer_norm(x, h, w, bias, 0.9, dropout_p=0.0, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(without, with_zero))


def test_dropout_backward_uses_the_forwards_mask_eager_and_compiled(triton_device):
    """With x = 0 and h = 1, out = mask / (1 - p) and dh = g * mask / (1 - p) = g * out: the backward's
    mask is the forward's, whatever the random stream (also compiled, where torch draws the seed)."""
    shape, p = (6, 40), 0.4

    def run(x, h):
        out, y = ops.residual_layer_norm(x, h, None, None, 1.0, dropout_p=p, backend="triton")
        return out

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    for fn in (run, compiled):
        h = torch.ones(shape, device=triton_device, requires_grad=True)
        out = fn(torch.zeros(shape, device=triton_device), h)
        g = torch.randn(shape, device=triton_device)
        (dh,) = torch.autograd.grad(out, h, g)
        assert set(out.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p)).item()}  # 1 / (1 - p) in fp32
        torch.testing.assert_close(dh, g * out)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dropout_p_must_be_a_probability_below_one(triton_device, backend):
    x = torch.randn(2, 3, 16, device=triton_device)
    for bad, error in ((1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="dropout_p"):
            ops.residual_layer_norm(x, x, None, None, dropout_p=bad, backend=backend)
        with pytest.raises(error, match="dropout_p"):
            ops.residual_add(x, x, dropout_p=bad, backend=backend)


def test_dropout_on_the_reference_backend_is_torchs_dropout():
    torch.manual_seed(1)
    x, h, p = torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64), 0.5
    out = ops.residual_add(x, h, 0.5, dropout_p=p, backend="torch")
    kept = (out - 0.5 * x).abs() > 1e-12
    torch.testing.assert_close(out[kept], (0.5 * x + h / (1 - p))[kept])
    torch.testing.assert_close(out[~kept], (0.5 * x)[~kept])
    assert 0 < kept.float().mean().item() < 1


def test_opcheck(triton_device):
    from dres.ops import residual_norm as rn

    torch.manual_seed(2)
    x, h, w, b = make_case((4, 3, 32), F32, BF16, triton_device)
    rs = torch.tensor([1.0, 0.0, 1.0, 1.0], device=triton_device)
    alpha = torch.tensor(0.9, device=triton_device)
    req = lambda *ts: [t.clone().requires_grad_(True) for t in ts]  # noqa: E731
    xr, hr, wr, br, ar = req(x, h, w, b, alpha)
    seed = torch.tensor(12345, device=triton_device)
    cases = [
        (rn.residual_layer_norm_op, (xr, hr, wr, br, None, 0.7, 1e-6, rs, None, None, None, 0.0, None)),
        (rn.residual_layer_norm_op, (xr, hr, wr, br, ar, 1.0, 1e-6, None, 1 - rs, F32, F32, 0.0, None)),
        (rn.residual_add_op, (xr, hr, ar, 1.0, rs, None, None, 0.0, None)),
        (rn.residual_layer_norm_op, (xr, hr, wr, br, ar, 1.0, 1e-6, rs, None, None, None, 0.2, seed)),
        (rn.residual_add_op, (xr, hr, None, 0.8, None, None, F32, 0.5, seed)),
        (rn.layer_norm_op, (xr, wr, br, 1e-6, BF16)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph_traces_forward_and_backward(triton_device):
    """Dynamo + AOTAutograd trace both custom ops with no graph break (Inductor itself runs on GPU)."""
    torch.manual_seed(4)
    x, h, w, b = make_case((3, 5, 64), F32, F32, triton_device)
    m = torch.tensor([1.0, 0.0, 1.0], device=triton_device)

    def two_sublayers(x, h, w, b, alpha):
        out, y = ops.residual_layer_norm(x, h, w, b, alpha, grad_scale=1 - m, backend="triton")
        out2, y2 = ops.residual_layer_norm(out, torch.tanh(y), w, b, alpha, backend="triton")
        return ops.residual_add(out2, y2, alpha, backend="triton")

    forward_targets, backward_targets = set(), set()
    torch._dynamo.reset()  # compile afresh, so that the recording backend sees the graphs
    compiled = torch.compile(two_sublayers, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
    alpha = torch.tensor(0.8, device=triton_device)
    xa, ha, wa, ba = leaves(x, h, w, b)
    xb, hb, wb, bb = leaves(x, h, w, b)
    eager = two_sublayers(xa, ha, wa, ba, alpha)
    comp = compiled(xb, hb, wb, bb, alpha)
    torch.testing.assert_close(comp, eager)
    g = torch.randn_like(eager)
    for a, c in zip(grads(eager, g, (xa, ha, wa, ba)), grads(comp, g, (xb, hb, wb, bb))):
        torch.testing.assert_close(c, a)
    assert_graph_runs(forward_targets, ["residual_layer_norm", "residual_add"], triton_device)
    assert_graph_runs(backward_targets, ["residual_norm_backward"], triton_device)


def test_inductor_lowers_the_ops_through_registered_fallbacks(triton_device, monkeypatch):
    """Inductor must not take its implicit-fallback path for the dres ops: before torch 2.12 that
    path formats the IR of every input eagerly, minutes for a deep model (the ViT-B/16
    official MAE's compile). The fake kernels register the fallbacks first; here the implicit path's message
    is recorded (at INFO, so torch >= 2.12's lazy message is built too) and must not name a dres op."""
    import logging

    import torch._inductor.exc as inductor_exc
    from torch._inductor.lowering import lowerings

    import dres.ops.registration as registration
    import dres.ops.residual_norm as rn

    names = [f"dres::{n}" for n in rn.FAKE_IMPLS]
    for name in rn.FAKE_IMPLS:  # start from an Inductor that has never seen the ops
        monkeypatch.delitem(lowerings, getattr(torch.ops.dres, name).default, raising=False)
    monkeypatch.setattr(registration, "FALLBACKS_REGISTERED", set())
    implicit = []
    original = inductor_exc.OperatorIssue.operator_str
    monkeypatch.setattr(inductor_exc.OperatorIssue, "operator_str", staticmethod(
        lambda target, args, kwargs: implicit.append(str(target)) or original(target, args, kwargs)))
    messages = []  # torch's loggers do not propagate to pytest's handler: listen on the logger itself
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("torch._inductor.graph")
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(handler)

    x, h, w, b = make_case((2, 3, 32), F32, F32, triton_device)
    h.requires_grad_(True)
    f = torch.compile(lambda x, h: ops.residual_add(*ops.residual_layer_norm(x, h, w, b, backend="triton"),
                                                    backend="triton"), backend="inductor", fullgraph=True)
    try:
        with inductor_caches_off():
            out = f(x, h)
            out.sum().backward()
    finally:
        logger.removeHandler(handler)
    assert not [t for t in implicit if any(n.replace("::", ".") in t or n in t for n in names)], implicit
    assert registration.FALLBACKS_REGISTERED == set(names)
    assert all(getattr(torch.ops.dres, n).default in lowerings for n in rn.FAKE_IMPLS)
    want_out, want_y = reference.residual_layer_norm(x, h, w, b)
    torch.testing.assert_close(out, want_out + want_y)


def test_inductor_dynamic_shapes_match_eager(triton_device):
    """``dynamic=True``: one Inductor compile of residual_layer_norm + residual_add and their backward
    serves three (B, T) sizes with per-sample scales; outputs and the gradients of x, h, weight, bias
    and alpha equal eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def two_sublayers(x, h, w, b, alpha, m):
        out, y = ops.residual_layer_norm(x, h, w, b, alpha=alpha, row_scale=m, backend="triton")
        return ops.residual_add(out, y, alpha=alpha, grad_scale=1 - m, backend="triton")

    torch.manual_seed(13)
    torch._dynamo.reset()  # two_sublayers' code object would keep compiles from another run of this test
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(two_sublayers, backend=counter, dynamic=True, fullgraph=True)
    compiles = []  # Inductor calls so far, after each size
    with inductor_caches_off():
        for batch, tokens in [(2, 3), (3, 5), (5, 2)]:
            x, h, w, b = make_case((batch, tokens, 32), F32, F32, triton_device)
            m = (torch.arange(batch, device=triton_device) % 2).float()
            alpha = torch.tensor(0.9, device=triton_device)
            inputs = [[t.clone().requires_grad_(True) for t in (x, h, w, b, alpha)] for _ in range(2)]
            eager, comp = two_sublayers(*inputs[0], m), compiled(*inputs[1], m)
            compiles.append(counter.frame_count)
            torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
            g = torch.randn(batch, tokens, 64, device=triton_device)[..., ::2]  # a strided gradient
            for a, c in zip(grads(eager, g, inputs[0]), grads(comp, g, inputs[1])):
                torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)
    # the first size may compile twice (Dynamo restarts once to specialise the float eps the custom
    # op's schema takes); the other sizes reuse that graph
    assert compiles[0] >= 1 and compiles[1:] == compiles[:1] * 2


def test_inductor_caches_off_restores_the_config_keys():
    """The compile tests switch Inductor's caches off through the configs' own patch(): afterwards
    the keys are back with their values (pytest 9's monkeypatch deleted them, failing later tests)."""
    before = (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
    with inductor_caches_off():
        assert not torch._inductor.config.fx_graph_cache and not torch._functorch.config.enable_autograd_cache
    assert (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache) == before


def test_op_test_files_collect_without_the_repository_root_on_sys_path(tmp_path):
    """Each op test file collects on its own, as `pytest tests/test_ops.py` from anywhere: shared
    helpers live in tests/helpers.py, never in benchmarks/ (importable only from the repo root)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(tests, f) for f in ("test_ops.py", "test_csrc.py", "test_mae_loss.py", "test_bias_gelu.py")]
    # PYTHONPATH less the repository root: the subprocess imports the dres this suite runs (device_check.sh's
    # csrc stage puts a build with the extension there)
    root = os.path.dirname(tests)
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Bad input


def _base(device):
    x = torch.randn(4, 3, 16, device=device)
    return x, torch.randn_like(x), torch.ones(16, device=device), torch.zeros(16, device=device)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_errors_name_the_argument(triton_device, backend):
    x, h, w, b = _base(triton_device)
    rln = lambda **kw: ops.residual_layer_norm(**{**dict(x=x, h=h, weight=w, bias=b, backend=backend), **kw})  # noqa: E731
    with pytest.raises(ValueError, match="h has shape"):
        rln(h=h[:, :2])
    with pytest.raises(ValueError, match="weight has shape"):
        rln(weight=torch.ones(15, device=triton_device))
    with pytest.raises(ValueError, match="bias has shape"):
        rln(bias=torch.ones(4, 16, device=triton_device))
    with pytest.raises(ValueError, match="row_scale has length 3"):
        rln(row_scale=torch.ones(3, device=triton_device))
    with pytest.raises(ValueError, match="not divisible by len\\(row_scale\\)"):
        ops.residual_add(x.view(12, 16), h.view(12, 16), row_scale=torch.ones(5, device=triton_device), backend=backend)
    with pytest.raises(ValueError, match="grad_scale must be a non-empty 1-D"):
        rln(grad_scale=torch.ones(4, 1, device=triton_device))
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        rln(x=torch.ones(4, 3, 16, dtype=torch.long, device=triton_device))
    with pytest.raises(TypeError, match="h has dtype torch.int32"):
        rln(h=torch.ones(4, 3, 16, dtype=torch.int32, device=triton_device))
    with pytest.raises(TypeError, match="alpha must be a float"):
        rln(alpha="0.5")
    with pytest.raises(ValueError, match="alpha must be a float or a 0-dim tensor"):
        rln(alpha=torch.ones(2, device=triton_device))
    with pytest.raises(TypeError, match="residual_dtype"):
        rln(residual_dtype=torch.int8)
    with pytest.raises(ValueError, match="x must have shape"):
        ops.layer_norm(torch.ones(16, device=triton_device), None, None, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_eps_must_be_a_positive_float_on_every_backend(triton_device, backend):
    """eps <= 0 gives NaN in y for a row of zero variance; a string was taken by one backend and
    refused by another. Now one contract: TypeError or ValueError naming eps."""
    x, h, w, b = _base(triton_device)
    for call in (lambda eps: ops.residual_layer_norm(x, h, w, b, eps=eps, backend=backend),
                 lambda eps: ops.layer_norm(x, w, b, eps=eps, backend=backend)):
        for bad in ("1e-6", None, torch.tensor(1e-6), True):
            with pytest.raises(TypeError, match="eps must be a positive float"):
                call(bad)
        for bad in (0.0, -1e-6, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="eps must be a positive finite float"):
                call(bad)
    out, y = ops.residual_layer_norm(x, h, w, b, eps=1, backend=backend)  # an int is a number too
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_per_sample_factors_that_require_grad_are_refused(triton_device, backend):
    """row_scale/grad_scale are masks (data): the torch backend used to differentiate row_scale and
    Triton silently not. Now every backend refuses one that requires grad, naming it."""
    x, h, w, b = _base(triton_device)
    m = torch.tensor([1.0, 0.0, 1.0, 1.0], device=triton_device, requires_grad=True)
    for name in ("row_scale", "grad_scale"):
        with pytest.raises(ValueError, match=f"{name} requires grad.*pass {name}.detach"):
            ops.residual_layer_norm(x, h, w, b, backend=backend, **{name: m})
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            ops.residual_add(x, h, backend=backend, **{name: m})
    out, _ = ops.residual_layer_norm(x, h, w, b, row_scale=m.detach(), backend=backend)
    torch.testing.assert_close(out[1], x[1])


def test_dim_above_maximum(triton_device):
    from dres.kernels import MAX_DIM

    x = torch.randn(2, MAX_DIM + 1, device=triton_device)
    with pytest.raises(ValueError, match=f"above the kernels' maximum of {MAX_DIM}"):
        ops.residual_add(x, x, backend="triton")


def test_unknown_backend_and_cpu_without_interpreter(monkeypatch):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.residual_add(x, x, backend="cutlass")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.residual_add(x, x, backend="triton")


@pytest.mark.gpu
def test_tensors_on_different_devices():
    x = torch.randn(4, 16, device="cuda")
    with pytest.raises(ValueError, match="h is on cpu but x is on cuda"):
        ops.residual_add(x, torch.randn(4, 16))
    with pytest.raises(ValueError, match="row_scale is on cpu"):
        ops.residual_add(x, x, row_scale=torch.ones(4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_default_backend_is_reference_on_cpu_and_in_float64(device):
    x = torch.randn(3, 8, dtype=torch.float64, device=device, requires_grad=True)
    out, y = ops.residual_layer_norm(x, x, None, None, 0.5)
    assert out.dtype == torch.float64  # float64 works only through the reference
    torch.testing.assert_close(out, 1.5 * x)
    torch.testing.assert_close(y, reference.layer_norm(out, None, None))


def test_an_input_that_is_not_a_tensor_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        ops.residual_add([1.0], torch.ones(1))
    with pytest.raises(TypeError, match="pre must be a torch.Tensor, got str"):
        ops.fused_bias_gelu("pre")
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got NoneType"):
        ops.short_attention(None, 2)


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, Inductor, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [12800, 65536])
@pytest.mark.parametrize("x_dtype", [F32, BF16])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_realistic_shapes(rows, x_dtype, mode):
    torch.manual_seed(rows)
    batch = rows // 50
    shape = (batch, 50, 768)
    x, h, w, b = make_case(shape, x_dtype, BF16, "cuda")
    row_scale, grad_scale = mode_scales(mode, batch, "cuda")
    got, want = rln_against_float64(x, h, w, b, 0.8, row_scale, grad_scale)
    for name, a, r in zip(("out", "y", "dx", "dh", "dw", "db"), got, want):
        assert_close(name, a, r, x_dtype if name in ("out", "dx") else BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [4096, 8192, 16384])
def test_gpu_wide_rows(dim):
    torch.manual_seed(dim)
    x, h, w, b = make_case((300, dim), F32, BF16, "cuda")
    got, want = rln_against_float64(x, h, w, b, 0.7)
    for name, a, r in zip(("out", "y", "dx", "dh", "dw", "db"), got, want):
        assert_close(name, a, r, F32 if name in ("out", "dx") else BF16)


@pytest.mark.gpu
def test_gpu_compile_inductor_block():
    torch.manual_seed(0)
    dim = 256
    lin1, lin2 = torch.nn.Linear(dim, dim).cuda(), torch.nn.Linear(dim, dim).cuda()
    n1w, n1b = torch.ones(dim, device="cuda"), torch.zeros(dim, device="cuda")
    alphas = torch.tensor([0.9, 0.8], device="cuda")

    def block(x, y, m):
        out, y = ops.residual_layer_norm(x, lin1(y), n1w, n1b, alphas[0], row_scale=m)
        out, y = ops.residual_layer_norm(out, torch.nn.functional.gelu(lin2(y)), n1w, n1b, alphas[1], grad_scale=1 - m)
        return out, y

    x = torch.randn(8, 64, dim, device="cuda", requires_grad=True)
    m = (torch.rand(8, device="cuda") > 0.3).float()
    compiled = torch.compile(block, fullgraph=True)
    with torch.autocast("cuda", dtype=BF16):
        ref = block(x, ops.layer_norm(x, n1w, n1b), m)
        got = compiled(x, ops.layer_norm(x, n1w, n1b), m)
    for a, c in zip(ref, got):
        assert rel_err(c, a) < 1e-2
    g = torch.autograd.grad(got[0].float().sum() + got[1].float().sum(), x)[0]
    r = torch.autograd.grad(ref[0].float().sum() + ref[1].float().sum(), x)[0]
    assert rel_err(g, r) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    torch.manual_seed(0)
    x, h, w, b = make_case((64, 50, 768), F32, BF16, "cuda")
    xs, hs = x.clone().requires_grad_(True), h.clone().requires_grad_(True)
    m = (torch.rand(64, device="cuda") > 0.2).float()
    g_out, g_y = torch.randn_like(x), torch.randn_like(h)

    def step():
        # backend named: outside a capture backend=None may pick csrc, whose bf16 rounding can differ
        out, y = ops.residual_layer_norm(xs, hs, w, b, 0.9, row_scale=m, backend="triton")
        return (out, y) + torch.autograd.grad((out, y), (xs, hs), (g_out, g_y))

    graph, static = capture_graph(step)  # warmed up on a side stream first, as PyTorch's docs prescribe
    for _ in range(2):
        with torch.no_grad():
            xs.copy_(torch.randn_like(x))
            m.copy_((torch.rand(64, device="cuda") > 0.5).float())
        graph.replay()
        eager = step()
        for a, c in zip(static, eager):
            assert torch.equal(a, c)


def dropped(x, h, p, backend):
    return ops.residual_layer_norm(x, h, None, None, 1.0, dropout_p=p, backend=backend)[0]


def dropout_step(forward, x, h, g, p, backend):
    """out of ``forward`` (``dropped`` or its compiled form) and h's gradient for cotangent g."""
    out = forward(x, h, p, backend)
    return out, torch.autograd.grad(out, h, g)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=pytest.mark.skipif(
    not csrc_backend.available(), reason="dres._C (csrc) not built"))])
def test_gpu_dropout_draws_afresh_in_captured_graphs_and_under_inductor(backend):
    """x = 0, h = 1: out = mask / (1 - p), dh = g * out. A captured graph draws a new mask at every
    replay (the seed is a tensor torch's generator fills inside the graph); Inductor's compile too."""
    shape, p = (64, 768), 0.1
    x, g = torch.zeros(shape, device="cuda"), torch.randn(shape, device="cuda")
    h = torch.ones(shape, device="cuda", requires_grad=True)
    graph, (out, dh) = capture_graph(lambda: dropout_step(dropped, x, h, g, p, backend))
    compiled = torch.compile(dropped, fullgraph=True)
    seen = []
    for _ in range(3):
        graph.replay()
        seen.append(out.clone())
        torch.testing.assert_close(dh, g * out)
        c_out, c_dh = dropout_step(compiled, x, h, g, p, backend)
        torch.testing.assert_close(c_dh, g * c_out)
        seen.append(c_out)
    for mask in seen:
        kept = (mask != 0).float().mean().item()
        assert abs(kept - (1 - p)) < 0.01, kept
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:])


@pytest.mark.gpu
def test_gpu_cached_launch_equals_tritons_own_launch():
    """After the first launch of a specialisation the compiled kernel is called directly
    (dres.kernels.utils.CachedLaunch). Results equal Triton's own launch bit for bit, also when a
    later call differs in what Triton specialises on (alignment, strides, dtypes, flags) from the
    one that filled the cache."""
    from dres.kernels import residual_norm as kernels

    torch.manual_seed(21)
    base = torch.randn(130, 3 * 200, device="cuda")
    cases = [  # each differs from the one before in a specialisation Triton makes
        (base[:, :200].contiguous(), F32, None),
        (base[:, 1:201], F32, None),  # misaligned rows, odd row stride
        (base[:, :200].contiguous(), BF16, None),
        (base[:, :200].contiguous(), F32, torch.tensor(0.7, device="cuda")),
        (base[:, :208].contiguous(), F32, None),  # D and strides divisible by 16
    ]

    def run(x, h_dtype, alpha):
        h = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(h_dtype)
        w, b = torch.linspace(0.5, 1.5, x.shape[1], device="cuda"), torch.linspace(-1, 1, x.shape[1], device="cuda")
        m = (torch.arange(130, device="cuda") % 3 > 0).float()
        xl, hl, wl, bl = leaves(x, h, w, b)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, 0.8 if alpha is None else alpha, row_scale=m,
                                         backend="triton")
        g = torch.linspace(-1, 1, x.numel(), device="cuda").view(x.shape)
        return (out, y, *grads((out, y), (g, g.to(y.dtype)), (xl, hl, wl, bl)))

    assert_direct_launch_equals_tritons_own(run, cases, [kernels._FORWARD, kernels._BACKWARD])


class _FakeCompiledKernel:
    """What CachedLaunch uses of a triton CompiledKernel; records the direct launches."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def run(self, *launch_args):
        self.launches.append(launch_args)


class _FakeJITFunction:
    """What CachedLaunch uses of a @triton.jit kernel on a GPU: parameters, pre-run hooks, and
    ``kernel[grid](*args, **options)`` (Triton's own launch), which returns a compiled kernel."""

    def __init__(self, constexpr):
        self.params = [SimpleNamespace(is_constexpr=c) for c in constexpr]
        self.arg_names = [f"arg{i}" for i in range(len(constexpr))]
        self.fn = SimpleNamespace(__name__="fake_kernel")
        self.pre_run_hooks, self.own_launches, self.compiled = [], [], []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.own_launches.append((grid, args, options))
            self.compiled.append(_FakeCompiledKernel())
            return self.compiled[-1]
        return launch


_ON_GPU = SimpleNamespace(is_cuda=True)  # the first argument: CachedLaunch caches only CUDA launches


@contextlib.contextmanager
def _fake_cuda(device_index=0):
    """A current CUDA device and a raw stream handle (device index + 1000) without a GPU."""
    from dres.kernels import utils

    with mock.patch.object(utils, "_raw_stream", lambda index: 1000 + index), \
            mock.patch.object(torch.cuda, "current_device", return_value=device_index):
        yield


def test_cached_launch_calls_the_compiled_kernel_directly_after_the_first_launch():
    """The regression on triton 3.6 and 3.8: their launch hooks are empty HookChains (never None),
    which must not count as hooks, or the direct launch is never taken."""
    from dres.kernels.utils import CachedLaunch, _hooks_set

    assert not _hooks_set()  # the installed Triton's default knobs
    kernel = _FakeJITFunction([False, False, False, True])
    launch = CachedLaunch(kernel)
    x = torch.zeros(64)
    args = (_ON_GPU, x, 17, 64)
    with _fake_cuda(device_index=1):
        launch((5, 3), args, num_warps=4)
        assert kernel.own_launches == [((5, 3), args, {"num_warps": 4})]
        launch((6, 2), args, num_warps=4)
        launch((7,), (_ON_GPU, torch.ones(64), 33, 64), num_warps=4)  # same specialisation, other values
    assert len(kernel.own_launches) == 1
    compiled = kernel.compiled[0]
    # JITFunction.run's order: grid padded to 3-D, stream, function, packed metadata, then no launch
    # metadata and no hooks, then every kernel argument, constexprs included
    assert compiled.launches[0] == (6, 2, 1, 1001, compiled.function, compiled.packed_metadata, None, None, None,
                                    *args)
    second = compiled.launches[1]
    assert second[:4] == (7, 1, 1, 1001) and second[9] is _ON_GPU and second[10].eq(1).all() and second[11:] == (33, 64)


def test_cached_launch_key_separates_what_triton_specialises_on():
    """A new specialisation (alignment, dtype, integer width, divisibility by 16 or equality to 1,
    a constexpr, launch options, device) goes through Triton's own launch again."""
    from dres.kernels.utils import CachedLaunch

    kernel = _FakeJITFunction([False, False, False, False, True])
    launch = CachedLaunch(kernel)
    base = torch.zeros(64)
    first = (_ON_GPU, base, 17, 0.5, 8)
    variants = [
        ((_ON_GPU, base[1:], 17, 0.5, 8), {}),  # 4-byte offset: not 16-byte aligned
        ((_ON_GPU, base.bfloat16(), 17, 0.5, 8), {}),
        ((_ON_GPU, base, 32, 0.5, 8), {}),  # divisible by 16
        ((_ON_GPU, base, 1, 0.5, 8), {}),  # Triton makes 1 a constant
        ((_ON_GPU, base, 2**31 + 1, 0.5, 8), {}),  # i64
        ((_ON_GPU, base, 2**63 + 1, 0.5, 8), {}),  # u64
        ((_ON_GPU, base, 17, 0.5, 16), {}),  # constexpr value
        (first, {"num_warps": 8}),
        (first, {"num_stages": 2}),
        (first, {"device_index": 1}),
    ]
    with _fake_cuda():
        launch((1,), first, num_warps=4)
    for args, change in variants:
        before = len(kernel.own_launches)
        with _fake_cuda(change.get("device_index", 0)):
            launch((1,), args, num_warps=change.get("num_warps", 4), num_stages=change.get("num_stages"))
            assert len(kernel.own_launches) == before + 1, (args, change)
            launch((1,), args, num_warps=change.get("num_warps", 4), num_stages=change.get("num_stages"))
            assert len(kernel.own_launches) == before + 1, ("not cached", args, change)
    with _fake_cuda():  # values Triton does not specialise on: still the first entry
        launch((1,), (_ON_GPU, torch.ones(64), 33, 0.7, 8), num_warps=4)
    assert len(kernel.compiled[0].launches) == 1


def test_cached_launch_key_is_never_coarser_than_tritons_specialisation():
    """Two arguments Triton's own specialisation tells apart never share a key."""
    pytest.importorskip("triton._C.libtriton", reason="Triton's native specialisation")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from dres.kernels.utils import CachedLaunch

    launch = CachedLaunch(_FakeJITFunction([False]))
    x = torch.zeros(64)
    values = [0, 1, 2, 16, 17, -16, -1, 2**31 - 16, 2**31, 2**31 + 1, 2**63 - 1, 2**63, True, False, 0.5, None,
              x, x[1:], x[4:], x.bfloat16(), x.half()[8:], torch.zeros((), dtype=torch.float64)]
    specs = [native_specialize_impl(BaseBackend, v, False, True, True) for v in values]
    keys = [launch.key((v,), 0, (4, None)) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            if specs[i] != specs[j]:
                assert keys[i] != keys[j], (values[i], values[j], specs[i], specs[j])


def test_cached_launch_takes_tritons_own_path_with_hooks_or_nothing_to_cache():
    """A registered launch hook (proton), a kernel pre-run hook, no raw-stream API, or a launch that
    returns no compiled kernel: every call goes through Triton's own launch."""
    import triton

    from dres.kernels import utils

    args = (_ON_GPU, torch.zeros(64), 17)

    def calls_through_triton(setup=contextlib.nullcontext, kernel=None):
        kernel = kernel or _FakeJITFunction([False, False, False])
        launch = utils.CachedLaunch(kernel)
        with _fake_cuda(), setup():
            for _ in range(3):
                launch((1,), args, num_warps=4)
        return len(kernel.own_launches)

    assert calls_through_triton() == 1

    @contextlib.contextmanager
    def enter_hook():
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            yield
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)

    assert calls_through_triton(enter_hook) == 3
    assert not utils._hooks_set()  # removed again
    assert calls_through_triton(lambda: mock.patch.object(triton.knobs.runtime, "launch_exit_hook",
                                                          lambda metadata: None)) == 3  # a plain callable
    with_pre_run_hook = _FakeJITFunction([False, False, False])
    with_pre_run_hook.pre_run_hooks.append(lambda *args, **kwargs: None)
    assert calls_through_triton(kernel=with_pre_run_hook) == 3
    assert calls_through_triton(lambda: mock.patch.object(utils, "_raw_stream", None)) == 3

    class ReturnsNothing(_FakeJITFunction):  # e.g. a Triton whose launch returns no CompiledKernel
        def __getitem__(self, grid):
            return lambda *args, **options: self.own_launches.append((grid, args, options))

    assert calls_through_triton(kernel=ReturnsNothing([False, False, False])) == 3
    with _fake_cuda(), pytest.raises(TypeError, match="fake_kernel takes 3 arguments, got 2"):
        utils.CachedLaunch(_FakeJITFunction([False, False, False]))((1,), args[:2], num_warps=4)


def test_cached_launch_under_the_interpreter_caches_nothing():
    """The CPU interpreter's kernels have no parameter metadata: Triton's own path, nothing kept."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without a GPU here")
    from dres.kernels import residual_norm as kernels

    x, h, w, b = leaves(*make_case((3, 5, 24), F32, F32, "cpu"))
    out, y = ops.residual_layer_norm(x, h, w, b, 0.9, backend="triton")
    (out.sum() + y.sum()).backward()
    assert kernels._FORWARD.constexpr is None and kernels._FORWARD.compiled == {} and kernels._BACKWARD.compiled == {}
    assert x.grad is not None


def test_default_backend_follows_the_measurements():
    """backend=None: csrc in eager at small sizes when built, Triton when compiling, capturing a CUDA
    graph, on large tensors or without csrc; the reference on CPU (csrc/README.md, "Default backend")."""
    from dres.ops.checks import CSRC_EAGER_MAX_ELEMENTS, choose_default_backend

    small, large = 12800 * 768, CSRC_EAGER_MAX_ELEMENTS + 1
    assert choose_default_backend(True, small, False, False, True) == "cuda"
    assert choose_default_backend(True, CSRC_EAGER_MAX_ELEMENTS, False, False, True) == "cuda"
    assert choose_default_backend(True, large, False, False, True) == "triton"
    assert choose_default_backend(True, small, True, False, True) == "triton"  # torch.compile
    assert choose_default_backend(True, small, False, True, True) == "triton"  # CUDA-graph capture
    assert choose_default_backend(True, small, False, False, False) == "triton"  # csrc not built
    assert choose_default_backend(False, small, False, False, True) == "torch"
    assert ops.checks.resolve_backend(None, torch.zeros(2, 8)) == "torch"


@pytest.mark.parametrize("csrc_built", [False, True])
def test_eager_default_leaves_launch_bound_norms_and_mlps_to_pytorch_without_the_extension(monkeypatch, csrc_built):
    """backend=None in eager mode: without the csrc extension the PyTorch formula for a residual stream of rows x D^2
    below LAUNCH_BOUND_WORK (its ops cost the host less than the Triton calls' Python), Triton above it, during a
    CUDA-graph capture and inside replayed_launches(); with the extension its C++ path for the small stream (fake CUDA
    tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dres.ops import csrc_backend
    from dres.ops.checks import replayed_launches, resolve_backend_by_work, takes_pytorch_formula

    monkeypatch.setattr(csrc_backend, "available", lambda: csrc_built)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with FakeTensorMode():
        dinov2 = torch.empty(128, 257, 384, device="cuda", dtype=BF16)  # 4.9e9: the formulas measured 1.24x faster
        vit_b = torch.empty(128, 197, 768, device="cuda", dtype=BF16)  # 1.5e10: the kernels 1.25x the plain model
        small_default = "cuda" if csrc_built else "torch"
        assert resolve_backend_by_work(None, dinov2) == small_default
        assert resolve_backend_by_work(None, vit_b) == "triton"  # above the extension's 2^24 elements too
        assert resolve_backend_by_work("triton", dinov2) == "triton"
        assert takes_pytorch_formula(None, dinov2) == (not csrc_built)
        with replayed_launches():
            assert not takes_pytorch_formula(None, dinov2)
        capturing[0] = True
        assert resolve_backend_by_work(None, dinov2) == "triton"  # captured: its replays pay no launch


def test_compiled_default_leaves_launch_bound_norms_and_mlps_to_inductor(monkeypatch):
    """backend=None under torch.compile: the PyTorch formula (Inductor's code) for a residual stream of rows x D^2
    below LAUNCH_BOUND_WORK, the dres kernels above it, inside replayed_launches() (a captured step) and
    for a backend asked for by name (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dres.ops.checks import LAUNCH_BOUND_WORK, launch_bound, replayed_launches, resolve_backend_by_work

    with FakeTensorMode():
        dinov2 = torch.empty(128, 257, 384, device="cuda", dtype=BF16)  # 4.9e9: Inductor's code measured faster
        vit_b = torch.empty(128, 197, 768, device="cuda", dtype=BF16)  # 1.5e10: the dres kernels measured faster
        host = torch.empty(128, 257, 384, dtype=BF16)
        assert launch_bound(dinov2) and not launch_bound(vit_b)
        assert 128 * 257 * 384 ** 2 < LAUNCH_BOUND_WORK < 128 * 197 * 768 ** 2
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert resolve_backend_by_work(None, dinov2) == "torch"
        assert resolve_backend_by_work(None, vit_b) == "triton"
        assert resolve_backend_by_work("triton", dinov2) == "triton"
        assert resolve_backend_by_work(None, host) == "torch"  # the reference off CUDA, as ever
        with replayed_launches():
            with replayed_launches():
                assert resolve_backend_by_work(None, dinov2) == "triton"
            assert resolve_backend_by_work(None, dinov2) == "triton"  # the outer context still holds
        assert resolve_backend_by_work(None, dinov2) == "torch"
        with pytest.raises(RuntimeError), replayed_launches():
            raise RuntimeError("a failed capture")
        assert resolve_backend_by_work(None, dinov2) == "torch"  # left on the way out of an error too


@pytest.mark.gpu
def test_gpu_compiled_default_traces_the_kernels_only_where_launches_are_replayed():
    """Traced by torch.compile with backend=None, a launch-bound residual norm and MLP take their PyTorch
    formulas (no Triton launch in the graph), the same inside replayed_launches() the dres kernels; both compute
    the eager values."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    from dres.ops.checks import replayed_launches

    device = torch.device("cuda")
    x, h, w, b = make_case((4, 33, 64), F32, BF16, device)
    w1, b1 = torch.randn(96, 64, device=device, dtype=BF16) / 8, torch.randn(96, device=device, dtype=BF16)
    w2, b2 = torch.randn(64, 96, device=device, dtype=BF16) / 10, torch.randn(64, device=device, dtype=BF16)

    def block(x, h, w, b, w1, b1, w2, b2):
        out, y = ops.residual_layer_norm(x, h, w, b, 0.9)
        return out, ops.fused_mlp(y, w1, b1, w2, b2)

    eager = block(x, h, w, b, w1, b1, w2, b2)
    for replayed, kernels in ((False, False), (True, True)):
        forward_targets, backward_targets = set(), set()
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
        with replayed_launches() if replayed else contextlib.nullcontext():
            got = compiled(*leaves(x, h, w, b, w1, b1, w2, b2))
        assert (triton_kernel_wrapper_functional in forward_targets) == kernels, replayed
        for name, a, c in zip(("out", "mlp"), eager, got):
            assert_close(name, c, a, BF16)


def test_backward_config_hook_of_the_tuning_sweep(triton_device):
    """The backward launcher reads ``backward_config`` at every launch: benchmarks.tune_backward's
    ``backward_config_replaced`` runs it with another tile and programs per SM, gradients unchanged."""
    from benchmarks.tune_backward import backward_config_replaced
    from dres.kernels import residual_norm as kernels

    x, h, w, b = make_case((3, 5, 40), F32, F32, triton_device)

    def gradients():
        xl, hl, wl, bl = leaves(x, h, w, b)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, 0.9, backend="triton")
        return grads((out, y), (torch.ones_like(out), torch.ones_like(y)), (xl, hl, wl, bl))

    default = gradients()
    assert kernels.backward_config(40)[0] != 2
    with backward_config_replaced(40, 2, 1, 1), mock.patch.object(kernels, "cdiv", wraps=kernels.cdiv) as cdiv:
        tuned = gradients()
    assert cdiv.call_args_list[-1].args == (15, 2)  # the backward: 15 rows in tiles of 2
    for got, want in zip(tuned, default):
        torch.testing.assert_close(got, want)
