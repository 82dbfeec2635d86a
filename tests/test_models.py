"""dres.models against plain unfused implementations written here, plus structure checks.

Every model with alpha_min = 1 and no drop path computes the same function as the plain PyTorch
version of its architecture (the official MAE code's and U-ViT's forward passes, written out with
F.layer_norm and explicit residual adds): in float64 through the reference backend (tolerance 1e-9,
forward and every parameter gradient) and in float32 through the Triton kernels (interpreter on CPU,
tiny configs; tolerance 1e-4 forward, 1e-3 relative on gradients).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dres.models import MAE, UVIT_CONFIGS, UViT, create_mae, create_uvit
from dres.nn import PatchEmbed, decay_schedule, set_backend
from helpers import fp32_on_cuda
from test_nn import assert_grads_close, param_grads, perturb_, plain_attention, plain_ln, plain_mlp, plain_stack
from tiny_models import tiny_classifier, tiny_mae, tiny_uvit

F64 = dict(rtol=1e-9, atol=1e-9)
F32 = dict(rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Plain MAE (facebookresearch/mae and xiao7199/decayed_Identity_shortcuts, written out)


def plain_patch_embed(patch_embed, imgs):
    p = patch_embed.patch_size
    return F.conv2d(imgs, patch_embed.proj.weight, patch_embed.proj.bias, stride=p).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("keep", [False, True])
def test_patch_embed_is_the_strided_convolution(keep):
    """The patch embedding's matmul over flattened patches is timm's stride-p convolution, also for a
    subset of the patches (MAE embeds only the visible ones)."""
    torch.manual_seed(3)
    pe = PatchEmbed(12, 4, 3, 8).double()
    imgs = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    ids = torch.stack([torch.randperm(9)[:4] for _ in range(2)]) if keep else None
    want = plain_patch_embed(pe, imgs)
    if keep:
        want = torch.gather(want, 1, ids.unsqueeze(-1).expand(-1, -1, 8))
    torch.testing.assert_close(pe(imgs, ids), want, **F64)


def plain_unshuffle(x, mask_token, ids_restore):
    B, _, C = x.shape
    mask_tokens = mask_token.repeat(B, ids_restore.shape[1] + 1 - x.shape[1], 1)
    x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
    x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, C))
    return torch.cat([x[:, :1, :], x_], dim=1)


def plain_mae(model, imgs, noise, mask_ratio=0.75):
    enc = model.encoder
    x = plain_patch_embed(enc.patch_embed, imgs) + enc.pos_embed[:, 1:, :]
    N, L, D = x.shape
    len_keep = int(L * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    x = torch.gather(x, dim=1, index=ids_shuffle[:, :len_keep].unsqueeze(-1).repeat(1, 1, D))
    mask = torch.ones([N, L], dtype=imgs.dtype, device=imgs.device)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, dim=1, index=ids_restore)
    x = torch.cat([(enc.cls_token + enc.pos_embed[:, :1, :]).expand(N, -1, -1), x], dim=1)
    latent, skips = plain_stack(enc.transformer, x, collect=model.skip_blocks)

    skip_list = [skips[b] for b in sorted(skips)]  # shallowest first; the decoder pops the deepest
    if model.variant == "official":
        x = F.linear(torch.cat([model.decoder_cls_token, model.decoder_pos_embed[:, 1:]], dim=1),
                     model.decoder_embed.weight, model.decoder_embed.bias).expand(N, -1, -1)
    else:
        x = F.linear(latent, model.decoder_embed.weight, model.decoder_embed.bias)
        x = plain_unshuffle(x, model.mask_token, ids_restore) + model.decoder_pos_embed
    hooks = {}
    for k in range(len(skip_list)):
        layer = model.skips[k]
        if model.variant == "official":
            def hook(s, _, layer=layer, skip=skip_list[-1 - k]):
                full = plain_unshuffle(skip, layer.mask_token, ids_restore)
                h = F.linear(torch.cat([full, s], dim=-1), layer.fc[0].weight, layer.fc[0].bias)
                return s + F.linear(F.silu(h), layer.fc[2].weight, layer.fc[2].bias)
        else:
            def hook(s, _, layer=layer, skip=skip_list[-1 - k]):
                full = plain_unshuffle(skip, layer.mask_token, ids_restore)
                return F.linear(torch.cat([s, full], dim=-1), layer.linear.weight, layer.linear.bias)
        hooks[k] = hook
    y, _ = plain_stack(model.decoder, x, hooks=hooks)
    pred = F.linear(y, model.decoder_pred.weight, model.decoder_pred.bias)[:, 1:, :]

    p, c = model.patch_size, model.in_chans
    h = w = imgs.shape[2] // p
    target = torch.einsum("nchpwq->nhwpqc", imgs.reshape(N, c, h, p, w, p)).reshape(N, h * w, p * p * c)
    mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
    target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(dim=-1)
    return (loss * mask).sum() / mask.sum(), pred, mask


@pytest.mark.parametrize("variant", ["baseline", "official", "paper"])
def test_mae_matches_plain_float64(variant):
    torch.manual_seed(0)
    # depth 4: skips from encoder blocks 3, 1 into decoder blocks 0, 1 (of 3)
    model = perturb_(MAE(variant, img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2,
                         decoder_embed_dim=24, decoder_depth=3, decoder_num_heads=2, backend="torch")).double()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    noise = torch.rand(2, 16, dtype=torch.float64)
    loss, pred, mask = model(imgs, noise=noise)
    loss_ref, pred_ref, mask_ref = plain_mae(model, imgs, noise)
    assert torch.equal(mask, mask_ref) and mask.sum() == 2 * 12
    torch.testing.assert_close(pred, pred_ref, **F64)
    torch.testing.assert_close(loss, loss_ref, **F64)
    got = param_grads(model, lambda: model(imgs, noise=noise)[0])
    want = param_grads(model, lambda: plain_mae(model, imgs, noise)[0])
    assert_grads_close(got, want, **F64)
    assert len(got) == len([p for p in model.parameters() if p.requires_grad])  # every parameter is used


@pytest.mark.parametrize("variant", ["baseline", "official", "paper"])
def test_mae_gradients_have_their_parameters_strides(variant):
    """DDP copies a gradient whose strides differ from its parameter's into its bucket and warns on every
    run ("Grad strides do not match bucket view strides"): every parameter's gradient is laid out like it."""
    model = tiny_mae(variant=variant, alpha_min=0.6, backend="torch")
    model(torch.randn(2, 3, 8, 8))[0].backward()
    odd = {n: (p.grad.stride(), p.stride()) for n, p in model.named_parameters() if p.grad.stride() != p.stride()}
    assert not odd, odd


