"""dres.convert_timm_vit on a small timm VisionTransformer: alpha_min = 1 keeps the function (forward
and gradients; float64 reference backend to 1e-9, Triton interpreter in float32 to 1e-4), alpha_min < 1
changes it to exactly the decayed one, weights and state_dict keys stay untouched; drop path and
ResidualDroppath behave as in dres's own ViT stack and as in the ResNet converter."""

import copy

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import dres
from dres.convert import ROW_ALIGNMENT, AlignedLinear, FusedTimmBlocks, PatchConv2d
from dres.nn import ResidualDroppath, TransformerStack, decay_schedule
from dres.nn.transformer import block_alpha
from test_nn import assert_grads_close, param_grads, perturb_
from tiny_models import tiny_classifier, tiny_mae


def small_vit(**kw):
    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    return perturb_(VisionTransformer(**{**args, **kw})).eval()


def small_eva(**kw):
    from timm.models.eva import Eva

    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5, init_values=0.1,
                use_rot_pos_emb=True, ref_feat_shape=(2, 2))
    return perturb_(Eva(**{**args, **kw})).eval()


def decayed_reference(model, alphas, imgs):
    """timm's forward with the decayed residuals written out (unfused, block by block)."""
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(imgs))))
    for k, blk in enumerate(model.blocks):
        x = alphas[2 * k] * x + blk.ls1(blk.attn(blk.norm1(x)))
        x = alphas[2 * k + 1] * x + blk.ls2(blk.mlp(blk.norm2(x)))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1}, {"global_pool": "avg", "fc_norm": True}])
def test_convert_alpha1_keeps_function_and_weights(kw):
    model = small_vit(**kw).double()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    before_out = model(imgs)
    before_grads = param_grads(model, lambda: model(imgs).square().sum())
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())

    assert dres.convert_timm_vit(model, alpha_min=1.0, backend="torch") is model
    assert isinstance(model.blocks, FusedTimmBlocks)
    state = model.state_dict()
    assert state.keys() == before_state.keys()
    assert all(torch.equal(state[k], before_state[k]) for k in state)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    torch.testing.assert_close(model(imgs), before_out, rtol=1e-9, atol=1e-9)
    assert_grads_close(param_grads(model, lambda: model(imgs).square().sum()), before_grads, rtol=1e-9, atol=1e-9)


def test_convert_decayed_is_the_decayed_function():
    model = small_vit().double()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    original = model(imgs)
    dres.convert_timm_vit(model, alpha_min=0.6, backend="torch")
    alphas = decay_schedule(6, 0.6)
    assert model.blocks.alphas.tolist() == pytest.approx(alphas)
    out = model(imgs)
    assert (out - original).abs().max() > 1e-3  # alpha_min < 1 changes the function
    used = model.blocks.alphas.tolist()  # the schedule rounded to float32, as the kernels read it
    torch.testing.assert_close(out, decayed_reference(model, used, imgs), rtol=1e-9, atol=1e-9)
    # block-by-block paths (gradient checkpointing) run each block's decayed, unfused forward
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(imgs), out, rtol=1e-9, atol=1e-9)
    # a second conversion is refused; set_alphas changes the schedule of both paths (ones: the original)
    with pytest.raises(ValueError, match="already converted"):
        dres.convert_timm_vit(model, alpha_min=1.0)
    model.blocks.set_alphas([1.0] * 6)
    torch.testing.assert_close(model(imgs), original, rtol=1e-9, atol=1e-9)
    model.set_grad_checkpointing(False)
    torch.testing.assert_close(model(imgs), original, rtol=1e-9, atol=1e-9)


def test_alphas_of_one_reach_the_ops_as_floats():
    """set_alphas records which alphas are one: those reach the ops as the float 1.0 (the formulas then multiply
    nothing), the others as their buffer's 0-dim views (no value for torch.compile to specialise on); the function
    is the schedule's either way."""
    model = small_vit().double()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    dres.convert_timm_vit(model, backend="torch")
    alphas = [1.0, 0.9, 1.0, 0.7, 0.8, 1.0]
    model.blocks.set_alphas(alphas)
    taken = [block_alpha(blk, i) for blk in model.blocks for i in (0, 1)][1:] + [model.blocks.final_alpha_arg()]
    assert [type(a) for a in taken] == [float if a == 1.0 else torch.Tensor for a in alphas]
    assert [float(a) for a in taken] == pytest.approx(alphas)
    used = model.blocks.alphas.tolist()
    torch.testing.assert_close(model(imgs), decayed_reference(model, used, imgs), rtol=1e-9, atol=1e-9)


