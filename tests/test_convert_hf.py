"""dres.convert_hf_vit, dres.convert_hf_bert and dres.convert_hf_gpt2 on tiny transformers models built
from configs (no weights downloaded): at alpha_min = 1 the converted model computes the unconverted
one's outputs and gradients (input and every parameter; float64 reference backend to 1e-12, Triton
interpreter in float32), every residual add runs fused (for ViT and GPT-2 across layers), alpha_min < 1
gives the decayed function written out by hand, the keys of the state_dict stay, and a converted GPT-2
generates the tokens the original does."""

from __future__ import annotations

import copy
from typing import Optional
from unittest import mock

import pytest
import torch
from torch import nn

import dres
from dres import ops
from dres.convert import ROW_ALIGNMENT, AlignedLinear, PatchConv2d
from dres.nn import set_backend
from test_nn import perturb_

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForMaskedLM, ViTConfig, ViTForImageClassification, ViTModel  # noqa: E402

F64 = dict(rtol=1e-12, atol=1e-12)
# float32 kernels against PyTorch (the Triton interpreter on CPU; GPUs sum in other orders): as tests/test_convert.py
KERNEL_TOL, KERNEL_GRAD_TOL = dict(rtol=1e-4, atol=1e-4), dict(rtol=1e-3, atol=1e-4)


def tiny_vit(cls=ViTForImageClassification, **kw) -> nn.Module:
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                intermediate_size=64, num_labels=5, layer_norm_eps=1e-6)
    return perturb_(cls(ViTConfig(**{**args, **kw}))).eval()


def tiny_bert(**kw) -> nn.Module:
    torch.manual_seed(0)
    args = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return perturb_(BertForMaskedLM(BertConfig(**{**args, **kw}))).eval()


def hf_layers(vit: nn.Module) -> nn.ModuleList:
    """A ViTModel's layers: ``layers`` from transformers 5 on, ``encoder.layer`` before."""
    return vit.layers if hasattr(vit, "layers") else vit.encoder.layer


def vit_inputs(dtype=torch.float64, device="cpu"):
    return {"pixel_values": torch.randn(2, 3, 16, 16, dtype=dtype, device=device)}


def bert_inputs(device="cpu"):
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # a padded sequence: the attention mask reaches the converted layers
    return {"input_ids": torch.randint(0, 40, (2, 7), generator=g).to(device), "attention_mask": mask.to(device)}


def outputs_and_grads(model, inputs: dict, grad_input: Optional[str]):
    """The model's logits, the gradient of a loss on them into ``inputs[grad_input]`` (None: no input
    gradient) and into every parameter (a loss through all logits, so every parameter and input element gets gradient)."""
    inputs = {k: v.detach().clone().requires_grad_(k == grad_input) for k, v in inputs.items()}
    model.zero_grad(set_to_none=True)
    out = model(**inputs).logits
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), None if grad_input is None else inputs[grad_input].grad, grads


def assert_same_function(original, converted, inputs, grad_input, tol: dict, grad_tol: Optional[dict] = None,
                         unused: frozenset = frozenset()):
    """Outputs to ``tol``, input and parameter gradients to ``grad_tol`` (default ``tol``); every
    trainable parameter but those ``unused`` by the inputs gets a gradient."""
    grad_tol = grad_tol or tol
    out_a, din_a, grads_a = outputs_and_grads(original, inputs, grad_input)
    out_b, din_b, grads_b = outputs_and_grads(converted, inputs, grad_input)
    torch.testing.assert_close(out_b, out_a, **tol)
    torch.testing.assert_close(din_b, din_a, **grad_tol)
    trainable = {n for n, p in original.named_parameters() if p.requires_grad}
    assert grads_b.keys() == grads_a.keys() == trainable - unused
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **grad_tol, msg=lambda m: f"{name}: {m}")


COUNTED_OPS = ("residual_layer_norm", "residual_add", "layer_norm", "fused_mlp", "short_attention", "mae_loss")


