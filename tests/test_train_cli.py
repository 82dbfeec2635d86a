"""Config, presets and the command line (CPU): quickstart end to end, every preset resolves and
builds its model, one-line errors for bad input, U-ViT and classification tasks run."""

import json
import re
import subprocess
import sys
from unittest import mock

import pytest
import yaml

from dres.train import cli
from dres.train.config import ConfigError, build_config, list_presets

PRESETS = ["classify_cifar10", "mae_cifar10", "mae_vit_b16_in1k", "mae_vit_l16_in1k", "mae_vit_h14_in1k",
           "mae_vit_s16_in100", "quickstart",
           "uvit_cifar10", "uvit_m_in64", "uvit_s2_cifar10"]


def test_presets_listed_and_resolve():
    assert set(PRESETS) <= set(list_presets())
    for p in PRESETS:
        cfg = build_config(None, p)
        assert cfg.task in ("mae", "uvit", "classify") and cfg.preset == p
        assert cfg.model.img_size == cfg.data.img_size


@pytest.mark.parametrize("preset", ["mae_vit_b16_in1k", "mae_vit_l16_in1k", "uvit_s2_cifar10", "classify_cifar10"])
def test_preset_models_build_with_paper_sizes(preset):
    cfg = build_config(None, preset)
    model = cli.get_task(cfg.task).build_model(cfg)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    expected = {"mae_vit_b16_in1k": (100, 140), "mae_vit_l16_in1k": (320, 350), "uvit_s2_cifar10": (40, 50),
                "classify_cifar10": (4, 6)}[preset]
    assert expected[0] < n < expected[1], n


def test_overrides_coerce_types_and_reject_unknown_keys():
    cfg = build_config("mae", "quickstart", ["optim.blr=1e-3", "model.depth=6", "compile=true",
                                             "optim.betas=[0.9, 0.99]", "data.mean=[0.5]"])
    assert cfg.optim.blr == 1e-3 and cfg.model.depth == 6 and cfg.compile is True
    assert cfg.optim.betas == [0.9, 0.99]
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.blrr' \(did you mean 'blr'\?\)"):
        build_config("mae", "quickstart", ["optim.blrr=1"])
    with pytest.raises(ConfigError, match="expects an integer"):
        build_config("mae", "quickstart", ["model.depth=abc"])
    with pytest.raises(ConfigError, match="must be one of"):
        build_config("mae", "quickstart", ["dist=zero3"])
    with pytest.raises(ConfigError, match="unknown preset 'quickstrat'.*did you mean 'quickstart'"):
        build_config("mae", "quickstrat")
    with pytest.raises(ConfigError, match="is for task 'mae'"):
        build_config("uvit", "quickstart")


def test_compile_scope_is_blocks_or_model_and_blocks_under_fsdp():
    # auto: the whole model on one GPU and under DDP (measured faster), per block under FSDP2 and with checkpointing
    assert build_config("mae", "quickstart").compile_scope == "model"
    assert build_config("mae", "quickstart", ["dist=ddp"]).compile_scope == "model"
    assert build_config("mae", "quickstart", ["dist=fsdp"]).compile_scope == "blocks"
    for dist in ("none", "ddp"):
        assert build_config("mae", "quickstart", [f"dist={dist}", "act_ckpt=full"]).compile_scope == "blocks"
    assert build_config("mae", "quickstart", ["compile=true", "compile_scope=model"]).compile_scope == "model"
    with pytest.raises(ConfigError, match="config key 'compile_scope' must be one of auto, blocks, model"):
        build_config("mae", "quickstart", ["compile_scope=graph"])
    with pytest.raises(ConfigError, match="config key 'compile_scope' must be blocks under dist=fsdp"):
        build_config("mae", "quickstart", ["compile_scope=model", "dist=fsdp"])


def test_model_gelu_approximate_reaches_every_mlp_and_is_checked():
    """model.gelu_approximate picks the GELU of every MLP of each task's ViT; a bad value is one line
    naming the key; a run recorded before the key existed used the exact GELU."""
    from dres.nn import Mlp
    from dres.train.rundir import fingerprint, fingerprint_diff

    tiny = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.gelu_approximate=tanh"]
    for task, preset in (("mae", "quickstart"), ("uvit", "uvit_cifar10"), ("classify", "classify_cifar10")):
        cfg = build_config(task, preset, tiny)
        acts = [m.act.approximate for m in cli.get_task(task).build_model(cfg).modules() if isinstance(m, Mlp)]
        assert acts and set(acts) == {"tanh"}, (task, acts)
    with pytest.raises(ConfigError, match=r"^config key 'model.gelu_approximate' must be one of none, tanh; "
                                          r"got 'erf'$"):
        build_config("mae", "quickstart", ["model.gelu_approximate=erf"])
    erf, tanh = build_config("mae", "quickstart"), build_config("mae", "quickstart", ["model.gelu_approximate=tanh"])
    before = {k: v for k, v in fingerprint(erf).items() if k != "model.gelu_approximate"}
    assert fingerprint_diff(before, fingerprint(erf)) == ""
    assert fingerprint_diff(before, fingerprint(tanh)) == "model.gelu_approximate 'none' (saved) vs 'tanh' (now)"


