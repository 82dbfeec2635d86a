"""dres-export: a dres ViT classifier or MAE written for timm, Hugging Face and safetensors, loaded back by
each library, computes what the dres model computes; what a format cannot express is one line naming it."""

import pytest
import torch

from dres.export import ExportError, export_model
from dres.train.export import main
from tiny_models import tiny_classifier, tiny_mae

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IMGS = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _perturbed(model):
    """Every parameter away from its initial value (zero-initialised ends, unit norms), so that a weight in the
    wrong place shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_classifier_to_timm_and_hf(tmp_path, gelu):
    model = _perturbed(tiny_classifier(num_classes=5, gelu_approximate=gelu))
    expected = model(IMGS)
    export_model(model, "timm", tmp_path / "timm")
    vit = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    torch.testing.assert_close(vit(IMGS), expected, rtol=1e-5, atol=1e-5)
    export_model(model, "hf", tmp_path / "hf")
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf(pixel_values=IMGS).logits, expected, rtol=1e-5, atol=1e-5)
    base = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    torch.testing.assert_close(base(pixel_values=IMGS).last_hidden_state, model.encoder(IMGS)[0], rtol=1e-5,
                               atol=1e-5)


def test_mae_to_hf_pretraining_and_its_encoder_to_timm(tmp_path):
    model = _perturbed(tiny_mae(norm_pix_loss=True))
    noise = torch.rand(3, 4, generator=torch.Generator().manual_seed(2))
    loss, pred, mask = model(IMGS, noise=noise)
    export_model(model, "hf", tmp_path / "hf")
    hf = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path / "hf").eval()
    out = hf(pixel_values=IMGS, noise=noise)
    torch.testing.assert_close(out.mask, mask)
    torch.testing.assert_close(out.logits, pred, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    export_model(model, "timm", tmp_path / "timm")
    vit = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    torch.testing.assert_close(vit.forward_features(IMGS), model.encoder(IMGS)[0], rtol=1e-5, atol=1e-5)


def test_safetensors_keeps_every_variant_and_its_alphas(tmp_path):
    model = _perturbed(tiny_mae(variant="official", alpha_min=0.6))
    noise = torch.rand(3, 4, generator=torch.Generator().manual_seed(3))
    export_model(model, "safetensors", tmp_path / "st")
    path = tmp_path / "st" / "model.safetensors"
    fresh = tiny_mae(variant="official", alpha_min=0.6).eval()
    fresh.load_state_dict(safetensors_torch.load_file(path), strict=True)
    for got, want in zip(fresh(IMGS, noise=noise), model(IMGS, noise=noise)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["dres_model"] == "MAE" and min(eval(meta["dres_alphas"])) == pytest.approx(0.6)


@pytest.mark.parametrize("model, to, message", [
    (lambda: tiny_mae(variant="official"), "hf", r"variant 'official' has skip layers"),
    (lambda: tiny_mae(variant="paper"), "hf", r"variant 'paper' has skip layers"),
    (lambda: tiny_classifier(global_pool="avg"), "hf", r"global_pool='avg'"),
    (lambda: tiny_classifier(alpha_min=0.6), "hf", r"decayed shortcuts \(alphas down to 0\.6\)"),
    (lambda: tiny_classifier(alpha_min=0.6), "timm", r"timm's config cannot express"),
    (lambda: torch.nn.Linear(2, 2), "safetensors", r"^model: expected a dres ViTClassifier or MAE, got Linear$"),
    (lambda: tiny_classifier(), "onnx", r"^to: expected one of timm, hf, safetensors, got 'onnx'$"),
])
def test_what_a_format_cannot_express_is_refused_in_one_line(tmp_path, model, to, message):
    with pytest.raises(ExportError, match=message) as caught:
        export_model(model(), to, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_command_exports_a_run_and_refuses_in_one_line(tmp_path, capsys):
    from dres.train import cli

    run = tmp_path / "run"
    tiny = ["data.name=synthetic", "data.img_size=8", "model.img_size=8", "model.patch_size=4", "model.embed_dim=32",
            "model.depth=1", "model.num_heads=2", "batch_size=4", "steps=1", "log.progress=false",
            "log.tensorboard=false", "device=cpu"]
    assert cli.main(["classify", "--preset", "classify_cifar10", "--out", str(run)]
                    + [a for kv in tiny for a in ("--set", kv)]) == 0
    capsys.readouterr()
    assert main([str(run), "--to", "timm"]) == 0
    assert capsys.readouterr().out.strip() == f"dres-export: wrote {run / 'export' / 'timm'}"
    vit = timm.create_model(f"local-dir:{run / 'export' / 'timm'}", pretrained=True).eval()
    from dres.train.export import load_run

    model, _, _ = load_run(run)
    torch.testing.assert_close(vit(IMGS), model(IMGS), rtol=1e-5, atol=1e-5)

    assert main([str(run), "--to", "timm"]) == 2  # the folder now holds the first export
    assert capsys.readouterr().err.splitlines() == [
        f"dres-export: error: out: {run / 'export' / 'timm'} already exists and is not an empty folder"]
    assert main([str(tmp_path), "--to", "hf"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dres-export: error: {tmp_path} is neither a dres run folder nor a checkpoint inside one (no config.yaml)"]