def test_mae_decayed_matches_plain_float64():
    torch.manual_seed(1)
    model = perturb_(tiny_mae(variant="official", alpha_min=0.6, backend="torch")).double()
    assert model.encoder.transformer.alphas.tolist() == pytest.approx(decay_schedule(4, 0.6))
    assert model.decoder.alphas.tolist() == [1.0] * 4  # decay in the encoder only
    imgs, noise = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.rand(2, 4, dtype=torch.float64)
    torch.testing.assert_close(model(imgs, noise=noise)[1], plain_mae(model, imgs, noise)[1], **F64)


@pytest.mark.parametrize("variant", ["baseline", "official"])
def test_mae_triton_interpreter_matches_plain(variant, triton_device):
    torch.manual_seed(2)
    model = perturb_(tiny_mae(variant=variant, backend="triton")).to(triton_device)
    imgs = torch.randn(2, 3, 8, 8, device=triton_device)
    noise = torch.rand(2, 4, device=triton_device)
    with fp32_on_cuda():  # the reference's conv2d would take TF32 on a GPU
        loss, pred, _ = model(imgs, noise=noise)
        loss_ref, pred_ref, _ = plain_mae(model, imgs, noise)
        torch.testing.assert_close(pred, pred_ref, rtol=1e-4, atol=1e-4)
        got = param_grads(model, lambda: model(imgs, noise=noise)[0])
        want = param_grads(model, lambda: plain_mae(model, imgs, noise)[0])
    assert_grads_close(got, want, **F32)


