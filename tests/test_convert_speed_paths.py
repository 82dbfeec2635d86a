"""The converters' speed paths, on tiny timm and transformers models built from configs: how many
fused-op calls a forward makes (residual_layer_norm, layer_norm, fused_mlp, short_attention,
mae_loss), q/k/v as one GEMM, no float32 -> bf16 cast of a normalised value before the branches under
autocast (and the model outputs in the plain model's dtypes), the state_dict untouched, the short
attention (Triton interpreter) and SDPA paths against the plain model, the fallbacks to the models'
own code (attention probabilities, attention dropout, other activations, ``fused_mlp=False``), and
ViTMAE's loss against HF's on other channel counts, non-square images and without norm-pix."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dres
from dres import ops
from dres.convert import AlignedLinear
from helpers import LaunchCounts
from test_convert_hf import (COUNTED_OPS, F64, KERNEL_GRAD_TOL, KERNEL_TOL, CallCounts, assert_same_function,
                             bert_inputs, gpt2_inputs, tiny_bert, tiny_deit, tiny_dinov2, tiny_gpt2, tiny_vit,
                             tiny_vit_mae, vit_inputs)
from test_nn import perturb_

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


class DispatchCounts(TorchDispatchMode):
    """The aten ops a forward runs outside the fused ops (whose CPU reference casts and multiplies in
    its own way; the kernels do neither): float32 -> bf16 casts of (B, N, width) activations for
    ``widths``, and the (in_features, out_features) of every 2-D matmul."""

    def __init__(self, widths=()):
        super().__init__()
        self.widths, self.casts, self.gemms, self.inside_ops = widths, [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside_ops:
            return out
        if func is torch.ops.aten._to_copy.default:
            src = args[0]
            to_bf16 = src.dtype == torch.float32 and out.dtype == torch.bfloat16
            if to_bf16 and src.dim() == 3 and src.shape[-1] in self.widths:
                self.casts.append(tuple(src.shape))
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.gemms.append((args[-2].shape[-1], out.shape[-1]))
        return out

    @contextlib.contextmanager
    def counting(self):
        """This mode on, blind inside the fused ops of :data:`COUNTED_OPS`."""
        def outside(real):
            def call(*args, **kwargs):
                self.inside_ops += 1
                try:
                    return real(*args, **kwargs)
                finally:
                    self.inside_ops -= 1
            return call

        with contextlib.ExitStack() as stack:
            for name in COUNTED_OPS:
                stack.enter_context(mock.patch.object(ops, name, outside(getattr(ops, name))))
            stack.enter_context(self)
            yield self


def recording_backend(forward_ops: list):
    """aot_eager that appends the ops of each compiled forward graph to ``forward_ops``."""
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(gm, _inputs):
        forward_ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _inputs: gm)


def mae_inputs(dtype=torch.float64, shape=(2, 3, 16, 16)):
    patches = (shape[2] // 4) * (shape[3] // 4)
    return {"pixel_values": torch.randn(*shape, dtype=dtype), "noise": torch.rand(2, patches, dtype=dtype)}


# ---------------------------------------------------------------------------------------------
# Mixed precision: no cast of a normalised value before the branches, outputs in HF's dtypes


@pytest.mark.parametrize("make, widths, plain_casts, converted_casts", [
    (tiny_vit, (32,), 3 * 4, 0),
    # encoder 3 layers, decoder 2 (q, k, v and fc1 each); decoder_embed's and decoder_pred's inputs.
    # Converted: only the latent (the encoder's final norm, a model output in float32) reaches decoder_embed
    (tiny_vit_mae, (32, 16), 3 * 4 + 2 * 4 + 2, 1),
])
def test_autocast_casts_no_normalised_value(make, widths, plain_casts, converted_casts):
    plain = make()
    converted = dres.convert_hf_vit(copy.deepcopy(plain))
    inputs = mae_inputs(torch.float32) if make is tiny_vit_mae else vit_inputs(torch.float32)
    outputs = []
    for model, expected in ((plain, plain_casts), (converted, converted_casts)):
        with torch.autocast("cpu", dtype=torch.bfloat16), DispatchCounts(widths).counting() as counts:
            outputs.append(model(**inputs))
        assert len(counts.casts) == expected, counts.casts
    for key, value in outputs[0].items():  # logits, loss, ...: the dtypes plain HF returns
        if isinstance(value, torch.Tensor):
            assert outputs[1][key].dtype == value.dtype, key


def test_autocast_model_outputs_keep_hf_dtypes():
    """ViTModel's last_hidden_state and pooler output come out as torch's LayerNorm and HF's pooler give them."""
    plain = tiny_vit(transformers.ViTModel)
    converted = dres.convert_hf_vit(copy.deepcopy(plain))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(**vit_inputs(torch.float32)), converted(**vit_inputs(torch.float32))
    assert b.last_hidden_state.dtype == a.last_hidden_state.dtype == torch.float32
    assert b.pooler_output.dtype == a.pooler_output.dtype