def layer_scaled_vit(**kw):
    return small_vit(init_values=0.1, **kw)


@pytest.mark.parametrize("make", [small_vit, small_eva, layer_scaled_vit])
def test_convert_triton_interpreter(triton_device, make):
    model = make(depth=2).to(triton_device)
    imgs = torch.randn(2, 3, 16, 16, device=triton_device)
    before = model(imgs)
    before_grads = param_grads(model, lambda: model(imgs).square().sum())
    dres.convert_timm_vit(model, backend="triton")
    torch.testing.assert_close(model(imgs), before, rtol=1e-4, atol=1e-4)
    assert_grads_close(param_grads(model, lambda: model(imgs).square().sum()), before_grads, rtol=1e-3, atol=1e-4)


def test_convert_rejects_non_vit():
    with pytest.raises(TypeError, match="VisionTransformer"):
        dres.convert_timm_vit(torch.nn.Linear(3, 3))
    model = small_vit()
    model.blocks[1].norm2 = torch.nn.RMSNorm(32)
    with pytest.raises(TypeError, match="block 1.norm2 is RMSNorm"):
        dres.convert_timm_vit(model)


# ---------------------------------------------------------------------------------------------
# Drop path and ResidualDroppath


def block_grads(module, prefix=""):
    return {n[len(prefix):]: p.grad.clone() for n, p in module.named_parameters() if n.startswith(prefix)}


@pytest.mark.parametrize("mode", ["drop_path", "residual_droppath"])
def test_droppath_is_that_of_the_dres_vit_stack(mode):
    """The converted blocks and a dres TransformerStack holding the same weights, each with a
    controller of the same seed, rate and mode: equal outputs and parameter gradients over an even
    and an odd iteration, with both kinds of sample drawn."""
    model = small_vit(depth=3, mlp_ratio=2.0).double().train()
    dres.convert_timm_vit(model, drop_path=0.5, droppath_mode=mode, droppath_seed=7, backend="torch")
    assert model.droppath.rates == pytest.approx([0.0, 0.0, 0.25, 0.25, 0.5, 0.5])  # linear over blocks
    stack = TransformerStack(32, 3, 2, mlp_ratio=2.0, final_norm=False, backend="torch").double().train()
    stack.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("blocks.")})  # same names
    controller = ResidualDroppath(0.5, 6, mode=mode, seed=7).train()
    x = torch.randn(8, 5, 32, dtype=torch.float64)
    for _ in range(2):  # an even and an odd iteration
        model.zero_grad(), stack.zero_grad()
        got = model.blocks(x)
        want = stack(x, scales=controller.scales(8, x.device))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got.square().sum().backward(), want.square().sum().backward()
        got_grads, want_grads = block_grads(model, "blocks."), block_grads(stack, "blocks.")
        assert got_grads.keys() == want_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12)
        model.droppath.next_iteration(), controller.next_iteration()
    masks = model.droppath.masks
    assert 0 < masks[2:].sum() < masks[2:].numel()
    # and the block-by-block path (gradient checkpointing) drops the same paths
    model.set_grad_checkpointing(True)
    imgs = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    by_block = model(imgs)
    model.set_grad_checkpointing(False)
    torch.testing.assert_close(by_block, model(imgs), rtol=1e-12, atol=1e-12)


def test_drop_path_scales_kept_samples_and_eval_is_plain():
    model = small_vit(depth=2).double().train()
    plain = copy.deepcopy(model).eval()
    dres.convert_timm_vit(model, drop_path=0.5, backend="torch")
    x = torch.randn(16, 5, 32, dtype=torch.float64)
    out = model.blocks(x)
    m = model.droppath.masks[3]  # the deepest block's MLP residual, rate 0.5
    assert 0 < m.sum() < 16
    blk = model.blocks[1]
    mid = x
    for b in plain.blocks[:1]:
        mid = b(mid)
    mid = mid + (model.droppath.masks[2] / 0.5).view(-1, 1, 1) * blk.attn(blk.norm1(mid))
    torch.testing.assert_close(out, mid + (m / 0.5).view(-1, 1, 1) * blk.mlp(blk.norm2(mid)))
    model.eval()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(model(imgs), plain(imgs), rtol=1e-12, atol=1e-12)