class CallCounts:
    """How often each fused op (:data:`COUNTED_OPS`) and torch's LayerNorm forward (``"LayerNorm"``) run
    inside the block; ``counts`` holds the ops that ran at least once."""

    def __enter__(self):
        self.patches = {name: mock.patch.object(ops, name, wraps=getattr(ops, name)) for name in COUNTED_OPS}
        self.patches["LayerNorm"] = mock.patch.object(nn.LayerNorm, "forward", autospec=True,
                                                      side_effect=nn.LayerNorm.forward)
        self.mocks = {name: p.start() for name, p in self.patches.items()}
        return self

    def __exit__(self, *exc):
        for p in self.patches.values():
            p.stop()

    @property
    def counts(self) -> dict[str, int]:
        return {name: m.call_count for name, m in self.mocks.items() if m.call_count}


# ---------------------------------------------------------------------------------------------
# ViT: pre-LN, the stream carried across layers


@pytest.mark.parametrize("cls", [ViTForImageClassification, ViTModel])
def test_vit_alpha1_keeps_function_and_weights(cls):
    original = tiny_vit(cls).double()
    converted = copy.deepcopy(original)
    assert dres.convert_hf_vit(converted, backend="torch") is converted
    assert type(converted.base_model.embeddings.patch_embeddings.projection) is PatchConv2d
    assert converted.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(converted.state_dict().values(), original.state_dict().values()))
    if cls is ViTModel:  # its outputs are the final-normed tokens and the pooled class token
        inputs = vit_inputs()
        a, b = original(**inputs), converted(**inputs)
        torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state, **F64)
        torch.testing.assert_close(b.pooler_output, a.pooler_output, **F64)
        return
    assert_same_function(original, converted, vit_inputs(), "pixel_values", F64)


def test_vit_every_add_is_fused_with_the_next_norm():
    """Depth 3: six residual_layer_norm calls (the last with the final layernorm), one layer_norm (the
    first layer's, whose input is no add), no LayerNorm of torch's, a fused MLP per layer; hidden states
    of every layer unchanged."""
    original, converted = tiny_vit().double(), dres.convert_hf_vit(tiny_vit().double(), backend="torch")
    inputs = vit_inputs()
    with CallCounts() as calls:
        out = converted(**inputs, output_hidden_states=True)
    assert calls.counts == {"residual_layer_norm": 6, "layer_norm": 1, "fused_mlp": 3}
    want = original(**inputs, output_hidden_states=True)
    assert len(out.hidden_states) == 4
    for a, b in zip(out.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, **F64)


def test_vit_dropout_in_training_keeps_function():
    """Training mode with dropout in the branches and on the attention weights: same random draws in
    the same order, so the same outputs and gradients."""
    original = tiny_vit(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2).double().train()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    results = []
    for model in (original, converted):
        torch.manual_seed(3)
        results.append(outputs_and_grads(model, vit_inputs(), "pixel_values"))
    (out_a, din_a, grads_a), (out_b, din_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, **F64)
    torch.testing.assert_close(din_b, din_a, **F64)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **F64)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_vit_gradient_checkpointing_ends_layers_with_a_plain_add(use_reentrant):
    """Checkpointed layers are recomputed one by one in the backward: nothing is handed across."""
    original = tiny_vit().double().train()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    for model in (original, converted):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    with CallCounts() as calls:
        assert_same_function(original, converted, vit_inputs(), "pixel_values", F64)
    # per layer one fused add+norm in the forward and again in the recompute (so the layers are
    # checkpointed), and a plain residual_add (which the non-reentrant recompute stops before)
    fused, plain = calls.counts["residual_layer_norm"], calls.counts["residual_add"]
    assert fused == 2 * 3 and plain in (3, 2 * 3)


def test_vit_decayed_is_the_decayed_function():
    model = tiny_vit().double()
    inputs = vit_inputs()
    original = model(**inputs).logits
    dres.convert_hf_vit(model, alpha_min=0.6, backend="torch")
    alphas = torch.tensor(dres.nn.decay_schedule(6, 0.6), dtype=torch.float32).tolist()
    out = model(**inputs).logits
    assert (out - original).abs().max() > 1e-3

    vit = model.vit  # the decayed ViT written out with the model's own modules
    x = vit.embeddings(inputs["pixel_values"])
    for k, layer in enumerate(hf_layers(vit)):
        h = layer.attention(nn.LayerNorm.forward(layer.layernorm_before, x))
        h = h[0] if isinstance(h, tuple) else h
        x = alphas[2 * k] * x + (layer.dropout(h) if hasattr(layer, "mlp") else h)
        y = layer.layernorm_after(x)
        h = layer.mlp(y) if hasattr(layer, "mlp") else layer.output.dense(layer.intermediate(y))
        x = alphas[2 * k + 1] * x + h
    want = model.classifier(nn.LayerNorm.forward(vit.layernorm, x)[:, 0])
    torch.testing.assert_close(out, want, **F64)