# ---------------------------------------------------------------------------------------------
# q/k/v as one GEMM; fused-op calls per forward


@pytest.mark.parametrize("make, layers", [(tiny_vit, 3), (tiny_bert, 2)])
def test_qkv_is_one_gemm(make, layers):
    """Per layer one (D, 3D) GEMM and one (D, D) (the output projection) where the plain layer runs
    four (D, D) ones; the model's other GEMMs unchanged."""
    plain = make()
    converted = dres.convert_hf_bert(copy.deepcopy(plain)) if make is tiny_bert else dres.convert_hf_vit(
        copy.deepcopy(plain), fused_mlp=False)
    inputs = bert_inputs() if make is tiny_bert else vit_inputs(torch.float32)
    gemms = []
    for model in (plain, converted):
        with DispatchCounts().counting() as counts:
            model(**inputs)
        gemms.append(counts.gemms)
    assert gemms[0].count((32, 96)) == 0 and gemms[1].count((32, 96)) == layers
    assert gemms[0].count((32, 32)) - gemms[1].count((32, 32)) == 3 * layers


@pytest.mark.parametrize("cls_name", ["ViTForImageClassification", "DeiTForImageClassification",
                                      "Dinov2ForImageClassification", "ViTMAEForPreTraining", "BertForMaskedLM",
                                      "RobertaForMaskedLM"])
def test_state_dict_and_function_unchanged(cls_name):
    """Every HF converter keeps the state_dict's keys and values, and the function (float64 reference)."""
    original = {"ViTForImageClassification": tiny_vit, "DeiTForImageClassification": tiny_deit,
                "Dinov2ForImageClassification": tiny_dinov2, "ViTMAEForPreTraining": tiny_vit_mae,
                "BertForMaskedLM": tiny_bert, "RobertaForMaskedLM": tiny_roberta}[cls_name]().double()
    bert_like = cls_name.endswith("MaskedLM")
    convert = dres.convert_hf_bert if bert_like else dres.convert_hf_vit
    converted = convert(copy.deepcopy(original), backend="torch")
    before, after = original.state_dict(), converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    inputs = bert_inputs() if bert_like else (mae_inputs() if "MAE" in cls_name else vit_inputs())
    unused = frozenset({"dinov2.embeddings.mask_token"} if "Dinov2" in cls_name else ())
    assert_same_function(original, converted, inputs, None if bert_like else "pixel_values", F64, unused=unused)


def tiny_roberta():
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=20, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    return perturb_(transformers.RobertaForMaskedLM(config)).eval()


def test_short_attention_and_sdpa_paths_agree_with_the_plain_model(triton_device):
    """backend="triton": short attention (2 heads of 16, 5 tokens) and the fused MLP in the Triton
    interpreter; BERT with a padding mask goes to SDPA, without one to short attention."""
    original = tiny_vit(num_hidden_layers=2).to(triton_device)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="triton")
    with CallCounts() as calls:
        converted(**vit_inputs(torch.float32, triton_device))
    assert calls.counts == {"residual_layer_norm": 4, "layer_norm": 1, "fused_mlp": 2, "short_attention": 2}
    assert_same_function(original, converted, vit_inputs(torch.float32, triton_device), "pixel_values",
                         KERNEL_TOL, KERNEL_GRAD_TOL)

    bert = tiny_bert().to(triton_device)
    fused_bert = dres.convert_hf_bert(copy.deepcopy(bert), backend="triton")
    padded = bert_inputs(triton_device)
    for inputs, short_calls in ((padded, 0), ({"input_ids": padded["input_ids"]}, 2)):
        with CallCounts() as calls:
            fused_bert(**inputs)
        assert calls.counts.get("short_attention", 0) == short_calls
        embeds = {k: v for k, v in inputs.items() if k != "input_ids"}
        embeds["inputs_embeds"] = bert.bert.embeddings.word_embeddings(inputs["input_ids"]).detach()
        assert_same_function(bert, fused_bert, embeds, "inputs_embeds", KERNEL_TOL, KERNEL_GRAD_TOL)


