"""Short-sequence multi-head self-attention (``dres.ops.short_attention``) against float64 PyTorch.

Forward and backward of the Triton kernels against ``F.scaled_dot_product_attention`` in float64 on
fresh random inputs, with tests/helpers.py's per-dtype relative-L2 tolerances, at odd sizes: one
token, N below and above 16, N not dividing the 128-row tile, a last group of fewer sequences, the
largest packed N, and above it (a program per sequence) N past a power of two, N not a multiple of
the query block, the largest N; custom scale, strided qkv and output gradients, poisoned outputs, the saved tensors,
opcheck, torch.compile, and bad input. On CPU the kernels run under TRITON_INTERPRET=1
(tests/conftest.py) in fp32 and fp16: the interpreter multiplies bf16 ``tl.dot`` operands as their
raw uint16 bits, so bf16 runs on the GPU only; ``gpu``-marked tests add the models' shapes and Inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dres.ops as ops
from dres.ops import reference
from dres.ops.short_attention import short_attention_backward_op, short_attention_op
from helpers import BF16, F16, F32, TOLERANCE, assert_close, recording_backend, rel_err

# (B, H, N, d): 64-row tiles (N <= 16) and 128-row ones, one token, a tile of padding rows after
# the whole sequences (128 % N != 0), a last group of fewer sequences (B not a multiple of 128 // N),
# one sequence per tile with half the tile padding (N = 65), the largest packed N; above it a program
# per sequence: one key past a power of two (129), N not a multiple of the query block (197, the
# ViT-B/16 MAE decoder's tokens, with its head dim 32), the largest N.
SHAPES = [(5, 3, 5, 16), (2, 1, 1, 32), (3, 3, 17, 16), (9, 1, 17, 32), (4, 3, 33, 16), (3, 1, 65, 16),
          (2, 1, 128, 16), (2, 2, 129, 16), (2, 1, 197, 32), (1, 2, 256, 16)]


def kernel_dtypes(device: torch.device) -> list[torch.dtype]:
    return [F32, F16] if device.type == "cpu" else [F32, BF16, F16]


def make_qkv(B, H, N, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Scale 1.5: scores of a few units, softmax rows neither flat nor one-hot.
    return (1.5 * torch.randn(B, N, 3 * H * d, generator=gen)).to(dtype).to(device)


def sdpa(qkv: torch.Tensor, num_heads: int, scale=None) -> torch.Tensor:
    """F.scaled_dot_product_attention of timm's (B, H, N, d) views of qkv, transposed back to (B, N, C)."""
    B, N, three_c = qkv.shape
    q, k, v = qkv.reshape(B, N, 3, num_heads, three_c // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(B, N, three_c // 3)


def forward_backward(fn, qkv, g, dtype=None):
    """(out, dqkv) of ``fn`` on a fresh leaf of qkv (cast to ``dtype`` when given) for the output gradient g."""
    leaf = qkv.detach().to(dtype or qkv.dtype).requires_grad_(True)
    out = fn(leaf)
    out.backward(g.to(out.dtype))
    return out, leaf.grad


def assert_matches_float64(qkv, num_heads, scale=None, g=None):
    g = torch.randn(qkv.shape[:2] + (qkv.shape[-1] // 3,), device=qkv.device) if g is None else g
    out, dqkv = forward_backward(lambda t: ops.short_attention(t, num_heads, scale, backend="triton"), qkv, g)
    want, dwant = forward_backward(lambda t: sdpa(t, num_heads, scale), qkv, g, torch.float64)
    assert out.dtype == qkv.dtype and out.is_contiguous() and dqkv.dtype == qkv.dtype
    assert_close("out", out, want, qkv.dtype)
    assert_close("dqkv", dqkv, dwant, qkv.dtype)
    return out, dqkv


# ---------------------------------------------------------------------------------------------
# Against float64


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}N{}d{}".format(*s))
def test_matches_float64(triton_device, shape):
    for dtype in kernel_dtypes(triton_device):
        assert_matches_float64(make_qkv(*shape, dtype, triton_device, seed=hash(shape) % 2**31), shape[1])


def test_custom_scale(triton_device):
    for scale in (0.3, -0.7):
        assert_matches_float64(make_qkv(3, 2, 17, 16, F32, triton_device, seed=1), 2, scale)


@pytest.mark.parametrize("N", [17, 150])
def test_strided_inputs_read_in_place_or_copied(triton_device, N):
    """qkv a slice of wider rows (read in place) or a transposed view (copied); output gradients a
    slice, a transposed view and an expanded tensor: each gives exactly the contiguous results."""
    B, H, d = 3, 2, 16
    qkv = make_qkv(B, H, N, d, F32, triton_device, seed=2)
    g = torch.randn(B, N, H * d, device=triton_device)
    want = assert_matches_float64(qkv, H, g=g)
    run = lambda t, grad: forward_backward(lambda x: ops.short_attention(x, H, backend="triton"), t, grad)  # noqa: E731
    transposed = lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731  (same values, rows uneven)
    wide = torch.randn(B, N, 3 * H * d + 8, device=triton_device)
    wide[..., :3 * H * d] = qkv
    for name, strided in (("slice", wide[..., :3 * H * d]), ("transposed", transposed(qkv))):
        out, dqkv = run(strided, g)
        assert torch.equal(out, want[0]) and torch.equal(dqkv, want[1]), name
    g_wide = torch.randn(B, N, 2 * H * d, device=triton_device)
    g_wide[..., :H * d] = g
    for name, strided in (("slice", g_wide[..., :H * d]), ("transposed", transposed(g))):
        assert torch.equal(run(qkv, strided)[1], want[1]), name
    ones = torch.ones(1, 1, 1, device=triton_device).expand(B, N, H * d)
    assert torch.equal(run(qkv, ones)[1], run(qkv, ones.contiguous())[1])


def test_every_output_element_is_written(triton_device, poisoned_allocations):
    """Every fresh allocation starts as NaN: an element the kernels skip (a head, a token of the
    last, partial group of sequences, a q/k/v part of dqkv) stays NaN."""
    for B, H, N, d in [(9, 3, 17, 16), (4, 2, 33, 32), (5, 1, 5, 16), (2, 2, 150, 16)]:
        out, dqkv = assert_matches_float64(make_qkv(B, H, N, d, F16, triton_device, seed=N), H)
        assert not torch.isnan(out).any() and not torch.isnan(dqkv).any()


def test_autograd_saves_only_qkv(triton_device):
    """The backward recomputes the softmax: qkv is the one saved tensor (no output, no log-sum-exp)."""
    qkv = make_qkv(2, 2, 17, 16, F16, triton_device, seed=3).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.short_attention(qkv, 2, backend="triton")
    assert len(saved) == 1 and saved[0] is qkv


# ---------------------------------------------------------------------------------------------
# Registration: opcheck, eager fast path, torch.compile


def test_opcheck(triton_device):
    qkv = make_qkv(3, 2, 17, 16, F16, triton_device, seed=4)
    g = torch.randn(17, 3, 32, device=triton_device).to(F16).transpose(0, 1)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for args in ((qkv.clone().requires_grad_(True), 2, 0.25), (qkv, 2, 0.25)):
        torch.library.opcheck(short_attention_op, args, test_utils=checks)
    # The backward op has no autograd of its own (no double backward): plain inputs.
    torch.library.opcheck(short_attention_backward_op, (g, qkv, 2, 0.25), test_utils=checks)


def test_eager_calls_bypass_the_custom_ops(triton_device):
    qkv = make_qkv(2, 1, 5, 16, F32, triton_device).requires_grad_(True)
    assert type(ops.short_attention(qkv, 1, backend="triton").grad_fn).__name__ == "ShortAttentionFnBackward"


def test_compile_fullgraph_matches_eager(triton_device):
    """Dynamo + AOTAutograd trace the Function into the custom ops, forward and backward, with no
    graph break, and compute exactly what eager does (Inductor itself runs on the GPU)."""
    B, H, N, d = 3, 2, 17, 16
    x = torch.randn(B, N, 24, device=triton_device)
    w_qkv = torch.randn(3 * H * d, 24, device=triton_device) / 24**0.5

    def block(x, w_qkv):
        return ops.short_attention(x @ w_qkv.t(), H, backend="triton")

    forward_targets, backward_targets = set(), set()
    torch._dynamo.reset()  # compile afresh, so that the recording backend sees the graphs
    compiled = torch.compile(block, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
    g = torch.randn(B, N, H * d, device=triton_device)
    results = []
    for fn in (block, compiled):
        w = w_qkv.clone().requires_grad_(True)
        out = fn(x, w)
        out.backward(g)
        results.append((out, w.grad))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    # opaque on every device: Inductor calls the ops (dres/ops/short_attention.py says why)
    assert torch.ops.dres.short_attention.default in forward_targets
    assert torch.ops.dres.short_attention_backward.default in backward_targets


# ---------------------------------------------------------------------------------------------
# Backends and bad input


def test_default_backend_is_the_reference_on_cpu_and_in_float64(triton_device):
    for qkv in (make_qkv(2, 2, 5, 16, F32, "cpu"), make_qkv(2, 2, 5, 16, torch.float64, triton_device)):
        out = ops.short_attention(qkv, 2)
        assert out.dtype == qkv.dtype and torch.equal(out, reference.short_attention(qkv, 2))
        assert_close("reference", out, sdpa(qkv.double(), 2), F32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_errors_name_the_argument(triton_device, backend):
    qkv = make_qkv(2, 2, 5, 16, F32, triton_device)
    call = lambda t=qkv, heads=2, **kw: ops.short_attention(t, heads, backend=backend, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"qkv must have shape \(B, N, 3\*C\), got \(5, 96\)"):
        call(qkv[0])
    with pytest.raises(ValueError, match="qkv has last dimension 95, not divisible by 3 \\* num_heads = 6"):
        call(qkv[..., :95])
    with pytest.raises(ValueError, match="num_heads must be positive"):
        call(heads=0)
    with pytest.raises(TypeError, match="num_heads must be an int, got float"):
        call(heads=2.0)
    with pytest.raises(TypeError, match="qkv has dtype torch.int64"):
        call(qkv.long())
    with pytest.raises(TypeError, match="scale must be None or a float, got str"):
        call(scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        call(scale=float("inf"))
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.short_attention(qkv, 2, backend="apex")
    if backend == "triton":
        with pytest.raises(ValueError, match="qkv has N = 257 tokens per sequence, above the kernel's maximum of 256"):
            call(make_qkv(1, 2, 257, 16, F32, triton_device))
        with pytest.raises(ValueError, match="qkv has head dimension d = 24"):
            call(make_qkv(1, 2, 5, 24, F32, triton_device))
        with pytest.raises(ValueError, match="d = 128 with N = 129 tokens; above 128 tokens the kernel supports d in 16"):
            call(make_qkv(1, 1, 129, 128, F32, triton_device), heads=1)
        with pytest.raises(TypeError, match="qkv has dtype torch.float64"):
            call(qkv.double())


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"qkv is on cpu\); set TRITON_INTERPRET=1"):
        ops.short_attention(make_qkv(1, 1, 5, 16, F32, "cpu"), 1, backend="triton")


# ---------------------------------------------------------------------------------------------
# GPU: the models' shapes, Inductor


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((64, 6, 17, 64), BF16), ((64, 8, 65, 32), BF16), ((32, 12, 50, 64), BF16),
                                         ((32, 12, 50, 64), F16), ((32, 12, 50, 64), F32), ((16, 2, 128, 128), BF16),
                                         ((64, 4, 9, 16), BF16), ((32, 16, 197, 32), BF16), ((16, 8, 256, 64), BF16),
                                         ((16, 8, 256, 64), F32), ((8, 2, 200, 64), F16)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).replace("torch.", ""))
def test_gpu_model_shapes_against_sdpa(shape, dtype):
    """Forward and backward against F.scaled_dot_product_attention in fp32 on the same values."""
    B, H, N, d = shape
    qkv = make_qkv(B, H, N, d, dtype, "cuda", seed=N)
    g = torch.randn(B, N, H * d, device="cuda")
    out, dqkv = forward_backward(lambda t: ops.short_attention(t, H), qkv, g)
    want, dwant = forward_backward(lambda t: sdpa(t, H), qkv, g, F32)
    assert_close("out", out, want, dtype)
    assert_close("dqkv", dqkv, dwant, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpu_compile_inductor_matches_eager(dtype):
    """Linear -> short_attention -> Linear under Inductor, forward and backward, against eager."""
    torch.manual_seed(0)
    B, H, N, d = 64, 6, 17, 64

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(H * d, 3 * H * d)
            self.proj = torch.nn.Linear(H * d, H * d)

        def forward(self, x):
            return self.proj(ops.short_attention(self.qkv(x), H))

    block = Block().cuda().to(dtype)
    x = torch.randn(B, N, H * d, device="cuda", dtype=dtype)
    compiled = torch.compile(block, fullgraph=True)
    results = []
    for fn in (block, compiled):
        block.zero_grad()
        out = fn(x)
        out.float().square().mean().backward()
        results.append((out, block.qkv.weight.grad.clone()))
    assert rel_err(results[1][0], results[0][0]) < TOLERANCE[dtype]
    assert rel_err(results[1][1], results[0][1]) < TOLERANCE[dtype]