def test_vit_triton_interpreter(triton_device):
    original = tiny_vit(num_hidden_layers=2).to(triton_device)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="triton")
    with CallCounts() as calls:
        assert_same_function(original, converted, vit_inputs(torch.float32, triton_device), "pixel_values",
                             KERNEL_TOL, KERNEL_GRAD_TOL)
    # two forwards (original and converted): the converted one's fused ops, short attention included
    assert calls.counts == {"residual_layer_norm": 4, "layer_norm": 1, "fused_mlp": 2, "short_attention": 2,
                            "LayerNorm": 2 * 2 + 1}


# ---------------------------------------------------------------------------------------------
# More pre-LN ViTs: DeiT, DINOv2 (LayerScale, DropPath, SwiGLU), ViTMAE with its decoder


def tiny_deit(cls_name="DeiTForImageClassification"):
    torch.manual_seed(0)
    config = transformers.DeiTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64, num_labels=5)
    return perturb_(getattr(transformers, cls_name)(config)).eval()


def tiny_dinov2(cls_name="Dinov2ForImageClassification", **kw):
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                mlp_ratio=2, layerscale_value=0.5, num_labels=5)
    return perturb_(getattr(transformers, cls_name)(transformers.Dinov2Config(**{**args, **kw}))).eval()


@pytest.mark.parametrize("cls_name", ["DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"])
def test_deit_alpha1_keeps_function(cls_name):
    original = tiny_deit(cls_name).double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    with CallCounts() as calls:
        assert_same_function(original, converted, vit_inputs(), "pixel_values", F64)
    # every add of the converted model fused, none plain; its first norm and MLPs fused too
    assert {k: v for k, v in calls.counts.items() if k != "LayerNorm"} == {"residual_layer_norm": 2 * 3,
                                                                          "layer_norm": 1, "fused_mlp": 3}
    converted.load_state_dict(original.state_dict(), strict=True)


@pytest.mark.parametrize("kw", [{}, {"use_swiglu_ffn": True}])
def test_dinov2_alpha1_keeps_function(kw):
    original = tiny_dinov2(**kw).double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    assert_same_function(original, converted, vit_inputs(), "pixel_values", F64,
                         unused={"dinov2.embeddings.mask_token"})  # masked-image inputs only
    converted.load_state_dict(original.state_dict(), strict=True)
    model = tiny_dinov2("Dinov2Model", **kw).double()
    fused = dres.convert_hf_vit(copy.deepcopy(model), backend="torch")
    inputs = vit_inputs()
    with CallCounts() as calls:
        got = fused(**inputs).last_hidden_state
    # every add fused, the last with the final layernorm; SwiGLU keeps its own MLP
    assert calls.counts == {"residual_layer_norm": 6, "layer_norm": 1, **({} if kw else {"fused_mlp": 3})}
    torch.testing.assert_close(got, model(**inputs).last_hidden_state, **F64)