def test_official_mae_structure():
    # ViT-B/16's depth (12) and decoder depth (8), narrow widths to stay fast on CPU
    model = create_mae("mae_vit_base_patch16", variant="official", alpha_min=0.6, img_size=32, embed_dim=64,
                       num_heads=4, decoder_embed_dim=32, decoder_num_heads=4)
    assert model.skip_blocks == [11, 9, 7, 5, 3, 1]  # decoder block k takes skip_blocks[k]: deepest first
    assert len(model.skips) == 6 and len(model.decoder.blocks) == 8
    assert model.encoder.transformer.norm is None and not hasattr(model, "mask_token")
    for skip in model.skips:
        assert skip.fc[0].in_features == 64 + 32 and skip.fc[0].out_features == 32
        assert isinstance(skip.fc[1], torch.nn.SiLU) and skip.mask_token.shape == (1, 1, 64)
        assert not skip.fc[2].weight.any() and not skip.fc[2].bias.any()  # zero-initialised skip outputs
        assert skip.fc[0].weight.any()
    for stack in (model.encoder.transformer, model.decoder):
        for blk in stack.blocks:
            assert not blk.attn.proj.weight.any() and not blk.mlp.fc2.weight.any()  # zero-initialised branch ends
    assert not model.decoder_pred.weight.any()
    assert model.encoder.transformer.alphas[-1].item() == pytest.approx(0.6)

    # the skip entering decoder block k is the output of encoder block skip_blocks[k]
    perturb_(model)
    seen = {}
    for k, skip in enumerate(model.skips):
        skip.register_forward_pre_hook(lambda mod, args, k=k: seen.__setitem__(k, args[1]))
    imgs, noise = torch.randn(2, 3, 32, 32), torch.rand(2, 4)
    latent, _, _, skips = model.forward_encoder(imgs, 0.75, noise)
    model(imgs, noise=noise)
    for k, block in enumerate(model.skip_blocks):
        torch.testing.assert_close(seen[k], skips[block])
    torch.testing.assert_close(skips[11], latent)  # no final norm: the last skip is the encoder output