def test_residual_droppath_triton_interpreter(triton_device):
    """The Triton kernels with per-sample scales inside converted timm blocks (odd iteration: value of
    the plain network, gradient only into dropped branches) against the reference backend."""
    model = dres.convert_timm_vit(small_vit(depth=2), drop_path=0.6, droppath_mode="residual_droppath",
                                  backend="triton").to(triton_device).train()
    reference = dres.nn.set_backend(copy.deepcopy(model), "torch")
    imgs = torch.randn(4, 3, 16, 16, device=triton_device)
    for _ in range(2):  # an even and an odd iteration
        want_grads = param_grads(reference, lambda: reference(imgs).square().sum())
        got_grads = param_grads(model, lambda: model(imgs).square().sum())
        torch.testing.assert_close(model(imgs), reference(imgs), rtol=1e-4, atol=1e-4)
        assert_grads_close(got_grads, want_grads, rtol=1e-3, atol=1e-4)
        model.droppath.next_iteration(), reference.droppath.next_iteration()


def test_timm_drop_path_of_the_model_is_kept():
    """A model created with timm's drop_path_rate keeps its DropPath on the branch (same function)."""
    original = small_vit(drop_path_rate=0.5).double().train()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    imgs = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    outs = []
    for model in (original, converted):
        torch.manual_seed(3)
        outs.append(model(imgs))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="drop_path_rate=0"):
        dres.convert_timm_vit(copy.deepcopy(original), drop_path=0.1)


def test_controller_state_travels_with_the_state_dict():
    model = dres.convert_timm_vit(small_vit(), drop_path=0.1, droppath_mode="residual_droppath")
    assert list(model.state_dict()) == list(small_vit().state_dict()) + ["droppath._extra_state"]
    model.train()(torch.randn(2, 3, 16, 16))
    model.droppath.next_iteration()
    other = dres.convert_timm_vit(small_vit(), drop_path=0.1, droppath_mode="residual_droppath")
    other.load_state_dict(model.state_dict())
    assert other.droppath.iteration == 1
    with pytest.raises(ValueError, match="mode must be one of"):
        dres.convert_timm_vit(small_vit(), drop_path=0.1, droppath_mode="dropout")


# ---------------------------------------------------------------------------------------------
# Export of a dres ViT to timm's format