def test_dinov2_layer_scale_is_folded_into_the_branches_last_linears(monkeypatch):
    """Under torch.compile a DINOv2 LayerScale after a converted branch is folded into the branch's last Linear
    (the attention's o_proj, the fused MLP's fc2): its own forward does not run, and the function and every
    gradient, lambda1's too, stay the original's; where HF's own attention runs (output_attentions) the scale
    is applied to its output. Eager keeps HF's multiply."""
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale

    original = tiny_dinov2().double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    folded = [layer._dres_layer_scale_folded for layer in converted.dinov2.encoder.layer]
    holds_projection = hasattr(original.dinov2.encoder.layer[0].attention, "o_proj")  # transformers 5
    assert folded == [(1, 2) if holds_projection else (2,)] * 3
    ran = []
    for m in converted.modules():
        if isinstance(m, Dinov2LayerScale):
            m.register_forward_hook(lambda module, args, out: ran.append(module))
    unused = {"dinov2.embeddings.mask_token"}
    assert_same_function(original, converted, vit_inputs(), "pixel_values", F64, unused=unused)
    assert len(ran) == 2 * 3  # eager: HF's multiply on both branches of the 3 layers
    ran.clear()
    with monkeypatch.context() as patched:
        patched.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled forward's code, run eagerly
        assert_same_function(original, converted, vit_inputs(), "pixel_values", F64, unused=unused)
        assert len(ran) == 2 * 3 - sum(map(len, folded))
        inputs = vit_inputs()
        got = converted(**inputs, output_attentions=True)  # HF's own attention, then the scale
        torch.testing.assert_close(got.logits, original(**inputs, output_attentions=True).logits, **F64)
    compiled = torch.compile(converted, backend="aot_eager")
    torch.testing.assert_close(compiled(**inputs).logits, original(**inputs).logits, **F64)
    # without the fused MLP only the attention's LayerScale is folded
    unfused = dres.convert_hf_vit(copy.deepcopy(original), backend="torch", fused_mlp=False)
    assert [layer._dres_layer_scale_folded for layer in unfused.dinov2.encoder.layer] == [
        (1,) if holds_projection else ()] * 3


def test_dinov2_drop_path_in_training_keeps_function():
    """DINOv2's own DropPath (drop_path_rate) draws in the same order in the converted layers."""
    original = tiny_dinov2(drop_path_rate=0.5).double().train()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    results = []
    for model in (original, converted):
        torch.manual_seed(3)
        results.append(outputs_and_grads(model, vit_inputs(), "pixel_values"))
    for got, want in zip(results[1][:2], results[0][:2]):
        torch.testing.assert_close(got, want, **F64)
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, **F64)


def tiny_vit_mae():
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=3,
                                       num_attention_heads=2, intermediate_size=64, decoder_hidden_size=16,
                                       decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
                                       decoder_intermediate_size=32, mask_ratio=0.5)
    return perturb_(transformers.ViTMAEForPreTraining(config)).eval()


def test_vit_mae_encoder_and_decoder_are_converted():
    """ViTMAEForPreTraining: the decoder's adds are fused too (the last with decoder_norm), at alpha 1
    whatever the encoder's decay; outputs, gradients and the loss are the original's."""
    original = tiny_vit_mae().double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    inputs = {**vit_inputs(), "noise": torch.rand(2, 16, dtype=torch.float64)}  # the same patches masked
    with CallCounts() as calls:
        converted(**inputs)
    # layer_norm: the first layer of each stack; the loss read from the pixels
    assert calls.counts == {"residual_layer_norm": 2 * 3 + 2 * 2, "layer_norm": 2, "fused_mlp": 3 + 2, "mae_loss": 1}
    assert_same_function(original, converted, inputs, "pixel_values", F64)
    torch.testing.assert_close(converted(**inputs).loss, original(**inputs).loss, **F64)
    decayed = dres.convert_hf_vit(copy.deepcopy(original), alpha_min=0.5, backend="torch")
    assert [layer._dres_alphas for layer in decayed.decoder.decoder_layers] == [(1.0, 1.0)] * 2
    assert min(min(layer._dres_alphas) for layer in hf_layers(decayed.vit)) == 0.5


def test_vit_converter_refuses_other_layers_in_one_line():
    with pytest.raises(TypeError, match=r"^layer 0 \(BertLayer\) is not a pre-LN ViT, DINOv2, CLIP or SigLIP layer"):
        dres.convert_hf_vit(tiny_bert())
    model = tiny_dinov2()
    model.dinov2.encoder.layer[2].norm2 = nn.RMSNorm(32)
    with pytest.raises(TypeError, match="layer 2.norm2 is RMSNorm"):
        dres.convert_hf_vit(model)


# ---------------------------------------------------------------------------------------------
# BERT: post-LN, each add fused with its own norm