def test_vit_mae_counts_and_short_attention(triton_device):
    """ViTMAEForPreTraining on the interpreter: the encoder's layers on short attention (the decoder's
    8-wide heads on SDPA), every MLP fused, the loss one mae_loss call; loss and gradients the plain model's."""
    original = tiny_vit_mae().to(triton_device)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="triton")
    inputs = {k: v.float().to(triton_device) for k, v in mae_inputs().items()}
    with CallCounts() as calls:
        got = converted(**inputs)
    assert calls.counts == {"residual_layer_norm": 2 * 3 + 2 * 2, "layer_norm": 2, "fused_mlp": 5,
                            "short_attention": 3, "mae_loss": 1}
    want = original(**inputs)
    torch.testing.assert_close(got.loss, want.loss, **KERNEL_TOL)
    got.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(original.named_parameters(), converted.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, **KERNEL_GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the op in the graph: on CUDA it is traced to its launch")
@pytest.mark.parametrize("which", ["vit_mae", "vit_mae_built_mask", "bert", "timm"])
def test_converted_models_compile_as_one_graph(which):
    """torch.compile(fullgraph=True) traces the one-GEMM attention, the fused MLP (kept under compile:
    its bias + GELU op in the graph) and ViTMAE's loss without a graph break (Triton interpreter), also
    where HF builds its all-True mask while tracing (torch 2.11's case: :func:`built_masks`)."""
    masks = built_masks() if which == "vit_mae_built_mask" else contextlib.nullcontext()
    which = which.removesuffix("_built_mask")
    model, inputs = {
        "vit_mae": lambda: (dres.convert_hf_vit(tiny_vit_mae(), backend="triton"), mae_inputs(torch.float32)),
        "bert": lambda: (dres.convert_hf_bert(tiny_bert(), backend="triton"), bert_inputs()),
        "timm": lambda: (dres.convert_timm_vit(timm_vit(), backend="triton"), {"x": torch.randn(2, 3, 16, 16)}),
    }[which]()
    forward_ops: list[str] = []
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(forward_ops))
    with masks:
        got = compiled(**inputs)
    assert forward_ops.count("dres.bias_gelu.default") == (5 if which == "vit_mae" else 2)  # the fused MLPs
    if which == "vit_mae":  # the eager forward's short attentions (test_vit_mae_counts_and_short_attention), not
        # SDPA behind a mask HF made while tracing (transformers 5.17 materialised an all-True one under
        # torch.compile; 5.24 makes none)
        assert forward_ops.count("dres.short_attention.default") == 3, forward_ops
    want = model(**inputs)
    for key in ("loss", "logits") if which != "timm" else ():
        if getattr(want, key, None) is not None:
            torch.testing.assert_close(getattr(got, key), getattr(want, key))
    if which == "timm":
        torch.testing.assert_close(got, want)


@contextlib.contextmanager
def built_masks():
    """HF building its bidirectional mask even without a caller's (as it does while Dynamo traces with
    torch 2.11; eager HF builds none): the mask check forced to say "keep". Yields the list of its calls."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking_utils, "_ignore_bidirectional_mask_sdpa"):
        pytest.skip("this transformers builds its masks another way")
    calls = []

    def keep_the_mask(*args, **kwargs):  # a plain function: Dynamo traces it
        calls.append(args)
        return False

    with mock.patch.object(masking_utils, "_ignore_bidirectional_mask_sdpa", keep_the_mask):
        yield calls


@pytest.mark.parametrize("which", ["vit", "vit_mae", "bert"])
def test_the_all_true_mask_hf_builds_without_a_caller_mask_is_ignored(which):
    """With no attention_mask from the caller the mask HF builds is all True: the converted attention ignores
    it (takes its unmasked path: short attention where the shape allows); a caller's padding mask reaches it.
    Outputs as the plain model's either way."""
    make, inputs = {"vit": (tiny_vit, vit_inputs()), "vit_mae": (tiny_vit_mae, mae_inputs()),
                    "bert": (tiny_bert, bert_inputs())}[which]
    plain = make().double()
    converted = dres.convert_hf_vit(copy.deepcopy(plain), backend="torch") if which != "bert" else \
        dres.convert_hf_bert(copy.deepcopy(plain), backend="torch")
    padding = inputs.pop("attention_mask", None)
    if which == "vit":  # a caller's mask of ViT's 5 tokens: sample 1 ignores its last patch
        padding = torch.ones(2, 5, dtype=torch.long)
        padding[1, 4] = 0
    from dres import convert_hf

    for mask in (None, padding) if padding is not None else (None,):
        call = dict(inputs, **({} if mask is None else {"attention_mask": mask}))
        received = []

        def recording(qkv, num_heads, backend, mask=None, dropout_p=0.0):
            received.append(mask)
            return attention_from_qkv(qkv, num_heads, backend, mask, dropout_p)

        attention_from_qkv = convert_hf.attention_from_qkv
        with built_masks() as checks, mock.patch.object(convert_hf, "attention_from_qkv", recording):
            want, got = plain(**call), converted(**call)
        assert checks  # HF built its mask for both models
        assert received and all((m is None) == (mask is None) for m in received), [type(m) for m in received]
        key = "loss" if which == "vit_mae" else "logits"
        torch.testing.assert_close(getattr(got, key), getattr(want, key), **F64)
        assert not any(m._dres_user_mask.absent for m in converted.modules() if hasattr(m, "_dres_user_mask"))