@pytest.mark.parametrize("global_pool", ["cls", "avg"])
def test_export_classifier_loads_into_timm_and_computes_the_same(global_pool):
    from dres.convert import export_timm_state_dict, timm_vit_kwargs

    torch.manual_seed(0)
    model = perturb_(tiny_classifier(global_pool=global_pool)).double().eval()
    vit = VisionTransformer(**timm_vit_kwargs(model)).double().eval()
    vit.load_state_dict(export_timm_state_dict(model), strict=True)
    imgs = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(vit(imgs), model(imgs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["paper", "official"])
def test_export_mae_encoder_with_and_without_final_norm(variant):
    from dres.convert import export_timm_state_dict, timm_vit_kwargs

    torch.manual_seed(0)
    encoder = perturb_(tiny_mae(variant=variant).encoder).double().eval()
    kwargs = timm_vit_kwargs(encoder)
    assert kwargs["num_classes"] == 0 and kwargs.get("final_norm", True) == (encoder.transformer.norm is not None)
    vit = VisionTransformer(**kwargs).double().eval()
    vit.load_state_dict(export_timm_state_dict(encoder), strict=True)
    imgs = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(vit.forward_features(imgs), encoder(imgs)[0], rtol=1e-12, atol=1e-12)


def test_export_decayed_classifier_then_convert_with_its_alphas():
    """A classifier with decayed shortcuts and a drop-path controller: timm's model computes it once
    converted and given the same alphas (the controller's state is not exported)."""
    from dres.convert import export_timm_state_dict, timm_vit_kwargs

    torch.manual_seed(0)
    model = perturb_(tiny_classifier(alpha_min=0.6, drop_path=0.1)).double().eval()
    state = export_timm_state_dict(model)
    assert not any("droppath" in k for k in state)
    vit = VisionTransformer(**timm_vit_kwargs(model)).double().eval()
    vit.load_state_dict(state, strict=True)
    dres.convert_timm_vit(vit, backend="torch")
    vit.blocks.set_alphas(model.encoder.transformer.alphas.tolist())
    imgs = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(vit(imgs), model(imgs), rtol=1e-12, atol=1e-12)


def test_export_refuses_other_models_and_unknown_keys():
    from dres.convert import export_timm_state_dict

    with pytest.raises(TypeError, match="ViTClassifier or ViTEncoder"):
        export_timm_state_dict(small_vit())
    model = tiny_classifier()
    model.probe = torch.nn.Linear(32, 2)
    with pytest.raises(ValueError, match="'probe.weight' has no timm VisionTransformer counterpart"):
        export_timm_state_dict(model)


# ---------------------------------------------------------------------------------------------
# More of timm's ViTs: DINOv2 (LayerScale, register tokens), Eva (rotary embeddings, LayerScale as
# parameters, SwiGLU); post-norm blocks refused


def eva_decayed_reference(model, alphas, imgs, scales=None):
    """Eva's forward with the decayed residuals written out (``scales``: per residual a per-sample factor)."""
    x, rope = model._pos_embed(model.patch_embed(imgs))
    x = model.norm_pre(x)
    scale = [torch.ones(len(imgs), 1, 1, dtype=x.dtype)] * len(alphas) if scales is None else scales
    for k, blk in enumerate(model.blocks):
        x = alphas[2 * k] * x + scale[2 * k] * blk.gamma_1 * blk.attn(blk.norm1(x), rope=rope)
        x = alphas[2 * k + 1] * x + scale[2 * k + 1] * blk.gamma_2 * blk.mlp(blk.norm2(x))
    return model.forward_head(model.norm(x))


def assert_same_function_and_state(original, converted, imgs, tol):
    """Outputs and parameter gradients of the two models agree to ``tol``; their state_dicts load into
    each other strictly."""
    torch.testing.assert_close(converted(imgs), original(imgs), **tol)
    assert_grads_close(param_grads(converted, lambda: converted(imgs).square().sum()),
                       param_grads(original, lambda: original(imgs).square().sum()), **tol)
    converted.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(converted.state_dict(), strict=True)


@pytest.mark.parametrize("kw", [{}, {"swiglu_mlp": True, "scale_mlp": True}, {"use_rot_pos_emb": False}])
def test_eva_alpha1_keeps_function(kw):
    original = small_eva(**kw).double()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    assert isinstance(converted.blocks, FusedTimmBlocks)
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert_same_function_and_state(original, converted, imgs, dict(rtol=1e-10, atol=1e-10))


def test_eva_decayed_and_dropped_paths_are_those_written_out():
    model = small_eva().double()
    imgs = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    dres.convert_timm_vit(model, alpha_min=0.6, backend="torch")
    alphas = model.blocks.alphas.tolist()
    out = model(imgs)
    torch.testing.assert_close(out, eva_decayed_reference(model, alphas, imgs), rtol=1e-10, atol=1e-10)
    model.set_grad_checkpointing(True)  # Eva's own checkpointing calls the same block-by-block forwards
    torch.testing.assert_close(model(imgs), out, rtol=1e-10, atol=1e-10)

    dropped = dres.convert_timm_vit(small_eva().double(), drop_path=0.5, backend="torch").train()
    out = dropped(imgs)
    assert 0 < dropped.droppath.masks[4:].sum() < 8
    scales = [torch.ones(4, 1, 1, dtype=torch.float64) if row is None else row.double().view(4, 1, 1)
              for row, _ in dropped.droppath.scales(4, "cpu")]  # m / keep, 1 where the rate is 0
    torch.testing.assert_close(out, eva_decayed_reference(dropped, [1.0] * 6, imgs, scales), rtol=1e-10, atol=1e-10)


def test_dinov2_alpha1_keeps_function():
    """timm's DINOv2 (LayerScale, register tokens), built small from its name."""
    import timm

    torch.manual_seed(0)
    original = perturb_(timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, img_size=28, depth=2,
                                          embed_dim=32, num_heads=2, num_classes=5)).double().eval()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    imgs = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    assert_same_function_and_state(original, converted, imgs, dict(rtol=1e-10, atol=1e-10))