def test_apply_compile_scopes_count_their_regions():
    from dres.train import distributed
    from dres.train.mae import TASK

    cfg = build_config("mae", "quickstart")
    whole, per_block = TASK.build_model(cfg), TASK.build_model(cfg)
    assert distributed.apply_compile(whole, "model") == 1 and whole._compiled_call_impl is not None
    assert not any(getattr(m, "_compiled_call_impl", None) for m in whole.modules() if m is not whole)
    n = distributed.apply_compile(per_block)
    assert n == len(per_block.compile_units()) > 1 and per_block._compiled_call_impl is None
    assert all(u._compiled_call_impl is not None for u in per_block.compile_units())


@pytest.mark.parametrize("args,msg", [
    (["mae", "--preset", "nope"], "unknown preset 'nope'"),
    (["mae", "--preset", "quickstart", "--set", "model.wat=1"], "unknown config key 'model.wat'"),
    (["mae", "--preset", "quickstart", "--set", "model.attn_impl=flash"], "unknown config key 'model.attn_impl'"),
    (["mae", "--preset", "mae_vit_b16_in1k"], "no training data path"),
    (["mae", "--preset", "mae_cifar10", "--set", "data.path=/nonexistent/cifar"], "data path not found: /nonexistent/cifar"),
    (["mae", "--preset", "quickstart", "--set", "batch_size=100", "--set", "accum_steps=3"], "cannot be split"),
    # each of these was once a traceback
    (["mae"], "no --preset given: one of"),
    (["mae", "--preset", "quickstart", "--set", "steps=-5"], "config key 'steps' must be >= 0"),
    (["mae", "--preset", "quickstart", "--set", "batch_size=0"], "config key 'batch_size' must be a positive integer"),
    (["mae", "--preset", "quickstart", "--set", "model.patch_size=5"], "'model.patch_size' must divide model.img_size (16)"),
    (["mae", "--preset", "quickstart", "--set", "model.num_heads=3"], "'model.num_heads' must divide model.embed_dim (64)"),
    (["mae", "--preset", "quickstart", "--set", "model.alpha_min=-3"], "'model.alpha_min' must be in (0, 1]"),
    (["mae", "--preset", "quickstart", "--set", "model.alpha_min=1.5"], "'model.alpha_min' must be in (0, 1]"),
    (["classify", "--preset", "classify_cifar10", "--set", "data.name=digits", "--set", "data.num_classes=5",
      "--set", "model.num_classes=5", "--set", "data.img_size=8", "--set", "model.img_size=8", "--set", "data.in_chans=1",
      "--set", "model.in_chans=1", "--set", "data.mean=[0.5]", "--set", "data.std=[0.25]"],
     "range over [0, 9] but data.num_classes=5"),
])
def test_cli_bad_input_is_one_line_error(args, msg, capsys, tmp_path):
    assert cli.main(args + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def _bad_values():
    """(key, value, message) for values each key must refuse: NaN, infinities, zero, negatives."""
    qs = ["mae", "--preset", "quickstart", "--set"]
    cases = [
        ("optim.weight_decay", "-0.1", "'optim.weight_decay' must be >= 0; got -0.1"),
        ("optim.weight_decay", ".nan", "'optim.weight_decay' must be a finite number; got nan"),
        ("optim.weight_decay", "inf", "'optim.weight_decay' must be a finite number; got inf"),
        ("optim.clip_grad", ".nan", "'optim.clip_grad' must be a finite number; got nan"),
        ("optim.clip_grad", "-1", "'optim.clip_grad' must be >= 0 (0: off); got -1.0"),
        ("optim.lr", "-1e-3", "'optim.lr' must be >= 0 (0: from optim.blr); got -0.001"),
        ("optim.lr", "-.inf", "'optim.lr' must be a finite number; got -inf"),
        ("optim.blr", ".nan", "'optim.blr' must be a finite number; got nan"),
        ("optim.blr", "0", "'optim.blr' must be positive unless optim.lr is (optim.lr is 0); got 0.0"),
        ("optim.eps", "0", "'optim.eps' must be positive; got 0.0"),
        ("optim.eps", "NaN", "'optim.eps' must be a finite number; got nan"),
        ("optim.min_lr", "-1e-6", "'optim.min_lr' must be >= 0; got -1e-06"),
        ("optim.betas", "[0.9, .nan]", "'optim.betas' must be a finite number; got nan"),
        ("optim.betas", "[a, b]", "'optim.betas' expects a list of numbers, got 'a'"),
        ("model.mlp_ratio", "inf", "'model.mlp_ratio' must be a finite number; got inf"),
        ("model.mlp_ratio", "0", "'model.mlp_ratio' must be positive; got 0.0"),
        ("model.embed_dim", "0", "'model.embed_dim' must be a positive integer; got 0"),
        ("model.depth", "1e400", "'model.depth' must be a finite number; got inf"),
        ("data.std", "[0.2, .inf, 0.2]", "'data.std' must be a finite number; got inf"),
        ("eval.probe_lr", "-1", "'eval.probe_lr' must be positive; got -1.0"),
        ("eval.knn_k", "0", "'eval.knn_k' must be a positive integer; got 0"),
        ("data.num_workers", "-2", "'data.num_workers' must be >= 0, or -1 (by the decode); got -2"),
        ("data.hw_decode_load", "1.5", "'data.hw_decode_load' must be in [0, 1], or -1 (the decoder's own); got 1.5"),
        ("data.hw_decode_load", "-0.5", "'data.hw_decode_load' must be in [0, 1], or -1 (the decoder's own); got -0.5"),
        ("data.cpu_decode_share", "1.5", "'data.cpu_decode_share' must be in [0, 1], or -1 (by the cores); got 1.5"),
        ("threads", "-1", "'threads' must be >= 0"),
        ("seed", "-1", "'seed' must be >= 0; got -1"),
        ("compile", "1", "'compile' expects true/false, got 1"),
        ("data.finish_threads", "0", "'data.finish_threads' must be a positive integer, and 1 with "
                                     "data.finish_ahead=0 (the step's own thread finishes each batch); got 0"),
    ]
    threads_without_ahead = pytest.param(
        qs + ["data.finish_ahead=0", "--set", "data.finish_threads=2"], "'data.finish_threads' must be a positive "
        "integer, and 1 with data.finish_ahead=0 (the step's own thread finishes each batch); got 2",
        id="data.finish_threads=2,data.finish_ahead=0")
    return [pytest.param(qs + [f"{k}={v}"], m, id=f"{k}={v}") for k, v, m in cases] + [threads_without_ahead]


@pytest.mark.parametrize("args,msg", _bad_values())
def test_every_bad_config_value_is_one_line_naming_its_key(args, msg, capsys, tmp_path):
    assert cli.main(args + ["--out", str(tmp_path / "run"), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"dres-train: error: config key {msg}" in err and len(err.splitlines()) == 1, err


def test_zero_weight_decay_and_clip_grad_are_allowed_and_yaml_exponents_are_numbers(tmp_path):
    cfg = build_config("mae", "quickstart", ["optim.weight_decay=0", "optim.clip_grad=0", "optim.lr=0"])
    assert (cfg.optim.weight_decay, cfg.optim.clip_grad, cfg.optim.lr) == (0.0, 0.0, 0.0)
    preset = tmp_path / "mine.yaml"
    preset.write_text("task: mae\noptim: {blr: 1e-3, min_lr: 1E-6, weight_decay: 5e-2}\nmodel: {depth: 2e0}\n"
                      "data: {path: 1e5}\n")
    assert yaml.safe_load(preset.read_text())["optim"]["blr"] == "1e-3"  # a string to PyYAML
    cfg = build_config("mae", str(preset))
    assert (cfg.optim.blr, cfg.optim.min_lr, cfg.optim.weight_decay, cfg.model.depth) == (1e-3, 1e-6, 0.05, 2)
    assert cfg.data.path == "1e5"  # a text key keeps the text
    assert build_config("mae", "quickstart", ["data.path=1e5"]).data.path == "1e5"
    with pytest.raises(ConfigError, match=r"config key 'optim.blr' expects a number, got 'fast'"):
        build_config("mae", "quickstart", ["optim.blr=fast"])


@pytest.mark.parametrize("make,msg", [
    (lambda p: p.mkdir(), "{p} is a directory, not a YAML file"),
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"), "{p} is a binary file, not a YAML text file"),
    (lambda p: p.write_bytes(b"task: mae\x00\n"), "{p} is a binary file, not a YAML text file"),
    (lambda p: p.write_text(""), "preset {p} is empty"),
    (lambda p: p.write_text("# nothing but a comment\n"), "preset {p} is empty"),
    (lambda p: None, "preset file not found: {p}"),
], ids=["directory", "binary", "nul", "empty", "comment-only", "missing"])
def test_bad_preset_paths_are_one_line_each(make, msg, tmp_path, capsys):
    for name in ("preset.yaml", "preset"):
        p = tmp_path / name
        make(p)
        assert cli.main(["mae", "--preset", str(p), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert f"dres-train: error: {msg.format(p=p)}" in err and len(err.splitlines()) == 1, err


def test_malformed_preset_yaml_is_one_line_error_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: mae\nmodel: {depth: 2, embed_dim: [\n")
    assert cli.main(["mae", "--preset", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad} is not valid YAML at line" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match="not valid YAML"):
        cli.main(["mae", "--preset", str(bad), "--debug"])
    with mock.patch.dict("os.environ", {"DRES_DEBUG": "1"}), pytest.raises(ConfigError, match="not valid YAML"):
        cli.main(["mae", "--preset", str(bad)])


def test_quickstart_end_to_end(tmp_path):
    """The README's main command: a decayed MAE on the digits, probe accuracy well above chance."""
    out = tmp_path / "qs"
    r = subprocess.run([sys.executable, "-m", "dres.train.mae", "--preset", "quickstart", "--out", str(out),
                        "--set", "log.progress=false"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "linear_probe_acc" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["eval"]["linear_probe_acc"]
    assert acc > 0.5, summary  # chance is 0.1 (10 digit classes)
    assert summary["eval"]["knn_acc"] > 0.3
    assert (out / summary["eval"]["recon_png"].split("/")[-1]).stat().st_size > 0
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["alpha_min"] == 0.6
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    # --eval-only reloads the newest checkpoint and reproduces the probe, in eval.json (summary.json stays)
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(out), "--eval-only", "--set", "eval.recon=false"]) == 0
    evaluated = json.loads((out / "eval.json").read_text())
    assert abs(evaluated["eval"]["linear_probe_acc"] - acc) < 1e-6 and evaluated["eval_wall_s"] > 0
    assert json.loads((out / "summary.json").read_text()) == summary


TINY_UVIT = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.mean=[0.5]", "data.std=[0.5]",
             "data.aug=none", "model.img_size=8", "model.patch_size=2", "model.in_chans=1", "model.embed_dim=32",
             "model.depth=2", "model.num_heads=2", "batch_size=32", "steps=6", "optim.warmup_steps=2",
             "log.progress=false", "log.tensorboard=false", "eval.steps=4", "eval.n_samples=8",
             "eval.probe_epochs=2", "eval.max_train=256", "eval.max_test=64", "model.drop_path=0.2",
             "model.droppath_mode=residual_droppath"]


def test_uvit_task_trains_with_ema_samples_and_probes(tmp_path, capsys):
    assert cli.main(["uvit", "--preset", "uvit_cifar10", "--out", str(tmp_path), "--set", "compile=false"] +
                    sum([["--set", o] for o in TINY_UVIT], [])) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / s["eval"]["samples_png"].split("/")[-1]).exists()
    assert 0.0 <= s["eval"]["probe_t0.1_linear_probe_acc"] <= 1.0
    assert 0 < s["eval_wall_s"] and s["wall_s"] > 0  # the final evaluation's time apart from training's
    assert "FID skipped: no Inception weights given" in capsys.readouterr().out


def test_classify_task_learns_digits(tmp_path):
    ovr = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.mean=[0.3]", "data.std=[0.4]",
           "data.aug=none", "model.img_size=8", "model.patch_size=4", "model.in_chans=1", "model.embed_dim=32",
           "model.depth=2", "model.num_heads=2", "batch_size=64", "steps=60", "optim.warmup_steps=5",
           "log.progress=false", "log.tensorboard=false", "compile=false", "act_ckpt=selective"]
    assert cli.main(["classify", "--preset", "classify_cifar10", "--out", str(tmp_path)] +
                    sum([["--set", o] for o in ovr], [])) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["eval"]["top1"] > 0.5  # chance 0.1


def test_dres_eval_writes_eval_json_and_keeps_the_training_summary(tmp_path):
    """dres-eval once overwrote the training summary.json."""
    out = tmp_path / "run"
    tiny = ["data.img_size=8", "model.img_size=8", "model.patch_size=4", "model.embed_dim=32", "model.depth=1",
            "model.num_heads=2", "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2",
            "batch_size=32", "steps=2", "log.progress=false", "log.tensorboard=false", "eval.probe=false",
            "eval.knn=false", "eval.recon=false"]
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(out)] + sum([["--set", o] for o in tiny], [])) == 0
    summary = (out / "summary.json").read_text()
    config = (out / "config.yaml").read_text()
    assert cli.eval_main([str(out), "--set", "eval.feature=cls"]) == 0
    assert (out / "summary.json").read_text() == summary and (out / "config.yaml").read_text() == config
    ev = json.loads((out / "eval.json").read_text())
    assert ev["step"] == 2 and ev["checkpoint"].endswith("step_00000002.pt") and ev["eval"]["effective_rank"] > 0


def test_evaluation_skipped_on_a_streaming_loader_says_why(tmp_path):
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from dres.train.common import eval_loader

    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / c / "0.png")
    cfg = build_config("mae", "quickstart", ["data.name=imagefolder", f"data.path={tmp_path}", f"data.val_path={tmp_path}",
                                             "data.gpu_resident=false", "data.num_workers=0"])
    lines = []
    trainer = SimpleNamespace(cfg=cfg, device="cpu", log=lines.append, eval_loaders={})
    assert eval_loader(trainer, "val", 8) is None
    assert lines == ["[dres] evaluation on the val split skipped: the streaming data.name=imagefolder loader has no "
                     "in-order pass; evaluate a subset in memory with dres-eval RUN --set data.gpu_resident=true "
                     "--set data.limit=N --set data.val_limit=M"]


def _pyproject() -> dict:
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def _install_requires() -> list:
    """pyproject.toml's [project] dependencies and its [train] extra: what ``pip install '.[train]'`` installs."""
    project = _pyproject()["project"]
    return project["dependencies"] + project["optional-dependencies"]["train"]


def _imported_by_the_package() -> set:
    """Top-level module names that the package's own sources import (what its dependencies import
    opportunistically is theirs to declare)."""
    import ast
    from pathlib import Path

    root, names = Path(__file__).resolve().parents[1], set()
    for folder in ("dres", "train", "kernels"):
        for f in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def _closure(requirements) -> set:
    """The distributions that requirements bring: the requirements and theirs, recursively."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        r = todo.pop()
        name = r.name.lower().replace("_", "-")
        if name in seen or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(q) for q in (md.requires(r.name) or []))
        except md.PackageNotFoundError:
            pass
    return seen


def test_install_requires_covers_what_training_and_evaluation_import(tmp_path):
    """dres-train imports pyyaml, tqdm, pillow and scikit-learn, which the [dev] extra alone once
    installed."""
    import importlib.metadata as md

    script = ("import sys\nfrom dres.train import cli\n"
              f"assert cli.main({['mae', '--preset', 'quickstart', '--out', str(tmp_path / 'run'), '--set', 'steps=2', '--set', 'log.tensorboard=false', '--set', 'eval.probe_epochs=1', '--set', 'batch_size=32']!r}) == 0\n"
              "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = set(r.stdout.strip().splitlines()[-1].split())
    modules = (loaded & _imported_by_the_package()) - set(sys.stdlib_module_names) - {"dres"}
    dists = md.packages_distributions()
    used = {d.lower().replace("_", "-") for m in modules for d in dists.get(m, [])}
    missing = used - _closure(_install_requires())
    assert not missing, f"imported at run time but not installed by `pip install .[train]`: {sorted(missing)}"


def test_packaging_metadata_has_one_version_and_named_extras():
    """pyproject.toml holds the metadata, the version comes from dres.__version__ alone, and each
    optional feature has an extra named for it."""
    import importlib.metadata as md
    import re
    from pathlib import Path

    import dres

    root = Path(__file__).resolve().parents[1]
    project = _pyproject()["project"]
    assert project["dynamic"] == ["version"] and "version" not in project
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dres.__version__"}
    assert not re.search(r"\bversion\s*=", (root / "setup.py").read_text())  # one version source
    assert md.version("dres") == dres.__version__
    assert project["requires-python"] and project["description"]
    assert project["scripts"] == {"dres-train": "dres.train.cli:main", "dres-eval": "dres.train.cli:eval_main",
                                  "dres-launch": "dres.train.launch:main", "dres-prep": "dres.data.prep:main",
                                  "dres-export": "dres.train.export:main"}
    extras = project["optional-dependencies"]
    assert {"train", "timm", "hf", "tensorboard", "plots", "all", "extras", "dev"} <= set(extras)
    assert extras["all"] == ["dres[train,timm,hf,tensorboard,plots]"] and "dres[all]" in extras["dev"]
    assert not any(r.startswith("hypothesis") for r in extras["dev"])  # the tests never import it
    assert (Path(dres.__file__).parent / "py.typed").is_file()


def _help(main, args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_each_task_has_its_own_help_with_its_presets_and_keys(capsys):
    top = _help(cli.main, ["--help"], capsys)
    mae, uvit, classify = (_help(cli.main, [t, "--help"], capsys) for t in ("mae", "uvit", "classify"))
    assert len({top, mae, uvit, classify}) == 4
    assert "`dres-train TASK --help` lists a task's presets and config" in " ".join(top.split())  # as wrapped
    assert "usage: dres-train mae" in mae and "MAE pretraining" in mae
    assert "  quickstart " in mae and "  mae_cifar10 " in mae and "uvit_cifar10" not in mae
    assert "  uvit_s2_cifar10 " in uvit and "quickstart" not in uvit
    assert "  classify_resnet50d_cifar10 " in classify
    # keys with their defaults and what they mean; each task lists the model and eval keys it reads
    assert re.search(r"^  model\.mask_ratio=0\.75 +MAE: fraction of patches hidden", mae, re.M)
    assert re.search(r"^  optim\.clip_grad=0\.0 +0: off", mae, re.M)
    assert "eval.sampler=dpm" in uvit and "eval.sampler" not in mae and "model.mask_ratio" not in uvit
    assert "model.arch=vit" in classify and "model.arch" not in mae and "eval.knn" not in classify
    assert "data.path=" in classify and "--set KEY=VALUE" in classify
    out = subprocess.run([sys.executable, "-m", "dres.train.mae", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: dres-train mae" in out.stdout and "model.mask_ratio=0.75" in out.stdout


def test_dres_eval_help_describes_ckpt_set_and_the_eval_keys(capsys):
    out = _help(cli.eval_main, ["--help"], capsys)
    assert re.search(r"--ckpt PATH +evaluate this checkpoint", out)
    assert re.search(r"--set KEY=VALUE +change a key of the run's config", out)
    assert re.search(r"^  eval\.tsne=false +\[mae\] t-SNE plot", out, re.M)
    assert re.search(r"^  eval\.sampler=dpm +\[uvit\]", out, re.M) and "eval.every" not in out
    assert "RUN_DIR/eval.json" in out


@pytest.mark.parametrize("main,prog", [(cli.main, "dres-train"), (cli.eval_main, "dres-eval")])
def test_version(main, prog, capsys):
    import dres

    assert _help(main, ["--version"], capsys).strip() == f"{prog} {dres.__version__}"


def test_cpu_threads_one_for_narrow_models_else_torch_default(monkeypatch):
    """Quickstart-sized models lose several times their step to threads spinning on a busy machine."""
    import torch

    from dres.train import config

    monkeypatch.setattr(config, "_TORCH_THREADS", [])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert config.cpu_threads(build_config("mae", "quickstart")) == 1  # embed_dim 64
    assert config.cpu_threads(build_config("mae", "quickstart", ["threads=3"])) == 3
    wide = build_config("mae", "quickstart", ["model.embed_dim=256", "model.num_heads=4"])
    assert config.cpu_threads(wide) == 8


@pytest.mark.parametrize("dist, act_ckpt, scope", [("none", "none", "model"), ("ddp", "none", "model"),
                                                   ("fsdp", "none", "blocks"), ("none", "full", "blocks"),
                                                   ("ddp", "selective", "blocks")])
def test_compile_scope_auto_does_what_its_help_says(dist, act_ckpt, scope):
    """``--help``'s text for compile_scope (the field's comment) and ``auto_compile_scope`` agree."""
    from dres.train.config import Config, auto_compile_scope, key_docs

    cfg = Config()
    cfg.dist, cfg.act_ckpt = dist, act_ckpt
    assert auto_compile_scope(cfg) == scope
    auto = key_docs()["compile_scope"][1].split("auto:")[1]
    assert "model on one GPU and under DDP" in auto and "blocks under FSDP2 and activation checkpointing" in auto