# ---------------------------------------------------------------------------------------------
# Fallbacks to the models' own code


def test_attention_probabilities_run_hf_attention():
    """output_attentions: HF's own attention (eager implementation: the probabilities come back, as
    from the plain model), no qkv GEMM."""
    original = tiny_vit(attn_implementation="eager").double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    inputs = vit_inputs()
    a, b = original(**inputs, output_attentions=True), converted(**inputs, output_attentions=True)
    torch.testing.assert_close(b.logits, a.logits, **F64)
    assert len(b.attentions) == len(a.attentions) == 3
    for x, y in zip(a.attentions, b.attentions):
        torch.testing.assert_close(y, x, **F64)
    with DispatchCounts().counting() as counts:
        converted(**inputs, output_attentions=True)
    assert (32, 96) not in counts.gemms


def test_causal_bert_keeps_hf_attention():
    """A decoder BERT (causal self-attention, caches): HF's attention, no qkv GEMM; the adds still fused."""
    original = tiny_bert(is_decoder=True)  # float32: transformers 4.x builds no float64 causal mask
    converted = dres.convert_hf_bert(copy.deepcopy(original), backend="torch")
    assert_same_function(original, converted, bert_inputs(), None, dict(rtol=1e-5, atol=1e-5))
    with DispatchCounts().counting() as counts:
        converted(**bert_inputs())
    assert (32, 96) not in counts.gemms


@pytest.mark.parametrize("make", [tiny_vit, tiny_bert])
def test_attention_dropout_in_training_keeps_function(make):
    """Active attention dropout goes to SDPA with dropout_p, as HF's SDPA path: the same draws."""
    original = make(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1).double().train()
    convert = dres.convert_hf_bert if make is tiny_bert else dres.convert_hf_vit
    converted = convert(copy.deepcopy(original), backend="torch")
    inputs = bert_inputs() if make is tiny_bert else vit_inputs()
    outputs = []
    for model in (original, converted):
        torch.manual_seed(3)
        outputs.append(model(**inputs).logits)
    torch.testing.assert_close(outputs[1], outputs[0], **F64)


@pytest.mark.parametrize("hidden_act, fused", [("gelu", 1), ("gelu_new", 1), ("gelu_pytorch_tanh", 1), ("quick_gelu", 1),
                                               ("relu", 0)])
def test_mlp_activations(hidden_act, fused):
    """erf, tanh and sigmoid (QuickGELU) GELUs run the fused MLP (each with its formula), other activations HF's MLP."""
    original = tiny_vit(hidden_act=hidden_act).double()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    with CallCounts() as calls:
        assert_same_function(original, converted, vit_inputs(), "pixel_values", F64)
    assert calls.counts.get("fused_mlp", 0) == 3 * fused


def test_fused_mlp_false_keeps_the_models_mlps():
    for model, convert, inputs in ((tiny_vit().double(), dres.convert_hf_vit, vit_inputs()),
                                   (tiny_bert().double(), dres.convert_hf_bert, bert_inputs())):
        original = copy.deepcopy(model)
        convert(model, backend="torch", fused_mlp=False)
        with CallCounts() as calls:
            assert_same_function(original, model, inputs, None, F64)
        assert "fused_mlp" not in calls.counts


# ---------------------------------------------------------------------------------------------
# CLIP and SigLIP towers


def clip_like(which: str):
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    image = dict(image_size=16, patch_size=8)
    model = {"clip_vision": lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**small, **image)),
             "clip_vision_gelu": lambda: transformers.CLIPVisionModel(
                 transformers.CLIPVisionConfig(**small, **image, hidden_act="gelu")),
             "siglip_vision": lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**small, **image)),
             "clip_text": lambda: transformers.CLIPTextModel(
                 transformers.CLIPTextConfig(**small, vocab_size=40, max_position_embeddings=16))}[which]()
    if which == "clip_text":  # float32: transformers 4.x builds no float64 causal mask
        return perturb_(model).eval(), {"input_ids": torch.randint(0, 40, (2, 7))}, dict(rtol=1e-5, atol=1e-5)
    return perturb_(model).double().eval(), {"pixel_values": torch.randn(2, 3, 16, 16, dtype=torch.float64)}, F64


