"""dres.nn: decay schedules, the fused TransformerStack against a plain unfused stack, and the
ResidualDroppath controller (gradient-zero semantics, eval, batch-size checks, state_dict resume).

Tolerances: the reference backend runs in float64 and must match the plain float64 stack to 1e-10;
the Triton kernels (interpreter on CPU) run in float32 and must match to 1e-4 (forward) / 1e-3
(relative, gradients).
"""

import io

import pytest
import torch
import torch.nn.functional as F

from dres.nn import ResidualDroppath, TransformerStack, decay_schedule, depth_linear_rates
from tiny_models import tiny_classifier


# ---------------------------------------------------------------------------------------------
# A plain pre-LN stack, written out with no fused op: x = a*x + s*f(LN(x)) per sub-layer


def plain_ln(norm, x):
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def plain_attention(attn, x):
    B, N, C = x.shape
    H = attn.num_heads
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    weights = ((q @ k.transpose(-2, -1)) * (C // H) ** -0.5).softmax(dim=-1)
    return F.linear((weights @ v).transpose(1, 2).reshape(B, N, C), attn.proj.weight, attn.proj.bias)


def plain_mlp(mlp, x):
    return F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)


def plain_stack(stack, x, masks=None, hooks=None, collect=()):
    """masks: per residual a (B,) forward multiplier of the branch, or None."""
    alphas = stack.alphas.tolist()
    hooks, outputs = hooks or {}, {}
    for k, blk in enumerate(stack.blocks):
        if k in hooks:
            x = hooks[k](x, outputs)
        for r, branch in ((2 * k, lambda t: plain_attention(blk.attn, plain_ln(blk.norm1, t))),
                          (2 * k + 1, lambda t: plain_mlp(blk.mlp, plain_ln(blk.norm2, t)))):
            h = branch(x)
            if masks is not None and masks[r] is not None:
                h = h * masks[r].to(h.dtype)[:, None, None]
            x = alphas[r] * x + h
        if k in collect:
            outputs[k] = x
    return (plain_ln(stack.norm, x) if stack.norm is not None else x), outputs


def perturb_(module, std=0.05, seed=0):
    """Move every parameter off its init (zero-initialised layers would hide most of the function)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)
    return module


def param_grads(module, loss_fn):
    module.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_grads_close(got, want, rtol, atol):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Schedules


def test_decay_schedule_linspace_depth12_alpha06():
    alphas = decay_schedule(24, 0.6)  # depth 12, one alpha per attention and per MLP sub-layer
    official = (1 - torch.linspace(0, 1, 24, dtype=torch.float64) * (1 - 0.6)).tolist()  # the authors' formula
    assert alphas == pytest.approx(official, abs=1e-12)
    assert alphas[0] == 1.0 and alphas[-1] == pytest.approx(0.6, abs=1e-12)
    assert alphas[1] == pytest.approx(1 - 0.4 / 23) and alphas[12] == pytest.approx(1 - 12 * 0.4 / 23)
    assert all(a > b for a, b in zip(alphas, alphas[1:]))


def test_decay_schedule_paper_depth12_alpha06():
    alphas = decay_schedule(24, 0.6, schedule="paper")
    assert alphas == pytest.approx([1 - l * 0.4 / 24 for l in range(24)], abs=1e-12)
    assert alphas[0] == 1.0 and alphas[12] == pytest.approx(0.8)
    assert alphas[-1] == pytest.approx(1 - 23 * 0.4 / 24)  # 0.61666...: the text's schedule stops short of alpha_min
    assert alphas[-1] > 0.6


def test_decay_schedule_per_block_and_identity():
    per_block = decay_schedule(24, 0.6, per_block=True)
    assert per_block[0::2] == per_block[1::2]  # attention and MLP of a block share it
    assert per_block[0::2] == pytest.approx([1 - b * 0.4 / 11 for b in range(12)])
    assert decay_schedule(24, 0.6, "paper", per_block=True)[-1] == pytest.approx(1 - 11 * 0.4 / 12)
    assert decay_schedule(24, 1.0) == [1.0] * 24 and decay_schedule(24, 1.0, "paper") == [1.0] * 24
    with pytest.raises(ValueError, match="schedule"):
        decay_schedule(24, 0.6, schedule="cosine")


# ---------------------------------------------------------------------------------------------
# TransformerStack == plain stack


def test_stack_matches_plain_float64_reference_backend():
    torch.manual_seed(0)
    for alphas in (None, decay_schedule(6, 0.6)):  # alpha_min = 1 (no decay), and a decayed one
        stack = perturb_(TransformerStack(32, 3, 4, alphas=alphas, backend="torch")).double()
        x = torch.randn(3, 7, 32, dtype=torch.float64, requires_grad=True)
        y, outs = stack.forward_intermediates(x, (0, 2))
        y_ref, outs_ref = plain_stack(stack, x, collect=(0, 2))
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(outs[0], outs_ref[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(outs[2], outs_ref[2], rtol=1e-10, atol=1e-10)  # the raw stream, pre final norm
        w = torch.randn_like(y)
        got = param_grads(stack, lambda: (stack(x) * w).sum())
        want = param_grads(stack, lambda: (plain_stack(stack, x)[0] * w).sum())
        assert_grads_close(got, want, rtol=1e-9, atol=1e-10)


def test_stack_without_final_norm_and_hooks_match_plain():
    torch.manual_seed(1)
    stack = perturb_(TransformerStack(16, 3, 2, final_norm=False, backend="torch")).double()
    extra = torch.randn(2, 5, 16, dtype=torch.float64)
    # block 1 adds a branch (a = 1); block 2 replaces the stream with a function of it and block 0's output (a = 0)
    hooks = {1: lambda s, o: (torch.tanh(s) * extra, 1.0), 2: lambda s, o: (0.5 * s + o[0], 0.0)}
    plain_hooks = {1: lambda s, o: s + torch.tanh(s) * extra, 2: lambda s, o: 0.5 * s + o[0]}
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, _ = stack.forward_intermediates(x, (0,), hooks=hooks)
    y_ref, _ = plain_stack(stack, x, hooks=plain_hooks, collect=(0,))
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    got = param_grads(stack, lambda: stack.forward_intermediates(x, (0,), hooks=hooks)[0].square().sum())
    want = param_grads(stack, lambda: plain_stack(stack, x, hooks=plain_hooks, collect=(0,))[0].square().sum())
    assert_grads_close(got, want, rtol=1e-9, atol=1e-10)


def test_stack_triton_interpreter_matches_plain(triton_device):
    torch.manual_seed(2)
    stack = perturb_(TransformerStack(32, 2, 2, backend="triton")).to(triton_device)
    x = torch.randn(2, 4, 32, device=triton_device)
    y = stack(x)
    torch.testing.assert_close(y, plain_stack(stack, x)[0], rtol=1e-4, atol=1e-4)
    got = param_grads(stack, lambda: stack(x).square().sum())
    want = param_grads(stack, lambda: plain_stack(stack, x)[0].square().sum())
    assert_grads_close(got, want, rtol=1e-3, atol=1e-4)


def test_mlp_fused_path_choice(triton_device, monkeypatch):
    """Mlp: fused=True/False force the path and agree; fused=None (auto) runs dres.ops.fused_mlp in
    eager mode and the plain chain under torch.compile (Inductor fuses bias+GELU itself);
    set_fused_mlp and set_backend reach every Mlp of a stack."""
    import dres.ops
    from dres.nn import Mlp, set_backend, set_fused_mlp

    torch.manual_seed(3)
    mlp = perturb_(Mlp(16, 48, backend="triton")).to(triton_device)
    x = torch.randn(2, 5, 16, device=triton_device)
    want = plain_mlp(mlp, x)
    for fused in (True, False):
        mlp.fused = fused
        torch.testing.assert_close(mlp(x), want, rtol=1e-4, atol=1e-5)

    calls = []
    real = dres.ops.fused_mlp
    monkeypatch.setattr(dres.ops, "fused_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    mlp.fused = None
    mlp(x)
    assert calls == [1], "auto should take the fused MLP in eager mode"
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(mlp, backend="eager", fullgraph=True)(x), want, rtol=1e-4, atol=1e-5)
    assert calls == [1], "auto should leave the MLP to the compiler under torch.compile"

    stack = TransformerStack(16, 2, 2, backend="torch")
    mlps = [blk.mlp for blk in stack.blocks]
    assert all(m.backend == "torch" and m.fused is None for m in mlps)
    set_fused_mlp(set_backend(stack, "cuda"), False)
    assert all(m.backend == "cuda" and m.fused is False for m in mlps)


def test_mlp_gelu_approximation_on_both_paths(triton_device):
    """Mlp(approximate="tanh") and an Mlp whose act was replaced by a tanh nn.GELU: the fused path
    computes the tanh GELU of the plain path, not the exact one; a bad value is refused."""
    from dres.nn import Mlp

    torch.manual_seed(4)
    x = torch.randn(2, 5, 16, device=triton_device)
    built = perturb_(Mlp(16, 48, backend="triton", approximate="tanh")).to(triton_device)
    replaced = perturb_(Mlp(16, 48, backend="triton")).to(triton_device)
    replaced.act = torch.nn.GELU(approximate="tanh")
    for mlp in (built, replaced):
        want = F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias), approximate="tanh"), mlp.fc2.weight,
                        mlp.fc2.bias)
        assert (want - plain_mlp(mlp, x)).abs().max() > 1e-4  # the two GELUs differ here
        for fused in (True, False):
            mlp.fused = fused
            torch.testing.assert_close(mlp(x), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="approximate must be 'none' .* or 'tanh'.*; got 'erf'"):
        Mlp(16, 48, approximate="erf")
    with pytest.raises(ValueError, match="as F.gelu names them; got 'quick'"):  # its unfused path is nn.GELU
        Mlp(16, 48, approximate="quick")


@pytest.mark.parametrize("act, approximate", [("nn.GELU", "tanh"), ("gelu_tanh", "tanh"), ("quick_gelu", "quick")])
def test_fused_mlp_module_takes_an_approximate_gelu_mlp(triton_device, act, approximate):
    """A timm Mlp with a tanh GELU (nn.GELU(approximate="tanh"), or timm's own act_layer="gelu_tanh") loads into
    FusedMLP(approximate="tanh"), one with timm's QuickGELU into FusedMLP(approximate="quick"), and computes its
    function, forward and backward."""
    import functools

    timm_layers = pytest.importorskip("timm.layers")
    act_layer = (functools.partial(torch.nn.GELU, approximate="tanh") if act == "nn.GELU"
                 else timm_layers.get_act_layer(act))
    from dres.nn import FusedMLP

    torch.manual_seed(5)
    plain = perturb_(timm_layers.Mlp(16, 48, 8, act_layer=act_layer)).to(triton_device)
    fused = FusedMLP(16, 48, 8, backend="triton", approximate=approximate).to(triton_device)
    fused.load_state_dict(plain.state_dict())
    assert f"approximate='{approximate}'" in repr(fused)
    x = torch.randn(3, 7, 16, device=triton_device)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-5)
    assert_grads_close(param_grads(fused, lambda: fused(x).square().sum()),
                       param_grads(plain, lambda: plain(x).square().sum()), rtol=1e-3, atol=1e-5)
    with pytest.raises(ValueError, match="approximate must be .*; got 'erf'"):
        FusedMLP(16, 48, approximate="erf")


def test_timm_tanh_gelu_survives_conversion_and_export():
    """convert_timm_vit keeps a timm ViT's tanh GELU (its MLPs run as timm built them), and a dres ViT
    whose MLPs use the tanh GELU exports to a timm model created with it (act_layer="gelu_tanh")."""
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer

    import dres
    from dres.convert import export_timm_state_dict, timm_vit_kwargs

    torch.manual_seed(6)
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    tanh_vit = perturb_(VisionTransformer(**args, act_layer="gelu_tanh")).double().eval()
    erf_vit = VisionTransformer(**args).double().eval()
    erf_vit.load_state_dict(tanh_vit.state_dict())
    want = tanh_vit(imgs)
    assert (erf_vit(imgs) - want).abs().max() > 1e-6  # the two GELUs differ on these weights
    dres.convert_timm_vit(tanh_vit, backend="torch")
    torch.testing.assert_close(tanh_vit(imgs), want, rtol=1e-9, atol=1e-9)

    model = perturb_(tiny_classifier()).double().eval()
    for blk in model.encoder.transformer.blocks:
        blk.mlp.act = torch.nn.GELU(approximate="tanh")
    kwargs = timm_vit_kwargs(model)
    assert kwargs["act_layer"] == "gelu_tanh"
    exported = VisionTransformer(**kwargs).double().eval()
    exported.load_state_dict(export_timm_state_dict(model), strict=True)
    imgs = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(exported(imgs), model(imgs), rtol=1e-12, atol=1e-12)
    assert "act_layer" not in timm_vit_kwargs(perturb_(tiny_classifier()))  # timm's default: erf


def test_stack_keeps_fp32_stream_under_autocast():
    stack = TransformerStack(16, 2, 2, alphas=decay_schedule(4, 0.7), backend="torch")
    x = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, outs = stack.forward_intermediates(x, (0,))
    assert outs[0].dtype == torch.float32 and y.dtype == torch.bfloat16
    assert stack.alphas.dtype == torch.float32 and "alphas" not in stack.state_dict()


def test_zero_init_branch_ends():
    stack = TransformerStack(16, 2, 2)
    stack.zero_init_branch_ends()
    for blk in stack.blocks:
        assert not blk.attn.proj.weight.any() and not blk.mlp.fc2.weight.any()
        assert blk.attn.qkv.weight.any() and blk.mlp.fc1.weight.any()


# ---------------------------------------------------------------------------------------------
# ResidualDroppath


def branch_grads(stack):
    """Record d(loss)/d(branch output) of every residual, in residual order."""
    grads = {}

    def tap(r):
        def hook(mod, inp, out):
            out.register_hook(lambda g: grads.__setitem__(r, g.clone()))  # returns None: output unchanged
        return hook

    handles = []
    for k, blk in enumerate(stack.blocks):
        handles.append(blk.attn.register_forward_hook(tap(2 * k)))
        handles.append(blk.mlp.register_forward_hook(tap(2 * k + 1)))
    return grads, handles


def zero_rows(g):
    """Which samples got an all-zero gradient."""
    return g.flatten(1).abs().amax(dim=1) == 0


def test_residual_droppath_two_steps_gradient_semantics():
    torch.manual_seed(3)
    B = 16
    stack = perturb_(TransformerStack(16, 2, 2, backend="torch"))
    dp = ResidualDroppath(0.5, stack.num_residuals, depth_linear=False, seed=7)
    grads, handles = branch_grads(stack)
    x = torch.randn(B, 3, 16)

    # even iteration: out = x + m * f(x); the branch gets gradient m * g
    y = stack(x, scales=dp.scales(B, x.device))
    masks = dp.masks.clone()
    assert masks.shape == (4, B) and 0 < masks.mean() < 1
    y_ref, _ = plain_stack(stack, x, masks=list(masks))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    for r in range(4):
        assert torch.equal(zero_rows(grads[r]), masks[r] == 0), f"residual {r}, even step"

    # odd iteration, same slots: value of the plain residual, gradient only where the branch was dropped
    dp.next_iteration()
    stack.zero_grad()
    x2 = torch.randn(B, 3, 16)
    y2 = stack(x2, scales=dp.scales(B, x2.device))
    assert torch.equal(dp.masks, masks)
    torch.testing.assert_close(y2, plain_stack(stack, x2)[0], rtol=1e-5, atol=1e-5)
    y2.square().sum().backward()
    for r in range(4):
        assert torch.equal(zero_rows(grads[r]), masks[r] == 1), f"residual {r}, odd step"

    # the next even iteration draws fresh masks
    dp.next_iteration()
    dp.scales(B, x.device)
    assert dp.iteration == 2 and not torch.equal(dp.masks, masks)
    for h in handles:
        h.remove()


def test_residual_droppath_scales_table():
    dp = ResidualDroppath(0.3, 4, depth_linear=False)
    even = dp.scales(8, "cpu")
    m = dp.masks
    for r, (row, grad) in enumerate(even):
        assert torch.equal(row, m[r]) and torch.equal(grad, m[r])
    assert dp.scales(8, "cpu") is even  # micro-batches of one iteration share masks
    dp.next_iteration()
    for r, (row, grad) in enumerate(dp.scales(8, "cpu")):
        assert torch.equal(row, torch.ones(8)) and torch.equal(grad, 1 - m[r])  # row 1: the plain value

    timm = ResidualDroppath(0.25, 4, mode="drop_path", depth_linear=False)
    first = [row.clone() for row, _ in timm.scales(4096, "cpu")]
    for row, grad in timm.scales(4096, "cpu"):
        assert row is grad and torch.isin(row, torch.tensor([0.0, 1 / 0.75])).all()
        assert abs(row.mean().item() - 1) < 0.06
    timm.next_iteration()
    assert not torch.equal(timm.scales(4096, "cpu")[0][0], first[0])  # fresh each iteration


def test_residual_droppath_depth_linear_rates():
    rates = depth_linear_rates(0.1, 24)  # timm: linspace(0, 0.1, 12 blocks), both residuals of a block alike
    assert rates[0::2] == rates[1::2]
    assert rates[0::2] == pytest.approx(torch.linspace(0, 0.1, 12, dtype=torch.float64).tolist())
    dp = ResidualDroppath(0.1, 24)
    assert dp.rates == rates
    scales = dp.scales(4, "cpu")
    assert scales[0] == (None, None) and scales[1] == (None, None)  # rate 0: no scaling at all


def test_residual_droppath_eval_and_zero_rate_ignore_masks():
    dp = ResidualDroppath(0.5, 4, depth_linear=False)
    dp.scales(8, "cpu")
    drawn = dp.masks.clone()
    dp.eval()
    assert dp.scales(8, "cpu") == [(None, None)] * 4
    assert dp.scales(3, "cpu") == [(None, None)] * 4  # any batch size in eval
    assert torch.equal(dp.masks, drawn) and dp.iteration == 0 and dp.slots == 8
    assert ResidualDroppath(0.0, 4).scales(8, "cpu") == [(None, None)] * 4


def test_residual_droppath_batch_size_mismatch_raises():
    dp = ResidualDroppath(0.5, 4)
    dp.scales(8, "cpu")
    with pytest.raises(ValueError, match="batch size 6 differs from the 8 sample slots"):
        dp.scales(6, "cpu")  # a second micro-batch of another size in the even iteration
    dp.next_iteration()
    with pytest.raises(ValueError, match="batch size 5 differs from the 8 sample slots"):
        dp.scales(5, "cpu")  # odd iteration, last partial batch
    with pytest.raises(ValueError, match="sample slots"):
        ResidualDroppath(0.5, 4).scales(2 ** 20 + 1, "cpu")


def test_residual_droppath_state_dict_resume():
    a = ResidualDroppath(0.5, 6, depth_linear=False, seed=11)
    a.scales(8, "cpu")
    a.next_iteration()  # odd: the masks of iteration 0 are still needed
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = ResidualDroppath(0.5, 6, depth_linear=False, seed=999)
    b.load_state_dict(torch.load(buf, weights_only=True))  # plain ints and strings: safe to load
    assert b.iteration == 1 and b.odd and b.seed == 11
    for (ra, ga), (rb, gb) in zip(a.scales(8, "cpu"), b.scales(8, "cpu")):
        assert torch.equal(ra, rb) and torch.equal(ga, gb)
    for _ in range(3):  # the alternation and the mask sequence continue identically
        a.next_iteration()
        b.next_iteration()
        a.scales(8, "cpu")
        b.scales(8, "cpu")
        assert torch.equal(a.masks, b.masks) and a.odd == b.odd
    with pytest.raises(ValueError, match="mode"):
        ResidualDroppath(0.5, 6, mode="drop_path").load_state_dict(a.state_dict())


def run_masks(dp, iterations, batch=16):
    out = []
    for _ in range(iterations):
        dp.scales(batch, "cpu")
        out.append(dp.masks)
        dp.next_iteration()
    return torch.stack(out)


def test_residual_droppath_masks_per_rank_deterministic_and_resumable():
    """Ranks draw different masks, each a function of (seed, rank); a checkpoint (written by any rank)
    resumes every rank on its own stream exactly."""
    def make(seed, rank):
        return ResidualDroppath(0.5, 6, depth_linear=False, seed=seed, rank=rank)

    rank0, rank1 = run_masks(make(3, 0), 6), run_masks(make(3, 1), 6)
    assert torch.equal(run_masks(make(3, 1), 6), rank1)  # deterministic from (seed, rank)
    assert not torch.equal(rank0, rank1) and not torch.equal(run_masks(make(4, 0), 6), rank0)
    agree = (rank0[0::2] == rank1[0::2]).float().mean().item()
    assert 0.35 < agree < 0.65  # independent Bernoulli(0.5) draws agree half the time
    assert torch.equal(run_masks(ResidualDroppath(0.5, 6, depth_linear=False, seed=3), 6), rank0)  # no process group

    writer = make(3, 0)
    run_masks(writer, 3)  # stops after 3 steps: odd iteration 3 next, which reuses draw 1
    resumed = make(0, 1)
    resumed.load_state_dict(writer.state_dict())
    assert torch.equal(run_masks(resumed, 3), rank1[3:])


def lowbias32(x):
    """The hash in plain Python integers (the reference for the tensor version)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mask_bits_match_python_reference_and_statistics():
    from dres.nn.droppath import mask_bits, stream_key

    key = stream_key(5, 2)
    assert key != stream_key(5, 3) and key != stream_key(6, 2) and key == stream_key(5, 2)
    draw = torch.tensor(2 ** 33 + 7)  # draws past 2**32 wrap, as the reference's masking does
    bits = mask_bits(key, draw, 3, 5)
    draw_word = lowbias32((draw.item() & 0xFFFFFFFF) ^ key[0])
    want = [[lowbias32(lowbias32((((r << 20) | b) + draw_word) & 0xFFFFFFFF) ^ key[1]) >> 8 for b in range(5)]
            for r in range(3)]
    assert bits.tolist() == want

    dp = ResidualDroppath(0.3, 8, depth_linear=False, seed=1)
    masks = run_masks(dp, 40, batch=512)[0::2]  # 20 independent draws of (8, 512)
    keep = dp.keep_threshold[0].item() / 2 ** 24
    assert keep == pytest.approx(0.7, abs=2 ** -24)
    n = masks.numel()
    assert abs(masks.mean().item() - keep) < 4 * (keep * (1 - keep) / n) ** 0.5  # 4 sigma
    flat = masks.permute(1, 0, 2).reshape(8, -1)  # per residual
    corr = torch.corrcoef(flat)
    assert (corr - torch.eye(8)).abs().max() < 0.05  # residuals draw independently
    lag = torch.corrcoef(torch.stack([masks[:-1].flatten(), masks[1:].flatten()]))[0, 1]
    assert abs(lag) < 0.05  # and so do consecutive draws


def test_residual_droppath_follows_the_model_and_keeps_masks_under_double():
    dp = ResidualDroppath(0.4, 4, depth_linear=False, seed=2)
    want = run_masks(dp, 2)
    moved = ResidualDroppath(0.4, 4, depth_linear=False, seed=2).double()
    assert torch.equal(run_masks(moved, 2), want) and moved.keep_threshold.dtype == torch.int64


@pytest.mark.gpu
def test_residual_droppath_cuda_graph_replay_matches_cpu():
    """On CUDA the scales and next_iteration() run without a host sync and can be captured in a CUDA
    graph: each replay advances the counter and gives the masks the CPU controller gives, bit for bit."""
    B = 64
    for mode in ("residual_droppath", "drop_path"):
        cpu = ResidualDroppath(0.3, 6, mode=mode, seed=9)
        gpu = ResidualDroppath(0.3, 6, mode=mode, seed=9).cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu.scales(B, "cuda")  # eager: no host sync
            gpu.next_iteration()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cpu.scales(B, "cpu")
        cpu.next_iteration()
        rows = torch.zeros(6, B, device="cuda")
        grads = torch.zeros(6, B, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scales = gpu.scales(B, "cuda")
            rows.copy_(torch.stack([torch.ones(B, device="cuda") if r is None else r for r, _ in scales]))
            grads.copy_(torch.stack([torch.ones(B, device="cuda") if g is None else g for _, g in scales]))
            gpu.next_iteration()
        assert gpu.iteration == 1  # capture records, it does not run
        for _ in range(5):
            graph.replay()
            want = cpu.scales(B, "cpu")
            want_rows = torch.stack([torch.ones(B) if r is None else r for r, _ in want])
            want_grads = torch.stack([torch.ones(B) if g is None else g for _, g in want])
            assert torch.equal(rows.cpu(), want_rows) and torch.equal(grads.cpu(), want_grads)
            cpu.next_iteration()
        assert gpu.iteration == cpu.iteration == 6


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,head_dim", [(17, 64), (50, 64), (197, 32), (257, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_backend_choice_matches_the_math_backend(tokens, head_dim, dtype):
    """Whichever kernel ``sdpa`` picks for a shape, forward and backward agree with attention in float64."""
    from dres.nn.transformer import sdpa

    torch.manual_seed(5)
    q, k, v = (torch.randn(4, 3, tokens, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = sdpa(q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = torch.softmax(q64 @ k64.transpose(-1, -2) / head_dim ** 0.5, dim=-1) @ v64
    want_grads = torch.autograd.grad(want, (q64, k64, v64), g.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, ref in zip((out,) + grads, (want,) + want_grads):
        assert (got.double() - ref).norm() / ref.norm() < tol


def test_attention_takes_short_attention_where_the_rule_says():
    from dres.kernels.short_attention import HEAD_DIMS
    from dres.nn.transformer import SHORT_ATTENTION_HEAD_DIMS, takes_short_attention

    assert SHORT_ATTENTION_HEAD_DIMS == HEAD_DIMS  # the models' copy of the kernel's head dims
    qkv = torch.zeros(2, 17, 3 * 64)
    assert takes_short_attention(qkv, 17, 32, "triton")  # forced: every device and dtype
    assert not takes_short_attention(qkv, 17, 32, None)  # a CPU tensor by default: SDPA
    assert not takes_short_attention(qkv, 17, 32, "torch")  # plain PyTorch code: SDPA everywhere
    assert takes_short_attention(qkv, 197, 32, "triton")  # heads up to 32 wide: up to 256 tokens
    assert not takes_short_attention(qkv, 257, 32, "triton")  # the kernel's limit
    assert not takes_short_attention(qkv, 129, 64, "triton")  # wider heads: not measured faster above 128
    assert not takes_short_attention(qkv, 17, 48, "triton")  # a head width the kernel has no tile for


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_attention_module_matches_sdpa_on_either_path(triton_device, backend):
    """The Attention module through short_attention (Triton; the interpreter on the CPU) or SDPA computes
    the same attention, forward and backward, as the heads written out in float64."""
    from dres.nn.transformer import Attention

    torch.manual_seed(3)
    attn = Attention(48, 3, backend=backend).to(triton_device)
    x = torch.randn(4, 9, 48, device=triton_device, requires_grad=True)
    out = attn(x)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, attn.qkv.weight), g)
    ref = Attention(48, 3, backend="torch").double().to(triton_device)
    ref.load_state_dict(attn.state_dict())
    x64 = x.detach().double().requires_grad_(True)
    q, k, v = ref.qkv(x64).reshape(4, 9, 3, 3, 16).permute(2, 0, 3, 1, 4).unbind(0)
    want = ref.proj((torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v).transpose(1, 2).reshape(4, 9, 48))
    want_grads = torch.autograd.grad(want, (x64, ref.qkv.weight), g.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_a_launch_bound_attention_takes_sdpa_where_its_launches_cost_the_host(monkeypatch):
    """Under torch.compile, and in eager mode without the csrc extension, outside replayed_launches() (a captured
    step), the Attention modules leave a launch-bound model's short sequences to SDPA
    (dres.ops.checks.takes_pytorch_formula on the residual stream, a third of qkv's width); a larger model, a backend
    named, a captured step and an eager call with the extension keep the kernel (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dres.nn.transformer import takes_short_attention
    from dres.ops import csrc_backend
    from dres.ops.checks import LAUNCH_BOUND_WORK, replayed_launches

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with FakeTensorMode():
        clip = torch.empty(128, 50, 3 * 768, device="cuda", dtype=torch.bfloat16)  # CLIP ViT-B/32, batch 128: 3.8e9
        mae = torch.empty(256, 50, 3 * 768, device="cuda", dtype=torch.bfloat16)  # ViTMAE-B's encoder, 256: 7.5e9
        assert 128 * 50 * 768 ** 2 < LAUNCH_BOUND_WORK < 256 * 50 * 768 ** 2
        for built in (False, True):  # eager
            monkeypatch.setattr(csrc_backend, "available", lambda built=built: built)
            assert takes_short_attention(clip, 50, 64, None) == built
            assert takes_short_attention(mae, 50, 64, None)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not takes_short_attention(clip, 50, 64, None)
        assert takes_short_attention(mae, 50, 64, None)
        assert takes_short_attention(clip, 50, 64, "triton")
        with replayed_launches():
            assert takes_short_attention(clip, 50, 64, None)


@pytest.mark.gpu
def test_gpu_compiled_attention_of_a_launch_bound_model_traces_sdpa_outside_a_captured_step():
    """Traced by torch.compile under bf16 autocast, a small Attention module's graph holds no dres short-attention
    op (SDPA instead), and inside replayed_launches() it holds the opaque op."""
    import contextlib

    from dres.nn.transformer import Attention
    from dres.ops.checks import replayed_launches
    from helpers import recording_backend

    attention = Attention(384, 6).cuda()
    x = torch.randn(64, 17, 384, device="cuda", requires_grad=True)
    for replayed in (False, True):
        forward_targets, backward_targets = set(), set()
        torch._dynamo.reset()
        compiled = torch.compile(attention, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
        with torch.autocast("cuda", dtype=torch.bfloat16), replayed_launches() if replayed else contextlib.nullcontext():
            compiled(x).float().sum().backward()
        assert (torch.ops.dres.short_attention.default in forward_targets) == replayed, replayed


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,head_dim", [(17, 64), (65, 32), (50, 64)])
def test_compiled_attention_on_short_attention_matches_sdpa(tokens, head_dim):
    """Under bf16 autocast on CUDA the Attention module takes short_attention by default; compiled (inside
    replayed_launches(), as a captured step traces it: outside, at these sizes, it takes SDPA) and eager, it agrees
    with the SDPA path (backend="torch") within bf16 rounding, forward and backward."""
    from dres.nn.transformer import Attention
    from dres.ops.checks import replayed_launches

    torch.manual_seed(4)
    heads = 384 // head_dim
    fast = Attention(384, heads).cuda()
    sdpa_path = Attention(384, heads, backend="torch").cuda()
    sdpa_path.load_state_dict(fast.state_dict())
    x = torch.randn(64, tokens, 384, device="cuda")
    g = torch.randn(64, tokens, 384, device="cuda")
    results = []
    compiled = torch.compile(fast)
    for module in (sdpa_path, fast, compiled):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16), replayed_launches():
            out = module(xi)
        results.append((out.float(), *torch.autograd.grad(out, (xi, fast.qkv.weight if module is not sdpa_path
                                                                   else sdpa_path.qkv.weight), g)))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_sdpa_from_qkv_is_the_attention_of_the_qkv_layout():
    """The models' SDPA path (permute out of the qkv output, transpose back) against short attention's
    float64 reference on the same layout, forward and backward."""
    from dres.nn.transformer import sdpa_from_qkv
    from dres.ops import short_attention

    torch.manual_seed(3)
    qkv = torch.randn(3, 11, 3 * 2 * 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 11, 16, dtype=torch.float64)
    out = sdpa_from_qkv(qkv, 2)
    ref = short_attention(qkv, 2, backend="torch")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, g)[0], torch.autograd.grad(ref, qkv, g)[0])