def test_layer_scale_is_folded_into_the_branches_last_linears(monkeypatch):
    """Under torch.compile a timm LayerScale after a converted branch is folded into the branch's last Linear
    (attention's proj, the MLP's fc2): its own forward does not run on the fused or the block-by-block path,
    and the function and every gradient, gamma's too, stay the original's. Eager keeps its multiply."""
    from timm.layers import LayerScale

    original = layer_scaled_vit().double()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    assert [blk.layer_scale_folded for blk in converted.blocks] == [(1, 2)] * 3
    ran = []
    for m in converted.modules():
        if isinstance(m, LayerScale):
            m.register_forward_hook(lambda module, args, out: ran.append(module))
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert_same_function_and_state(original, converted, imgs, dict(rtol=1e-10, atol=1e-10))
    assert len(ran) == 2 * 6  # eager: timm's multiply, in both forwards of the check
    ran.clear()
    with monkeypatch.context() as patched:
        patched.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled forward's code, run eagerly
        assert_same_function_and_state(original, converted, imgs, dict(rtol=1e-10, atol=1e-10))
        converted.set_grad_checkpointing(True)  # the blocks one by one
        assert_same_function_and_state(original, converted, imgs, dict(rtol=1e-10, atol=1e-10))
        converted.set_grad_checkpointing(False)
        assert not ran
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(imgs), original(imgs), rtol=1e-10, atol=1e-10)
    assert_grads_close(param_grads(converted, lambda: compiled(imgs).square().sum()),
                       param_grads(original, lambda: original(imgs).square().sum()), rtol=1e-10, atol=1e-10)
    # without the fused MLP only the attention's LayerScale is folded
    unfused = dres.convert_timm_vit(copy.deepcopy(original), backend="torch", fused_mlp=False)
    assert [blk.layer_scale_folded for blk in unfused.blocks] == [(1,)] * 3


def test_layer_scale_applies_where_timm_runs_its_own_branch(monkeypatch):
    """An attention mask and active dropout send a branch to timm's own forward; a LayerScale folded into the
    branch is applied to its output there: the same outputs and gradients as the original under the same
    random draws."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled forward's code, run eagerly
    original = layer_scaled_vit(attn_drop_rate=0.2, proj_drop_rate=0.2).double()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True  # every query sees a key
    for blk, ref in zip(converted.blocks, original.blocks):  # eval: the mask alone sends attention to timm
        torch.testing.assert_close(blk(x, attn_mask=mask), ref(x, attn_mask=mask), rtol=1e-10, atol=1e-10)
    original.train(), converted.train()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    outs = []
    for model in (original, converted):
        torch.manual_seed(3)
        outs.append(model(imgs))
        outs[-1].square().sum().backward()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    assert_grads_close({n: p.grad for n, p in converted.named_parameters()},
                       {n: p.grad for n, p in original.named_parameters()}, rtol=1e-10, atol=1e-10)


def test_post_norm_blocks_are_refused():
    from timm.models.vision_transformer import ResPostBlock

    with pytest.raises(TypeError, match="block 0 is a timm.models.vision_transformer.ResPostBlock; only timm's pre-LN"):
        dres.convert_timm_vit(small_vit(block_fn=ResPostBlock))
    with pytest.raises(TypeError, match="EvaBlockPostNorm; only timm's pre-LN"):
        dres.convert_timm_vit(small_eva(use_post_norm=True, init_values=None))


@pytest.mark.parametrize("make", [small_vit, small_eva])
def test_intermediates_of_a_converted_model(make):
    """forward_intermediates stopping early slices the blocks: the slice keeps their decayed forwards."""
    original = make().double()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    for stop_early in (False, True):
        want = original.forward_intermediates(imgs, indices=2, stop_early=stop_early, intermediates_only=True)
        got = converted.forward_intermediates(imgs, indices=2, stop_early=stop_early, intermediates_only=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_original_checkpoint_loads_strictly_into_a_model_with_drop_path():
    """The controller's state is no key of the original model: its checkpoint loads strictly and the
    iteration stays; other missing or unexpected keys are still errors."""
    original = small_vit()
    model = dres.convert_timm_vit(small_vit(), drop_path=0.1, droppath_mode="residual_droppath").train()
    model(torch.randn(2, 3, 16, 16))
    model.droppath.next_iteration()
    model.load_state_dict(original.state_dict(), strict=True)
    assert model.droppath.iteration == 1
    partial = {k: v for k, v in original.state_dict().items() if k != "head.bias"}
    with pytest.raises(RuntimeError, match="Missing key.*head.bias"):
        model.load_state_dict(partial)
    with pytest.raises(RuntimeError, match="Unexpected key.*droppath.counter"):
        model.load_state_dict({**original.state_dict(), "droppath.counter": torch.zeros(())})


@pytest.mark.parametrize("size,bias,channels_last", [((16, 16), True, False), ((19, 21), False, True)])
def test_patch_gemm_is_the_strided_convolution(size, bias, channels_last):
    """Forward and every gradient in float64, whole patches or not (the convolution drops the rest), from a
    channels-last input; the output a view of the (B, N, C) product, as the models flatten it."""
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(3, 6, kernel_size=(4, 5), stride=(4, 5), bias=bias).double()
    patch = copy.deepcopy(conv)
    patch.__class__ = PatchConv2d
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [conv(xs[0]), patch(xs[1])]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    assert outs[1].flatten(2).transpose(1, 2).is_contiguous()
    g = torch.randn_like(outs[0])
    for out in outs:
        out.backward(g)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)
    for a, b in zip(conv.parameters(), patch.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("out_features,bias", [(37, True), (21, False), (2 * ROW_ALIGNMENT, True)])
def test_aligned_linear_is_the_linear_on_aligned_rows(out_features, bias):
    """Forward and every gradient in float64 against nn.Linear, from a non-contiguous output gradient; the output's
    rows strided at a multiple of ROW_ALIGNMENT (unpadded where already aligned); under torch.compile the plain
    Linear (contiguous), the same values."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(12, out_features, bias=bias).double()
    aligned = copy.deepcopy(linear)
    aligned.__class__ = AlignedLinear
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [linear(xs[0]), aligned(xs[1])]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    assert outs[1].stride(-2) == out_features + (-out_features % ROW_ALIGNMENT)
    g = torch.randn(out_features, 5, 2, dtype=torch.float64).permute(2, 1, 0)
    for out in outs:
        out.backward(g)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-12, atol=1e-12)
    for a, b in zip(linear.parameters(), aligned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12)
    compiled = torch.compile(aligned, backend="aot_eager", fullgraph=True)(x)
    assert compiled.is_contiguous()
    torch.testing.assert_close(compiled, outs[0], rtol=1e-12, atol=1e-12)