def test_mae_configs_and_features():
    large = create_mae("mae_vit_large_patch16", variant="official", img_size=32, embed_dim=32, num_heads=2,
                       decoder_embed_dim=16, decoder_num_heads=2)
    assert large.skip_blocks == [23, 21, 19, 17, 15, 13, 11, 9]  # 12 skips, 8 decoder blocks: the deepest 8
    model = perturb_(tiny_mae(backend="torch")).eval()
    imgs = torch.randn(3, 3, 8, 8)
    f0, flast = model.forward_features(imgs, layer=0), model.forward_features(imgs, layer=-1)
    assert f0["cls"].shape == (3, 32) and f0["mean"].shape == (3, 32)
    enc = model.encoder
    x = torch.cat([(enc.cls_token + enc.pos_embed[:, :1]).expand(3, -1, -1),
                   plain_patch_embed(enc.patch_embed, imgs) + enc.pos_embed[:, 1:]], dim=1)
    y, outs = plain_stack(enc.transformer, x, collect=(0,))
    torch.testing.assert_close(f0["cls"], outs[0][:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f0["mean"], outs[0][:, 1:].mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flast["cls"], y[:, 0], rtol=1e-5, atol=1e-5)  # the final-normed output
    p = model.patchify(imgs)
    assert p.shape == (3, 4, 48) and torch.equal(model.unpatchify(p), imgs)


# ---------------------------------------------------------------------------------------------
# Plain U-ViT (baofff/U-ViT libs/uvit.py, written out)


def plain_uvit(model, x, t, y=None):
    pe = model.patch_embed
    patches = plain_patch_embed(pe, x)
    half = model.embed_dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]  # float32, as U-ViT's timestep_embedding
    time_token = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).unsqueeze(1).to(patches.dtype)
    h = torch.cat([time_token, patches], dim=1)
    if y is not None:
        h = torch.cat([model.label_emb.weight[y].unsqueeze(1), h], dim=1)
    h = h + model.pos_embed
    n_in = model.num_in_blocks
    blocks = model.transformer.blocks
    alphas = model.transformer.alphas.tolist()
    skips = []
    for k, blk in enumerate(blocks):
        if k > n_in:
            lin = model.skip_linears[k - n_in - 1]
            h = F.linear(torch.cat([h, skips.pop()], dim=-1), lin.weight, lin.bias)
        h = alphas[2 * k] * h + plain_attention(blk.attn, plain_ln(blk.norm1, h))
        h = alphas[2 * k + 1] * h + plain_mlp(blk.mlp, plain_ln(blk.norm2, h))
        if k < n_in:
            skips.append(h)
    h = plain_ln(model.transformer.norm, h)
    h = F.linear(h, model.decoder_pred.weight, model.decoder_pred.bias)[:, model.extras:, :]
    B, N, P = h.shape
    p, C = model.patch_embed.patch_size, model.in_chans
    g = int(N ** 0.5)
    img = h.reshape(B, g, g, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, g * p, g * p)  # B C (h p1) (w p2)
    return F.conv2d(img, model.final_layer.weight, model.final_layer.bias, padding=1)


@pytest.mark.parametrize("num_classes", [0, 5])
def test_uvit_matches_plain_float64(num_classes):
    torch.manual_seed(3)
    model = perturb_(UViT(img_size=8, patch_size=2, embed_dim=32, depth=4, num_heads=2, num_classes=num_classes,
                          backend="torch")).double()
    x, t = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64) * 999
    y = torch.tensor([1, 4]) if num_classes else None
    out = model(x, t, y)
    assert out.shape == x.shape
    torch.testing.assert_close(out, plain_uvit(model, x, t, y), **F64)
    w = torch.randn_like(out)
    got = param_grads(model, lambda: (model(x, t, y) * w).sum())
    want = param_grads(model, lambda: (plain_uvit(model, x, t, y) * w).sum())
    assert_grads_close(got, want, **F64)
    assert len(got) == len(list(model.parameters()))


def test_uvit_decayed_and_triton_interpreter_match_plain(triton_device):
    torch.manual_seed(4)
    model = perturb_(tiny_uvit(alpha_min=0.7, backend="torch")).double()
    assert model.transformer.alphas.tolist() == pytest.approx(decay_schedule(6, 0.7))  # through the whole net
    x, t = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
    torch.testing.assert_close(model(x, t), plain_uvit(model, x, t), **F64)

    model = set_backend(perturb_(tiny_uvit()).to(triton_device), "triton")
    x, t = torch.randn(2, 3, 8, 8, device=triton_device), torch.rand(2, device=triton_device) * 999
    with fp32_on_cuda():
        torch.testing.assert_close(model(x, t), plain_uvit(model, x, t), rtol=1e-4, atol=1e-4)
        got = param_grads(model, lambda: model(x, t).square().sum())
        want = param_grads(model, lambda: plain_uvit(model, x, t).square().sum())
    assert_grads_close(got, want, **F32)