@pytest.mark.parametrize("which, fused_mlps, qkv_gemms", [
    ("clip_vision", 2, 2),  # quick_gelu: the fused MLP's "quick" GELU
    ("clip_vision_gelu", 2, 2), ("siglip_vision", 2, 2),
    ("clip_text", 2, 0),  # causal: HF's attention; its quick_gelu MLPs fused
])
def test_clip_and_siglip_towers(which, fused_mlps, qkv_gemms):
    """Pre-LN towers: every add fused but the last (CLIP's post_layernorm sees the pooled token only:
    a residual_add), the first norm a layer_norm; the same outputs, gradients and state_dict."""
    original, inputs, tol = clip_like(which)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    before, after = original.state_dict(), converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    results = []
    for model in (original, converted):
        model.zero_grad(set_to_none=True)
        with CallCounts() as calls, DispatchCounts().counting() as counts:
            out = model(**inputs)
        (out.last_hidden_state.square().sum() + out.pooler_output.square().sum()).backward()
        results.append((out.last_hidden_state, out.pooler_output,
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert {k: v for k, v in calls.counts.items() if k != "LayerNorm"} == {
        "residual_layer_norm": 3, "residual_add": 1, "layer_norm": 1, **({"fused_mlp": fused_mlps} if fused_mlps else {})}
    assert counts.gemms.count((32, 96)) == qkv_gemms
    for a, b in zip(results[0][:2], results[1][:2]):
        torch.testing.assert_close(b, a, **tol)
    assert results[0][2].keys() == results[1][2].keys()
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, **tol, msg=lambda m: f"{name}: {m}")


def test_siglip_short_attention_on_the_interpreter(triton_device):
    original = clip_like("siglip_vision")[0].float().to(triton_device)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="triton")
    images = torch.randn(2, 3, 16, 16, device=triton_device)
    with CallCounts() as calls:
        got = converted(pixel_values=images)
    assert calls.counts["short_attention"] == 2 and calls.counts["fused_mlp"] == 2
    want = original(pixel_values=images)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **KERNEL_TOL)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **KERNEL_TOL)


# ---------------------------------------------------------------------------------------------
# GPT-2


def branch_input_dtypes(model: nn.Module, inputs: dict) -> list[torch.dtype]:
    """The dtypes of what each block's attention (its c_attn Conv1D) and MLP (c_fc, or the fused MLP
    that replaces it) receive in a forward."""
    dtypes = []
    hooks = [module.register_forward_pre_hook(lambda _m, args: dtypes.append(args[0].dtype))
             for block in model.transformer.h for module in (block.attn.c_attn, block.mlp.c_fc)]
    try:
        with mock.patch.object(ops, "fused_mlp", wraps=ops.fused_mlp) as fused_mlp:
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return dtypes + [call.args[0].dtype for call in fused_mlp.call_args_list]


def test_gpt2_autocast_feeds_the_branches_bf16():
    """Under bf16 autocast the normalised values reach c_attn and the MLP in bf16 (HF's LayerNorm gives
    float32, cast by each Conv1D's addmm); the logits come out in the plain model's dtype."""
    plain = tiny_gpt2()
    converted = dres.convert_hf_gpt2(copy.deepcopy(plain))
    inputs = gpt2_inputs(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert branch_input_dtypes(plain, inputs) == [torch.float32] * 2 * 3
        assert branch_input_dtypes(converted, inputs) == [torch.bfloat16] * 2 * 3
        assert converted(**inputs).logits.dtype == plain(**inputs).logits.dtype


@pytest.mark.parametrize("activation_function, fused", [("gelu_new", 1), ("gelu", 1), ("gelu_pytorch_tanh", 1),
                                                        ("quick_gelu", 1), ("relu", 0)])
def test_gpt2_mlp_activations(activation_function, fused):
    """GELUs (exact, tanh and QuickGELU) run the fused MLP with their formula, other activations HF's GPT2MLP;
    fused_mlp=False keeps HF's always."""
    original = tiny_gpt2(activation_function=activation_function).double()
    for fused_mlp, calls_per_block in ((True, fused), (False, 0)):
        converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="torch", fused_mlp=fused_mlp)
        with CallCounts() as calls:
            assert_same_function(original, converted, gpt2_inputs(original), "inputs_embeds", F64)
        assert calls.counts.get("fused_mlp", 0) == 3 * calls_per_block