def test_bert_alpha1_keeps_function_and_weights():
    original = tiny_bert().double()
    converted = dres.convert_hf_bert(copy.deepcopy(original), backend="torch")
    assert converted.state_dict().keys() == original.state_dict().keys()
    inputs = bert_inputs()
    with CallCounts() as calls:
        assert_same_function(original, converted, inputs, None, F64)  # token ids: every parameter
    # 2 layers x 2 adds, all fused, and the feed-forwards; a padding mask: SDPA, no short attention
    assert {k: v for k, v in calls.counts.items() if k != "LayerNorm"} == {"residual_layer_norm": 2 * 2,
                                                                          "fused_mlp": 2}
    embeds = {"inputs_embeds": original.bert.embeddings.word_embeddings(inputs["input_ids"]).detach(),
              "attention_mask": inputs["attention_mask"]}
    assert_same_function(original, converted, embeds, "inputs_embeds", F64)  # and the input


def test_bert_decayed_is_the_decayed_function():
    model = tiny_bert().double()
    inputs = bert_inputs()
    dres.convert_hf_bert(model, alpha_min=0.5, backend="torch")
    alphas = torch.tensor(dres.nn.decay_schedule(4, 0.5), dtype=torch.float32).tolist()
    bert = model.bert
    x = bert.embeddings(input_ids=inputs["input_ids"])
    mask = (1.0 - inputs["attention_mask"][:, None, None, :].double()) * torch.finfo(torch.float64).min
    for k, layer in enumerate(bert.encoder.layer):
        attn = layer.attention.self(x, attention_mask=mask)
        attn = attn[0] if isinstance(attn, tuple) else attn
        x = nn.LayerNorm.forward(layer.attention.output.LayerNorm, alphas[2 * k] * x + layer.attention.output.dense(attn))
        h = layer.output.dense(layer.intermediate(x))
        x = nn.LayerNorm.forward(layer.output.LayerNorm, alphas[2 * k + 1] * x + h)
    torch.testing.assert_close(model(**inputs).logits, model.cls(x), **F64)


def test_bert_triton_interpreter(triton_device):
    original = tiny_bert().to(triton_device)
    converted = dres.convert_hf_bert(copy.deepcopy(original), backend="triton")
    ids = bert_inputs(triton_device)
    embeds = {"inputs_embeds": original.bert.embeddings.word_embeddings(ids["input_ids"]).detach(),
              "attention_mask": ids["attention_mask"]}
    assert_same_function(original, converted, embeds, "inputs_embeds", KERNEL_TOL, KERNEL_GRAD_TOL)


LANGUAGE_MODELS = {  # an unaligned vocabulary (37): the converted head pads its rows
    "BertForMaskedLM": lambda: tiny_bert(vocab_size=37),
    "RobertaForMaskedLM": lambda: tiny_roberta(vocab_size=37),
    "GPT2LMHeadModel": lambda: tiny_gpt2(vocab_size=37),
}


def tiny_roberta(**kw) -> nn.Module:
    torch.manual_seed(0)
    args = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                pad_token_id=1)
    return perturb_(transformers.RobertaForMaskedLM(transformers.RobertaConfig(**{**args, **kw}))).eval()