def test_uvit_skips_and_token_layout():
    model = create_uvit("uvit_small_2", alpha_min=0.7, embed_dim=64, num_heads=4)  # U-ViT-S/2's depth, narrower
    assert UVIT_CONFIGS["uvit_small_2"]["embed_dim"] == 512 and UVIT_CONFIGS["uvit_small_2"]["num_heads"] == 8
    assert model.num_in_blocks == 6 and model.num_blocks == 13 and len(model.skip_linears) == 6
    assert [model.skip_source(k) for k in range(13)] == [None] * 7 + [5, 4, 3, 2, 1, 0]
    assert all(l.in_features == 128 and l.out_features == 64 for l in model.skip_linears)
    assert len(model.transformer.alphas) == 26 and model.transformer.alphas[-1].item() == pytest.approx(0.7)

    cond = perturb_(tiny_uvit(num_classes=10))
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([3.0, 500.0]), torch.tensor([7, 2])
    tokens = cond.tokens(x, t, y) - cond.pos_embed
    assert cond.extras == 2 and tokens.shape == (2, 2 + 16, 32)
    torch.testing.assert_close(tokens[:, 0], cond.label_emb(y))  # [label, time, patches]
    half = torch.arange(16) / 16
    args = t[:, None] * torch.exp(-math.log(10000) * half)[None]
    torch.testing.assert_close(tokens[:, 1], torch.cat([args.cos(), args.sin()], dim=-1))
    torch.testing.assert_close(tokens[:, 2:], plain_patch_embed(cond.patch_embed, x))
    assert tiny_uvit().extras == 1
    with pytest.raises(ValueError, match="class-conditional"):
        cond(x, t)

    assert cond.features(x, t, block=2, y=y).shape == (2, 32)


def test_uvit_features_are_the_block_stream():
    torch.manual_seed(5)
    model = perturb_(tiny_uvit(backend="torch")).double()
    x, t = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.rand(2, dtype=torch.float64)
    tokens = model.tokens(x, t)
    _, outs = plain_stack(model.transformer, tokens, collect=(0, 1),
                          hooks={2: lambda s, o: F.linear(torch.cat([s, o[0]], -1), model.skip_linears[0].weight,
                                                          model.skip_linears[0].bias)})
    torch.testing.assert_close(model.features(x, t, block=1), outs[1][:, 1:].mean(1), **F64)  # mid block
    torch.testing.assert_close(model.features(x, t, block=0, pool="time"), outs[0][:, 0], **F64)
    one_pass = model.features_at(x, t, [2, 0, -2])  # several blocks from one pass: each block's own features
    torch.testing.assert_close(one_pass, torch.stack([model.features(x, t, block=b) for b in (2, 0, 1)], 1),
                               rtol=0, atol=0)


