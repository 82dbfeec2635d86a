"""dres.convert_timm_vit on a small timm VisionTransformer: alpha_min = 1 keeps the function (forward
and gradients; float64 reference backend to 1e-9, Triton interpreter in float32 to 1e-4), alpha_min < 1
changes it to exactly the decayed one, weights and state_dict keys stay untouched."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import dres
from dres.convert import FusedTimmBlocks
from dres.nn import decay_schedule
from test_nn import assert_grads_close, param_grads, perturb_


def small_vit(**kw):
    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    return perturb_(VisionTransformer(**{**args, **kw})).eval()


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
    # converting again re-sets the schedule (alpha_min = 1 gives back the original function)
    dres.convert_timm_vit(model, alpha_min=1.0, backend="torch")
    model.set_grad_checkpointing(False)
    torch.testing.assert_close(model(imgs), original, rtol=1e-9, atol=1e-9)


def test_convert_triton_interpreter(triton_device):
    model = small_vit(depth=2).to(triton_device)
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