@pytest.mark.parametrize("name", list(LANGUAGE_MODELS))
def test_language_model_head_runs_on_aligned_rows_with_the_same_function(name):
    """The converted head is an AlignedLinear, its weight still the tied input embedding and the state_dict's keys
    unchanged; logits (strided at the aligned width), the loss and every gradient as the original's in float64;
    aligned_head=False keeps HF's Linear."""
    original = LANGUAGE_MODELS[name]().double()
    converter = dres.convert_hf_gpt2 if name.startswith("GPT2") else dres.convert_hf_bert
    converted = converter(copy.deepcopy(original), backend="torch")
    head = converted.get_output_embeddings()
    assert type(head) is AlignedLinear and head.weight is converted.get_input_embeddings().weight
    assert converted.state_dict().keys() == original.state_dict().keys()
    ids = torch.randint(3, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = torch.where(torch.arange(7) % 3 == 0, ids, -100)
    losses = []
    for model in (original, converted):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        (out.loss + out.logits.square().mean()).backward()
        losses.append((out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert losses[1][1].stride(-2) == 37 + (-37 % ROW_ALIGNMENT)
    torch.testing.assert_close(losses[1][0], losses[0][0], **F64)
    torch.testing.assert_close(losses[1][1], losses[0][1], **F64)
    for n, grad in losses[0][2].items():
        torch.testing.assert_close(losses[1][2][n], grad, **F64, msg=lambda m: f"{n}: {m}")
    kept = converter(LANGUAGE_MODELS[name](), aligned_head=False)
    assert type(kept.get_output_embeddings()) is nn.Linear


# ---------------------------------------------------------------------------------------------
# Arguments and models refused


def test_converters_refuse_other_models_and_second_conversions():
    with pytest.raises(TypeError, match="ViTModel"):
        dres.convert_hf_vit(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="BertModel"):
        dres.convert_hf_bert(nn.Linear(2, 2))
    with pytest.raises(TypeError):  # transformers 5: no encoder.layer; 4.x: layers without a LayerNorm add
        dres.convert_hf_bert(tiny_vit())
    model = dres.convert_hf_vit(tiny_vit())
    with pytest.raises(ValueError, match="already converted"):
        dres.convert_hf_vit(model)
    model = dres.convert_hf_bert(tiny_bert())
    with pytest.raises(ValueError, match="already converted"):
        dres.convert_hf_bert(model)
    model = tiny_vit()
    hf_layers(model.vit)[1].layernorm_after = nn.RMSNorm(32)
    with pytest.raises(TypeError, match="layer 1.layernorm_after is RMSNorm"):
        dres.convert_hf_vit(model)
    with pytest.raises(ValueError, match="alpha_min"):
        dres.convert_hf_bert(tiny_bert(), alpha_min=2.0)


def test_set_backend_reaches_converted_layers():
    vit = set_backend(dres.convert_hf_vit(tiny_vit(), backend="torch"), "triton")
    bert = set_backend(dres.convert_hf_bert(tiny_bert(), backend="torch"), "triton")
    fused = [m for m in list(vit.modules()) + list(bert.modules()) if getattr(m, "_dres_fused", False)]
    # the layers and their attentions; BERT's add-and-norm modules and attentions
    assert len(fused) == 2 * 3 + 2 * 2 + 2 and all(m.backend == "triton" for m in fused)


def test_converted_vit_compiles_as_one_graph():
    """torch.compile(fullgraph=True) traces the carry (the norm's hand-over) without a graph break."""
    model = dres.convert_hf_vit(tiny_vit(), backend="torch")
    inputs = vit_inputs(torch.float32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits)


# ---------------------------------------------------------------------------------------------
# GPT-2: pre-LN and causal, the stream carried across blocks around HF's attention


def tiny_gpt2(cls_name="GPT2LMHeadModel", **kw) -> nn.Module:
    torch.manual_seed(0)
    args = dict(vocab_size=40, n_positions=24, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0, num_labels=3)
    return perturb_(getattr(transformers, cls_name)(transformers.GPT2Config(**{**args, **kw}))).eval()


def gpt2_inputs(model: nn.Module, padded: bool = False, device="cpu") -> dict:
    """inputs_embeds (so the input gets a gradient) of 2 sequences of 7 tokens; ``padded``: the second
    left-padded by 3 (the attention mask reaches the converted blocks)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (2, 7), generator=g).to(device)
    inputs = {"inputs_embeds": model.get_input_embeddings()(ids).detach()}
    if padded:
        mask = torch.ones(2, 7, dtype=torch.long, device=device)
        mask[1, :3] = 0
        inputs["attention_mask"] = mask
    return inputs


@pytest.mark.parametrize("cls_name", ["GPT2LMHeadModel", "GPT2ForSequenceClassification"])
@pytest.mark.parametrize("padded", [False, True])
def test_gpt2_alpha1_keeps_function_and_weights(cls_name, padded):
    # padded: float32 (transformers 4.46 builds no float64 causal mask for SDPA)
    original, tol = (tiny_gpt2(cls_name), dict(rtol=1e-5, atol=1e-5)) if padded else (tiny_gpt2(cls_name).double(), F64)
    converted = copy.deepcopy(original)
    assert dres.convert_hf_gpt2(converted, backend="torch") is converted
    before, after = original.state_dict(), converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    inputs = gpt2_inputs(original, padded)
    # the token embedding gets a gradient only through the language model head it is tied to
    unused = frozenset() if hasattr(original, "lm_head") else frozenset({"transformer.wte.weight"})
    assert_same_function(original, converted, inputs, "inputs_embeds", tol, unused=unused)
    # every add fused, the last with ln_f; the first block's ln_1 a layer_norm; no LayerNorm of torch's
    with CallCounts() as calls:
        converted(**inputs)
    assert calls.counts == {"residual_layer_norm": 2 * 3, "layer_norm": 1, "fused_mlp": 3}


def test_gpt2_hidden_states_and_attention_probabilities():
    """output_hidden_states: every block's output the original's; output_attentions (the eager
    implementation, which returns them): HF's attention returns the same probabilities."""
    original = tiny_gpt2(attn_implementation="eager").double()
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="torch")
    inputs = gpt2_inputs(original, padded=True)
    a = original(**inputs, output_hidden_states=True, output_attentions=True)
    b = converted(**inputs, output_hidden_states=True, output_attentions=True)
    torch.testing.assert_close(b.logits, a.logits, **F64)
    assert len(b.hidden_states) == len(a.hidden_states) == 4 and len(b.attentions) == len(a.attentions) == 3
    for x, y in zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions):
        torch.testing.assert_close(y, x, **F64)


@pytest.mark.parametrize("padded,vocab", [(False, 40), (True, 40), (False, 37)])
def test_gpt2_generates_the_same_tokens(padded, vocab):
    """Greedy generation with the key/value cache: the same tokens; every step (the prompt, then one
    token at a time against the cache) runs the converted blocks (with an unaligned vocabulary, 37, the
    head on padded rows)."""
    original = tiny_gpt2(vocab_size=vocab)
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="torch")
    g = torch.Generator().manual_seed(2)
    prompt = {"input_ids": torch.randint(1, vocab, (2, 5), generator=g),
              "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    if padded:  # left padding, as generation pads
        prompt["input_ids"][1, :2] = 0
        prompt["attention_mask"][1, :2] = 0
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True)
    want = original.generate(**prompt, **settings)
    with CallCounts() as calls:
        got = converted.generate(**prompt, **settings)
    assert want.shape == (2, 11)
    assert torch.equal(got, want)
    assert calls.counts["residual_layer_norm"] == 6 * 2 * 3 and calls.counts["layer_norm"] == 6