def test_uvit_autocast_stream_dtypes_follow_the_plain_model():
    """Under bf16 autocast the in-blocks carry a float32 stream and each out-block the skip Linear's bf16
    output, as the authors' code does; the output matches the plain U-ViT under the same autocast."""
    torch.manual_seed(8)
    model = perturb_(tiny_uvit(alpha_min=0.8, backend="torch"))
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2) * 999
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, outs = model.run_blocks(model.tokens(x, t), collect=(0, 1, 2))
        got, want = model(x, t), plain_uvit(model, x, t)
        features = model.features(x, t, block=2)
    assert [outs[k].dtype for k in range(3)] == [torch.float32, torch.float32, torch.bfloat16]
    assert features.dtype == torch.float32  # pooled in float32 from the out-block's bf16 stream
    torch.testing.assert_close(features, outs[2][:, model.extras:].float().mean(1))
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    w = torch.randn_like(got, dtype=torch.float32)

    def loss(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (fn().float() * w).sum()
    got_grads = param_grads(model, lambda: loss(lambda: model(x, t)))
    want_grads = param_grads(model, lambda: loss(lambda: plain_uvit(model, x, t)))
    assert_grads_close(got_grads, want_grads, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------------------------------------
# ViT classifier


def plain_classifier(model, imgs):
    enc = model.encoder
    x = torch.cat([(enc.cls_token + enc.pos_embed[:, :1]).expand(imgs.shape[0], -1, -1),
                   plain_patch_embed(enc.patch_embed, imgs) + enc.pos_embed[:, 1:]], dim=1)
    y, _ = plain_stack(enc.transformer, x)
    return F.linear(y[:, 0], model.head.weight, model.head.bias)


def test_classifier_matches_plain_and_droppath(triton_device):
    torch.manual_seed(6)
    model = perturb_(tiny_classifier(backend="torch")).double()
    imgs = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(model(imgs), plain_classifier(model, imgs), **F64)
    got = param_grads(model, lambda: model(imgs).square().sum())
    want = param_grads(model, lambda: plain_classifier(model, imgs).square().sum())
    assert_grads_close(got, want, **F64)

    tri = set_backend(perturb_(tiny_classifier()).to(triton_device), "triton")
    imgs = torch.randn(2, 3, 8, 8, device=triton_device)
    torch.testing.assert_close(tri(imgs), plain_classifier(tri, imgs), rtol=1e-4, atol=1e-4)

    # drop path: the controller is exposed and used in training only; eval gives the plain function
    rdp = tiny_classifier(drop_path=0.5, droppath_mode="residual_droppath", backend="torch")
    assert rdp.droppath is not None and rdp.droppath.num_residuals == 4 and rdp.droppath.mode == "residual_droppath"
    assert "encoder.droppath._extra_state" in rdp.state_dict()
    imgs = torch.randn(4, 3, 8, 8)
    rdp.train()
    rdp(imgs)
    assert rdp.droppath.slots == 4 and rdp.droppath.iteration == 0  # masks drawn for this batch, counter untouched
    rdp.eval()
    torch.testing.assert_close(rdp(imgs), plain_classifier(rdp, imgs), rtol=1e-5, atol=1e-5)
    assert tiny_classifier().droppath is None


# ---------------------------------------------------------------------------------------------
# The MLPs' GELU


def _mae_pred(model):
    g = torch.Generator().manual_seed(7)
    imgs = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)
    return model(imgs, noise=torch.rand(2, 4, generator=g, dtype=torch.float64))[1]


def _uvit_out(model):
    g = torch.Generator().manual_seed(7)
    return model(torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.rand(2, generator=g) * 999)


@pytest.mark.parametrize("create,run", [(lambda **kw: tiny_mae(variant="official", **kw), _mae_pred),
                                        (lambda **kw: tiny_uvit(**kw), _uvit_out)],
                         ids=["mae", "uvit"])
def test_tanh_gelu_reaches_every_mlp(create, run, monkeypatch):
    """gelu_approximate="tanh" runs every MLP, encoder and decoder, through the fused op's tanh GELU, and
    the model computes what the same model with each MLP's nn.GELU(approximate="tanh") computes on the
    plain path (reference backend, float64); the default stays the exact GELU; a bad value is refused."""
    from dres import ops
    from dres.nn import Mlp, set_fused_mlp

    tanh = perturb_(create(gelu_approximate="tanh", backend="torch")).double()
    plain = create(backend="torch").double()
    plain.load_state_dict(tanh.state_dict())
    erf_out = run(plain)
    mlps = [m for m in plain.modules() if isinstance(m, Mlp)]
    for mlp in mlps:
        assert mlp.act.approximate == "none"
        mlp.act = torch.nn.GELU(approximate="tanh")
    want = run(set_fused_mlp(plain, False))

    fused_mlp, approximations = ops.fused_mlp, []

    def recording_fused_mlp(*args, approximate, **kwargs):
        approximations.append(approximate)
        return fused_mlp(*args, approximate=approximate, **kwargs)

    monkeypatch.setattr(ops, "fused_mlp", recording_fused_mlp)
    got = run(tanh)
    assert approximations == ["tanh"] * len(mlps) and len(mlps) >= 3
    torch.testing.assert_close(got, want, **F64)
    assert (erf_out - want).abs().max() > 1e-6  # the two GELUs differ on these weights
    with pytest.raises(ValueError, match="gelu_approximate must be 'none' .* or 'tanh'.*; got 'erf'"):
        create(gelu_approximate="erf")