def test_gpt2_set_backend_reaches_the_blocks():
    model = dres.nn.set_backend(dres.convert_hf_gpt2(tiny_gpt2(), backend="torch"), "triton")
    fused = [m for m in model.modules() if getattr(m, "_dres_fused", False)]
    assert fused == list(model.transformer.h) and all(m.backend == "triton" for m in fused)


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the op in the graph: on CUDA it is traced to its launch")
def test_converted_gpt2_compiles_as_one_graph():
    """torch.compile(fullgraph=True) traces the carry around HF's attention and the Conv1D weights'
    fused MLP (its bias + GELU op in the graph) without a graph break (Triton interpreter)."""
    model = dres.convert_hf_gpt2(tiny_gpt2(n_layer=2), backend="triton")
    inputs = gpt2_inputs(model)
    forward_ops: list[str] = []
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend(forward_ops))
    got = compiled(**inputs).logits
    assert forward_ops.count("dres.bias_gelu.default") == 2
    torch.testing.assert_close(got, model(**inputs).logits)


# ---------------------------------------------------------------------------------------------
# ViTMAE's loss


def tiny_mae_of(**kw):
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, decoder_hidden_size=16, decoder_num_hidden_layers=1,
                decoder_num_attention_heads=2, decoder_intermediate_size=32, mask_ratio=0.5)
    return perturb_(transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**{**args, **kw}))).double().eval()


@pytest.mark.parametrize("kw, shape, interpolate", [
    ({}, (2, 3, 16, 16), False),
    ({"norm_pix_loss": True}, (2, 3, 16, 16), False),
    ({"num_channels": 1, "norm_pix_loss": True}, (2, 1, 16, 16), False),
    ({"norm_pix_loss": True}, (2, 3, 16, 24), True),  # non-square, interpolated position embeddings
])
def test_mae_loss_is_hfs(kw, shape, interpolate):
    original = tiny_mae_of(**kw)
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="torch")
    inputs = {**mae_inputs(shape=shape), "interpolate_pos_encoding": interpolate}
    with CallCounts() as calls:
        got = converted(**inputs)
    assert calls.counts["mae_loss"] == 1
    want = original(**inputs)
    torch.testing.assert_close(got.loss, want.loss, **F64)
    torch.testing.assert_close(got.logits, want.logits, **F64)
    if not hasattr(type(original), "forward_loss"):  # transformers 5: the converter writes the forward anew
        assert converted(**inputs, return_dict=False)[0] == got.loss  # return_dict as HF takes it


def test_mae_loss_refuses_what_hf_refuses():
    converted = dres.convert_hf_vit(tiny_mae_of(), backend="torch")
    pred, mask = torch.randn(2, 16, 48, dtype=torch.float64), torch.ones(2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="squared size"):
        converted.forward_loss(torch.randn(2, 3, 16, 20, dtype=torch.float64), pred, mask)


# ---------------------------------------------------------------------------------------------
# timm


def timm_vit(**kw):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return perturb_(VisionTransformer(**{**args, **kw})).eval()


def timm_outputs_and_grads(model, imgs):
    imgs = imgs.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(imgs)
    out.square().sum().backward()
    return out.detach(), imgs.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_timm_same(original, converted, imgs, tol, grad_tol):
    (out_a, din_a, grads_a), (out_b, din_b, grads_b) = (timm_outputs_and_grads(original, imgs),
                                                        timm_outputs_and_grads(converted, imgs))
    torch.testing.assert_close(out_b, out_a, **tol)
    torch.testing.assert_close(din_b, din_a, **grad_tol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **grad_tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kw, fused", [({}, 2), ({"act_layer": "gelu_tanh"}, 2), ({"act_layer": "quick_gelu"}, 2),
                                       ({"act_layer": "relu"}, 0)])