def test_gpt2_dropout_in_training_keeps_function():
    """Dropout of the embeddings, the attention probabilities and both branches: the same draws in the
    same order (the MLP's dropout after the fused MLP), so the same outputs and gradients."""
    original = tiny_gpt2(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2).double().train()
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="torch")
    results = []
    for model in (original, converted):
        torch.manual_seed(3)
        results.append(outputs_and_grads(model, gpt2_inputs(original), "inputs_embeds"))
    (out_a, din_a, grads_a), (out_b, din_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, **F64)
    torch.testing.assert_close(din_b, din_a, **F64)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **F64, msg=lambda m: f"{name}: {m}")


RESIDUAL_DROPOUT_MODELS = {
    "gpt2": (lambda: tiny_gpt2(n_layer=2, resid_pdrop=0.3), dres.convert_hf_gpt2, 4,
             lambda model, device: gpt2_inputs(model, device=device)),
    "bert": (lambda: tiny_bert(hidden_dropout_prob=0.3), dres.convert_hf_bert, 4,
             lambda model, device: {k: v.to(device) for k, v in bert_inputs().items()}),
    "vit": (lambda: tiny_vit(hidden_dropout_prob=0.3), dres.convert_hf_vit, 6,
            lambda model, device: vit_inputs(torch.float32, device)),
}