def test_converted_vit_embeds_patches_without_a_convolution(monkeypatch):
    model = small_vit().double()
    imgs = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    want, keys = model(imgs), model.state_dict().keys()
    dres.convert_timm_vit(model, backend="torch")
    assert type(model.patch_embed.proj) is PatchConv2d and model.state_dict().keys() == keys
    monkeypatch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: pytest.fail("a convolution ran"))
    torch.testing.assert_close(model(imgs), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("make", [small_vit, small_eva])
def test_a_bf16_stream_is_carried_in_bf16_under_autocast_on_every_path(make):
    """stream_dtype=torch.bfloat16: under autocast every residual add writes bf16 (the fused stream and the
    block-by-block path alike), the output stays within bf16 rounding of the float32 stream's, gradients reach every
    parameter; without autocast the stream keeps the model's dtype, bit for bit the default conversion's."""
    plain = make()
    default = dres.convert_timm_vit(copy.deepcopy(plain), backend="torch")
    bf16 = dres.convert_timm_vit(copy.deepcopy(plain), backend="torch", stream_dtype=torch.bfloat16)
    imgs = torch.randn(2, 3, 16, 16)
    stored = []
    real_add = dres.ops.reference.residual_add

    def recording_add(*args, **kwargs):
        out = real_add(*args, **kwargs)
        stored.append(out.dtype)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dres.ops.reference, "residual_add", recording_add)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = default(imgs), bf16(imgs)
            bf16.set_grad_checkpointing(True)
            stepwise = bf16.forward_features(imgs)  # checkpointed: the block-by-block path
    adds = 2 * len(bf16.blocks)
    assert stored[:adds] == [torch.float32] * adds and stored[adds:2 * adds] == [torch.bfloat16] * adds
    assert stored[2 * adds:] == [torch.bfloat16] * adds
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(stepwise.float(), bf16.forward_features(imgs).float(), rtol=0.05, atol=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16(imgs).float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bf16.parameters() if p.requires_grad)
    torch.testing.assert_close(bf16(imgs), default(imgs), rtol=0, atol=0)


def test_stream_dtype_other_than_a_half_dtype_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^stream_dtype must be None, torch.bfloat16 or torch.float16, got "
                                         r"torch.float64$"):
        dres.convert_timm_vit(small_vit(), stream_dtype=torch.float64)