def test_timm_vit_mlp_and_attention_paths(kw, fused):
    original = timm_vit(**kw).double()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    before, after = original.state_dict(), converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with CallCounts() as calls:
        assert_timm_same(original, converted, torch.randn(2, 3, 16, 16, dtype=torch.float64), F64, F64)
    assert calls.counts.get("fused_mlp", 0) == fused
    with DispatchCounts().counting() as counts:
        converted(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert counts.gemms.count((32, 96)) == 2  # timm's qkv Linear: already one GEMM


@pytest.mark.parametrize("which", ["dinov2", "eva"])
def test_timm_dinov2_and_eva_paths(which):
    """DINOv2 (LayerScale, register tokens): both branches fused; Eva: its GELU Mlp fused, its rotary
    EvaAttention (and a SwiGLU MLP) its own. Same function, same state_dict."""
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, init_values=0.1)
    original = perturb_(VisionTransformer(**args, reg_tokens=4, no_embed_class=True) if which == "dinov2" else
                        Eva(**args, use_rot_pos_emb=True, ref_feat_shape=(2, 2))).double().eval()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    before, after = original.state_dict(), converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with CallCounts() as calls:
        assert_timm_same(original, converted, torch.randn(2, 3, 16, 16, dtype=torch.float64), F64, F64)
    assert calls.counts["fused_mlp"] == 2
    with DispatchCounts().counting() as counts:
        converted(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert counts.gemms.count((32, 96)) == 2  # the qkv Linear, whichever attention runs
    swiglu = dres.convert_timm_vit(Eva(**args, swiglu_mlp=True).double(), backend="torch")
    with CallCounts() as calls:
        swiglu(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert "fused_mlp" not in calls.counts


def test_timm_vit_short_attention_on_the_interpreter(triton_device):
    original = timm_vit().to(triton_device)
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="triton")
    imgs = torch.randn(2, 3, 16, 16, device=triton_device)
    with CallCounts() as calls:
        converted(imgs)
    assert calls.counts == {"residual_layer_norm": 3, "layer_norm": 1, "residual_add": 1, "fused_mlp": 2,
                            "short_attention": 2}
    assert_timm_same(original, converted, imgs, KERNEL_TOL, KERNEL_GRAD_TOL)


def test_timm_dropout_and_fused_mlp_false_take_timms_code():
    """Attention dropout in training: timm's attention; dropout between the MLP's Linears: timm's MLP;
    fused_mlp=False: timm's MLP always. The same draws, so the same outputs."""
    original = timm_vit(attn_drop_rate=0.2, proj_drop_rate=0.2).double().train()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="torch")
    outputs = []
    for model in (original, converted):
        torch.manual_seed(4)
        with CallCounts() as calls:
            outputs.append(model(torch.randn(2, 3, 16, 16, dtype=torch.float64)))
    torch.testing.assert_close(outputs[1], outputs[0], **F64)
    assert "fused_mlp" not in calls.counts
    model = dres.convert_timm_vit(timm_vit().double(), backend="torch", fused_mlp=False)
    with CallCounts() as calls:
        model(torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert "fused_mlp" not in calls.counts


aten = torch.ops.aten
# the patch embedding as one GEMM of the patches (dres.nn.embed), where the plain model runs a convolution and its
# backward: a copy of the patches, the GEMM, its two gradient GEMMs and bias sum, against two ops
PATCHES_AS_A_GEMM = 4 - 2


@pytest.mark.parametrize("which", ["timm_dinov2", "clip_vision"])
def test_a_launch_bound_eager_step_does_no_more_than_the_plain_models(monkeypatch, which):
    """The eager rule's path (a launch-bound model without the csrc extension: formulas, the plain MLP, SDPA;
    forced here on the CPU): the converted model's forward and backward under bf16 autocast run no more ops than the
    plain model's (the patch embedding aside), and no more multiplies, adds or casts: alphas of one multiply nothing."""
    rule = lambda backend, x, parts=1: backend is None  # noqa: E731  every call launch-bound, as on such a GPU
    for module in (dres.ops.checks, dres.ops.bias_gelu, dres.nn.transformer):
        monkeypatch.setattr(module, "takes_pytorch_formula", rule)
    if which == "timm_dinov2":
        original = timm_vit(init_values=0.1, reg_tokens=4, no_embed_class=True)
        convert, inputs, output = dres.convert_timm_vit, torch.randn(2, 3, 16, 16), lambda out: out
    else:
        original, _, _ = clip_like("clip_vision")
        original = original.float()
        convert, inputs, output = dres.convert_hf_vit, torch.randn(2, 3, 16, 16), lambda out: out.pooler_output
    counts = []
    for model in (original, convert(copy.deepcopy(original))):
        with LaunchCounts() as launches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = output(model(inputs)).float().square().mean()
            loss.backward()
        counts.append(launches.counts)
    plain, converted = counts
    assert sum(converted.values()) - PATCHES_AS_A_GEMM <= sum(plain.values())
    for op in (aten.mul.Tensor, aten.add.Tensor, aten._to_copy.default):
        assert converted[op] <= plain[op], op


# ---------------------------------------------------------------------------------------------
# GPU: bf16 autocast training step of the converted models against the plain ones


def bf16_step(model, inputs: dict, loss_of):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(model(**inputs))
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def assert_bf16_close(original, converted, inputs, loss_of):
    """Loss and gradients of the converted model (bf16 autocast, the Triton kernels: converted with
    backend="triton", as launch-bound models this small take PyTorch's ops by default) within bf16's
    rounding of the plain model's: each gradient's error relative to its largest element, or to a hundredth of
    the model's largest where its own is rounding alone (a key bias's gradient is zero in exact arithmetic:
    softmax ignores what it adds to a row)."""
    loss_a, grads_a = bf16_step(original, inputs, loss_of)
    loss_b, grads_b = bf16_step(converted, inputs, loss_of)
    torch.testing.assert_close(loss_b, loss_a, rtol=2e-2, atol=2e-2)
    assert grads_a.keys() == grads_b.keys()
    floor = max(a.abs().max() for a in grads_a.values()) / 100
    for name, a in grads_a.items():
        scale = torch.maximum(a.abs().max(), floor).clamp_min(1e-6)
        assert (grads_b[name] - a).abs().max() / scale < 5e-2, name


@pytest.mark.gpu
def test_gpu_bf16_hf_vit_mae():
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=512, decoder_hidden_size=64,
                                       decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
                                       decoder_intermediate_size=256, norm_pix_loss=True)
    original = transformers.ViTMAEForPreTraining(config).cuda().train()
    converted = dres.convert_hf_vit(copy.deepcopy(original), backend="triton")  # launch-bound: None takes PyTorch's
    inputs = {"pixel_values": torch.randn(4, 3, 64, 64, device="cuda"), "noise": torch.rand(4, 64, device="cuda")}
    with CallCounts() as calls:
        assert_bf16_close(original, converted, inputs, lambda out: out.loss)
    assert calls.counts["short_attention"] == 4 and calls.counts["fused_mlp"] == 4 and calls.counts["mae_loss"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("stream_dtype", [None, torch.bfloat16])
def test_gpu_bf16_timm_vit(stream_dtype):
    """Under bf16 autocast the converted timm ViT trains as the plain model does, its residual stream float32 or, with
    stream_dtype, carried in bf16 by the kernels."""
    original = timm_vit(img_size=64, embed_dim=128, depth=2).cuda().train()
    converted = dres.convert_timm_vit(copy.deepcopy(original), backend="triton", stream_dtype=stream_dtype)
    inputs = {"x": torch.randn(4, 3, 64, 64, device="cuda")}
    streams = []
    converted.blocks.register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    with CallCounts() as calls:
        assert_bf16_close(original, converted, inputs, lambda out: out.float().square().mean())
    assert calls.counts["short_attention"] == 2 and calls.counts["fused_mlp"] == 2
    assert set(streams) == {stream_dtype or torch.float32}


@pytest.mark.gpu
def test_gpu_bf16_hf_dinov2_compiled_with_its_layer_scales_folded():
    """Compiled by Inductor, the converted HF DINOv2 (each LayerScale folded into o_proj and fc2) trains in bf16
    as the plain model does eagerly."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(image_size=56, patch_size=14, hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, mlp_ratio=4, layerscale_value=0.5, num_labels=5)
    original = transformers.Dinov2ForImageClassification(config).cuda().train()
    converted = dres.convert_hf_vit(copy.deepcopy(original))
    assert all(layer._dres_layer_scale_folded for layer in converted.dinov2.encoder.layer)
    torch._dynamo.reset()
    converted.forward = torch.compile(converted.forward)  # the module's parameter names stay
    inputs = {"pixel_values": torch.randn(4, 3, 56, 56, device="cuda"), "labels": torch.randint(0, 5, (4,), device="cuda")}
    assert_bf16_close(original, converted, inputs, lambda out: out.loss)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [256, 257])
def test_gpu_bf16_hf_gpt2(vocab):
    """GPT2LMHeadModel's language-model loss in training (dropout off: the draws differ between the
    paths' kernels); greedy generation in float32 with the kernels and the cache: each step's logits
    those of the plain model run on the generated sequence at once. An unaligned vocabulary (257): the head on
    padded rows (AlignedLinear), in training and generation."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=128, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)
    original = transformers.GPT2LMHeadModel(config).cuda().train()
    converted = dres.convert_hf_gpt2(copy.deepcopy(original), backend="triton")
    assert (type(converted.lm_head) is AlignedLinear) == (vocab % 8 != 0)
    ids = torch.randint(1, 256, (4, 48), device="cuda")
    with CallCounts() as calls:
        assert_bf16_close(original, converted, {"input_ids": ids, "labels": ids}, lambda out: out.loss)
    assert calls.counts["fused_mlp"] == 2 and calls.counts["residual_layer_norm"] == 2 * 2
    generated = converted.eval().generate(ids[:, :6], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                          output_logits=True, return_dict_in_generate=True)
    want = original.eval()(generated.sequences).logits[:, 5:-1]  # the logits that chose tokens 6..13
    torch.testing.assert_close(torch.stack(generated.logits, 1), want, **KERNEL_GRAD_TOL)