@pytest.mark.parametrize("name", list(RESIDUAL_DROPOUT_MODELS))
def test_residual_dropout_is_drawn_inside_the_fused_adds(triton_device, name):
    """Training: every residual add draws its branch's dropout itself (dropout_p = the config's), and no
    residual dropout runs as a module of its own (only the embeddings' dropout does); eval: p = 0."""
    build, convert, adds, make_inputs = RESIDUAL_DROPOUT_MODELS[name]
    model = convert(build().to(triton_device), backend="triton").train()
    inputs = make_inputs(model, triton_device)
    dropout_modules = []
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(lambda m, args, out: dropout_modules.append(type(m)))
    with CallCounts() as calls:
        model(**inputs).logits.square().mean().backward()
    p_of_adds = [call.kwargs["dropout_p"] for call in calls.mocks["residual_layer_norm"].call_args_list]
    assert p_of_adds == [0.3] * adds
    assert dropout_modules.count(nn.Dropout) == 1  # the embeddings'
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with CallCounts() as calls:
        model(**inputs)
    assert {call.kwargs["dropout_p"] for call in calls.mocks["residual_layer_norm"].call_args_list} == {0.0}


def test_gpt2_gradient_checkpointing_ends_blocks_with_a_plain_add():
    original = tiny_gpt2().double().train()
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="torch")
    for model in (original, converted):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with CallCounts() as calls:
        assert_same_function(original, converted, gpt2_inputs(original), "inputs_embeds", F64)
    # per block the attention add fused with ln_2 (forward and recompute), the MLP add a residual_add
    assert calls.counts["residual_layer_norm"] == 2 * 3 and calls.counts["residual_add"] in (3, 2 * 3)


def test_gpt2_decayed_is_the_decayed_function():
    model = tiny_gpt2().double()
    inputs = gpt2_inputs(model)
    original = model(**inputs).logits
    dres.convert_hf_gpt2(model, alpha_min=0.6, backend="torch")
    alphas = torch.tensor(dres.nn.decay_schedule(6, 0.6), dtype=torch.float32).tolist()
    out = model(**inputs).logits
    assert (out - original).abs().max() > 1e-3

    gpt2 = model.transformer  # the decayed GPT-2 written out with the model's own modules (HF's causal attention)
    x = inputs["inputs_embeds"] + gpt2.wpe(torch.arange(7))
    for k, block in enumerate(gpt2.h):
        x = alphas[2 * k] * x + block.attn(nn.LayerNorm.forward(block.ln_1, x))[0]
        x = alphas[2 * k + 1] * x + block.mlp(nn.LayerNorm.forward(block.ln_2, x))
    torch.testing.assert_close(out, model.lm_head(nn.LayerNorm.forward(gpt2.ln_f, x)), **F64)


def test_gpt2_triton_interpreter(triton_device):
    original = tiny_gpt2(n_layer=2).to(triton_device)
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="triton")
    inputs = gpt2_inputs(original, padded=True, device=triton_device)
    with CallCounts() as calls:
        converted(**inputs)
    assert calls.counts == {"residual_layer_norm": 4, "layer_norm": 1, "fused_mlp": 2}
    assert_same_function(original, converted, inputs, "inputs_embeds", KERNEL_TOL, KERNEL_GRAD_TOL)


def test_gpt2_converter_refuses_in_one_line():
    with pytest.raises(TypeError, match=r"^expected a Hugging Face GPT2Model .*, got ViTForImageClassification$"):
        dres.convert_hf_gpt2(tiny_vit())
    with pytest.raises(TypeError, match=r"^block 0 has cross-attention \(add_cross_attention=True\)"):
        dres.convert_hf_gpt2(tiny_gpt2(add_cross_attention=True))
    model = tiny_gpt2()
    model.transformer.h[1].ln_2 = nn.RMSNorm(32)
    with pytest.raises(TypeError, match="block 1.ln_2 is RMSNorm"):
        dres.convert_hf_gpt2(model)
    model = tiny_gpt2()
    del model.transformer.h[2].mlp.c_fc
    with pytest.raises(TypeError, match=r"^block 2 \(GPT2Block\) is not a GPT2Block: it lacks \['mlp.c_fc'\]"):
        dres.convert_hf_gpt2(model)
    model = dres.convert_hf_gpt2(tiny_gpt2())
    with pytest.raises(ValueError, match="already converted"):
        dres.convert_hf_gpt2(model)
    with pytest.raises(ValueError, match="alpha_min"):
        dres.convert_hf_gpt2(tiny_gpt2(), alpha_min=2.0)
    with pytest.raises(ValueError, match="^encoder_hidden_states given, but this GPT-2 has no cross-attention"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long), encoder_hidden_states=torch.randn(1, 2, 32))
