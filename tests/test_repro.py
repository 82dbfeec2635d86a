"""The reproduction's pieces (CPU): the model.zero_init switch, and experiments/repro.py with its plan (arms.py:
the arm matrix, selection), runner (runner.py: budget plan, records from real tiny runs, rescoring) and report
(report.py: RESULTS.md)."""

import json
import math
import os
import re
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from experiments import arms, report, repro, runner
from dres.train.cli import get_task
from dres.train.config import ConfigError, build_config

TINY_VIT = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2"]


def _branch_ends(model):
    """The last Linear of every transformer branch (attention proj, MLP fc2), encoder and decoder."""
    return [m for name, m in model.named_modules() if name.endswith(("attn.proj", "mlp.fc2"))]


def _build(task, preset, overrides):
    cfg = build_config(task, preset, overrides)
    torch.manual_seed(0)
    return get_task(task).build_model(cfg)


@pytest.mark.parametrize("task,preset,extra", [
    ("mae", "quickstart", ["model.decoder_depth=1"]),
    ("uvit", "uvit_cifar10", ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.img_size=8",
                              "data.img_size=8", "model.patch_size=2"]),
    ("classify", "classify_cifar10", TINY_VIT),
])
@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_zero_init_switch_true_false_auto(task, preset, extra, alpha):
    base = extra + ([] if task == "uvit" else TINY_VIT) + [f"model.alpha_min={alpha}"]
    for word, zero in (("true", True), ("false", False), ("auto", alpha < 1)):
        ends = _branch_ends(_build(task, preset, base + [f"model.zero_init={word}"]))
        assert ends
        assert all(bool((m.weight == 0).all()) == zero for m in ends), (word, alpha)
    # auto is the models' own rule (zero_init=None), parameter for parameter
    cfg = build_config(task, preset, base)
    cls = type(get_task(task).build_model(cfg))
    from dres.train.common import model_kwargs

    kw = model_kwargs(cls, cfg)
    assert kw["zero_init"] is None
    torch.manual_seed(0)
    today = cls(**kw).state_dict()
    auto = _build(task, preset, base).state_dict()
    assert today.keys() == auto.keys()
    assert all(torch.equal(today[k], auto[k]) for k in today if torch.is_tensor(today[k]))


def test_zero_init_official_skip_ends_and_config_errors():
    mae = _build("mae", "quickstart", TINY_VIT + ["model.decoder_depth=1", "model.alpha_min=1.0",
                                                  "model.zero_init=false"])
    assert all(bool((s.fc[-1].weight == 0).all()) for s in mae.skips)  # the official variant's own init
    with pytest.raises(ConfigError, match="model.zero_init' must be one of auto, true, false"):
        build_config("mae", "quickstart", ["model.zero_init=maybe"])


def test_zero_init_resnet_maps_to_timm_zero_init_last():
    base = ["model.arch=resnet18", "model.droppath_mode=none"]
    for word, zero in (("true", True), ("false", False), ("auto", True)):  # auto: timm's default
        net = _build("classify", "classify_resnet50d_cifar10", base + [f"model.zero_init={word}"]).net
        bns = [blk.bn2.weight for stage in (net.layer1, net.layer2) for blk in stage]
        assert all(bool((w == 0).all()) == zero for w in bns), word


def test_drop_rate_is_timms_dropout_before_the_resnet_classifier():
    model = _build("classify", "classify_resnet50d_cifar10_timm", ["model.arch=resnet18", "model.droppath_mode=none",
                                                                   "model.drop_rate=0.5"])
    assert model.net.drop_rate == 0.5
    x = torch.randn(2, 3, 32, 32)
    feats = model.net.forward_features(x)
    model.train()
    torch.manual_seed(0)
    kept = model.net.forward_head(feats, pre_logits=True)
    assert ((kept == 0) | torch.isclose(kept, 2 * model.net.global_pool(feats))).all() and (kept == 0).any()
    model.eval()
    assert torch.equal(model.net.forward_head(feats, pre_logits=True), model.net.global_pool(feats))
    assert _build("classify", "classify_resnet50d_cifar10", ["model.arch=resnet18"]).net.drop_rate == 0.0


# ---------------------------------------------------------------------------------------------- runner

def test_matrix_holds_the_planned_arms():
    names = {a.name for a in arms.MATRIX}
    for v in ("baseline", "official"):
        for a in (1.0, 0.6):
            assert f"A-{v}-a{a}-s0" in names
    assert {"A-official-a0.5-s0", "A-official-a0.7-s0", "A-official-a0.8-s0", "A-baseline-a1.0-s1",
            "A-official-a0.6-s1", "B-uvit-a1.0-s0", "B-uvit-a0.7-s0"} <= names
    for arch, seeds in (("resnet50d", (0, 1)), ("resnet50", (0,)), ("vit", (0,))):
        for m in arms.MODES:
            for s in seeds:
                assert f"C-{arch}-{m}-s{s}" in names
    official_1 = arms.BY_NAME["A-official-a1.0-s0"]
    assert "model.zero_init=true" in official_1.overrides
    assert all("model.zero_init=auto" in a.overrides for a in arms.MATRIX
               if a.claim == "A" and a.stage == "short" and a is not official_1)
    # every arm's config resolves with its preset (the ResNet presets included)
    for a in arms.MATRIX:
        build_config(a.task, a.preset, list(a.overrides) + [f"seed={a.seed}"])


def test_select_adds_needs_and_rejects_unknown_words():
    assert [a.name for a in arms.select("A.2x2")] == [a.name for a in arms.MATRIX if "A.2x2" in a.tags]
    b = [a.name for a in arms.select("B")]
    assert b.index("C-vit-none-s0") < b.index("B-uvit-a1.0-s0")  # the FD classifier first
    assert len(arms.select("all")) == len(arms.MATRIX)
    with pytest.raises(ValueError, match="no arm, group, tag or claim named 'A.3x3'"):
        arms.select("A.3x3")


def test_plan_packs_arms_within_the_budget():
    rates = {"mae": 50000.0, "classify": 25000.0, "uvit": 10000.0}
    chosen, left = runner.plan(arms.MATRIX, epochs=100, gpus=2, budget_min=10, img_per_s=rates, overhead_s=60)
    # an MAE arm: 100 * 50000 / 50000 + 60 = 160 s; two GPUs, 600 s each
    load = [0.0, 0.0]
    for arm, g, est in chosen:
        load[g] += est
    assert max(load) <= 600 and chosen[0][0].name == arms.MATRIX[0].name
    assert {a.name for a in left} | {a.name for a, _, _ in chosen} == set(arms.BY_NAME)
    names = [a.name for a, _, _ in chosen]
    assert all(n in names[:names.index(a.name)] for a, _, _ in chosen for n in a.needs)
    with pytest.raises(ValueError, match="no rate for task 'uvit'"):
        runner.plan(arms.MATRIX, epochs=1, gpus=1, budget_min=1e6, img_per_s={"mae": 1.0, "classify": 1.0},
                   overhead_s=0)


def test_stat_is_mean_and_standard_deviation():
    assert report.stat([0.5]) == "0.5"
    assert report.stat([0.80, 0.84, 0.88], scale=100) == "84.0 ± 4.0 (n=3)"


def test_paired_differences_by_seed_with_a_t_interval():
    def rec(group, seed, top1):
        return {"group": group, "seed": seed, "metrics": {"top1": top1}}
    recs = {f"{g}-s{s}": rec(g, s, v) for g, s, v in (("X", 0, 0.90), ("X", 1, 0.91), ("X", 2, 0.93), ("X", 3, 0.5),
                                                        ("Y", 0, 0.89), ("Y", 1, 0.89), ("Y", 2, 0.90))}
    line = report.paired_line(recs, "X", "Y", "top1", 100, "X − Y")
    # seed 3 has no pair; differences 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.303 -> 2.48
    assert line.startswith("- X − Y: +2.00 ± 2.48 (95% CI over 3 seed pairs 0,1,2;")
    assert "+1.00, +2.00, +3.00" in line
    assert "one pair, no interval" in report.paired_line({k: v for k, v in recs.items() if k.endswith(("s0", ))},
                                                        "X", "Y", "top1", 100, "d")
    assert report.paired_line(recs, "X", "Z", "top1", 100, "d") is None


def test_claim_c_report_pairs_each_mode_with_the_others_and_skips_cut_runs(tmp_path):
    folder = tmp_path / "h100-2026-01-01-decisive"
    (folder / "incomplete" / "C300-resnet50d-none-s1").mkdir(parents=True)  # a cut attempt of an arm with a record
    (folder / "incomplete" / "C300-resnet50d-none-s1" / "metrics.jsonl").write_text("")
    top1 = {"none": (0.875, 0.877, 0.876), "drop_path": (0.882, 0.882, 0.881),
            "residual_droppath": (0.844, 0.843, 0.846)}
    for mode, values in top1.items():
        for seed, value in enumerate(values):
            arm = arms.BY_NAME[f"C300-resnet50d-{mode}-s{seed}"]
            (folder / f"{arm.name}.json").write_text(json.dumps({
                "arm": arm.name, "claim": "C", "group": arm.group, "seed": seed, "epochs": 300, "steps": 117000,
                "overrides": list(arm.overrides), "curves": [], "train": {}, "artifacts": {}, "card": "cpu",
                "date": "2026-01-01T00:00:00", "commit": "abc", "command": "x",
                "metrics": {"top1": value, "final_epoch_train_acc": 0.9, "final_epoch_loss": 0.7}}))
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=False)
    assert "| resnet50d | 32 | 0.1 | none | 300 | 0,1,2 | 87.60 ± 0.10 (n=3) | 90.0 ± 0.0 (n=3) |" in text
    # residual_droppath − drop_path per seed -3.8, -3.9, -3.5: mean -3.73, sd 0.208, t(0.975, 2) = 4.303 -> 0.52
    assert ("- resnet50d 32 px: residual_droppath − drop_path (points): -3.73 ± 0.52 (95% CI over 3 seed pairs "
            "0,1,2; per seed -3.80, -3.90, -3.50)") in text
    assert "- resnet50d 32 px: residual_droppath − none (points): -3.17 ±" in text
    assert "- resnet50d 32 px: drop_path − none (points): +0.57 ±" in text
    assert "C300-resnet50d-none-s1" not in text.split("Not run yet:")[1] and "incomplete" not in text


def test_decisive_arms_carry_their_recipes():
    decisive = {a.name: a for a in arms.MATRIX if a.stage == "decisive"}
    ov = {n: dict(o.split("=", 1) for o in a.overrides) for n, a in decisive.items()}
    # A: 400 epochs, batch 1024 in every arm, official 0.6 vs 1.0 both zero-init, 2 seeds; vanilla and decayed baselines
    for alpha in (0.6, 1.0):
        for seed in (0, 1):
            o = ov[f"A400-official-a{alpha}-s{seed}"]
            assert o["model.zero_init"] == "true" and o["model.variant"] == "official"
    assert ov["A400-baseline-a1.0-s0"]["model.zero_init"] == "auto"  # vanilla MAE: no zero-init at alpha 1
    assert ov["A400-baseline-a1.0-zi-s0"]["model.zero_init"] == "true"
    a_arms = [a for a in decisive.values() if a.claim == "A"]
    assert {a.epochs for a in a_arms if "A.length" not in a.tags} == {400}
    assert {ov[a.name]["batch_size"] for a in a_arms} == {"1024"}
    # A at other lengths: the official pair, three seeds, the 400-epoch arms' overrides and the preset's warm-up
    for length in (100, 200, 800):
        pairs = [a for a in a_arms if f"A.length.e{length}" in a.tags]
        assert sorted((a.labels["alpha_min"], a.seed) for a in pairs) == [(al, s) for al in (0.6, 1.0) for s in range(3)]
        for a in pairs:
            assert a.epochs == length and a.overrides == arms.BY_NAME[f"A400-official-a{a.labels['alpha_min']}-s0"].overrides
            assert f"A.length.e{length}.s{a.seed}" in a.tags and "A.pairs" not in a.tags
            assert build_config("mae", a.preset, list(a.overrides)).optim.warmup_epochs == 20
    # B: the evaluated EMA holds < 1% of the initial weights after the arm's steps (batch 128, 390 steps an epoch)
    for seed in (0, 1):
        for alpha in (1.0, 0.7):
            arm = decisive[f"B64-uvit-a{alpha}-s{seed}"]
            cfg = build_config("uvit", arm.preset, list(arm.overrides))
            steps = int(arm.epochs * (50000 // cfg.batch_size))
            assert cfg.optim.ema_decay ** steps < 0.01 and steps >= 24000
            assert cfg.model.zero_init == "true"
    assert arms.ema_initial_weight(0.9999, 3900) > 0.6  # the short runs' EMA: mostly the initialisation
    # C: timm's recipe, three modes x three seeds, and the 224 px pilot
    for mode in arms.MODES:
        for seed in (0, 1, 2):
            arm = decisive[f"C300-resnet50d-{mode}-s{seed}"]
            cfg = build_config("classify", arm.preset, list(arm.overrides))
            assert arm.epochs == 300 and cfg.batch_size == 128 and cfg.optim.blr * cfg.batch_size / 256 == 0.05
            assert (cfg.data.crop_min, cfg.data.color_jitter, cfg.data.eval_crop_pct) == (0.08, 0.4, 0.875)
            assert cfg.model.drop_rate == 0.1 and cfg.model.drop_path == 0.1 and cfg.model.droppath_mode == mode
        pilot = build_config("classify", decisive[f"C224-resnet50d-{mode}-s0"].preset, [])
        assert pilot.data.img_size == pilot.model.img_size == 224 and pilot.data.color_jitter == 0.4
    assert build_config("classify", decisive["C300-resnet50-none-s0"].preset,
                        list(decisive["C300-resnet50-none-s0"].overrides)).model.arch == "resnet50"
    # a word without @EPOCHS gives each decisive arm its own length; the FD classifier its record's
    lengths = {a.name: e for a, e, _ in arms.select_epochs("decisive", 0)}
    assert lengths["A400-official-a0.6-s1"] == 400 and lengths["C300-resnet50d-none-s2"] == 300
    assert lengths["C224-resnet50d-none-s0"] == 30 and lengths["B64-uvit-a0.7-s0"] == 64
    assert runner.need_epochs("C-vit-none-s0", 0, runner.REPO_ROOT / "no-such-folder") == 50  # its committed record


def test_dry_run_prints_the_exact_commands_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # --gpus 4 counts this host's GPUs otherwise
    records = tmp_path / "records"
    records.mkdir()
    (records / "C300-resnet50d-none-s0.json").write_text("{}")
    rc = repro.main(["--run", "C.timm.resnet50d.s0,C.pilot224@2", "--dry-run", "--gpus", "4", "--root",
                     str(tmp_path / "runs"), "--records", str(records), "--img-per-s",
                     "classify=43000,classify_resnet50d_cifar10_timm224=3000"])
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "runs").exists()
    assert "# C300-resnet50d-none-s0: has a record" in out
    assert "# C300-resnet50d-drop_path-s0: 300 epochs, ~8 min at 43000 img/s" in out  # 300 x 50000 / 43000 + 120 s
    cmd = (f"python -m dres.train.classify --preset classify_resnet50d_cifar10_timm --out "
           f"{tmp_path / 'runs' / 'C300-resnet50d-drop_path-s0'} --resume auto --set seed=0 --set epochs=300 "
           "--set steps=0 --set eval.every=11700 --set ckpt.every=11700 --set log.progress=false "
           "--set model.droppath_mode=drop_path")
    assert cmd in out.splitlines()
    assert "# C224-resnet50d-residual_droppath-s0: 2 epochs, ~3 min at 3000 img/s" in out


def test_dry_run_names_arms_a_gpu_and_minutes_measured_sharing_one(tmp_path, capsys):
    # the committed records of the frozen reading trained six arms to one H200
    rc = repro.main(["--run", "C300-resnet50d-residual_droppath_frozen-s0", "--dry-run", "--gpus", "1", "--jobs", "6",
                     "--root", str(tmp_path / "runs"), "--records", str(tmp_path / "records")])
    out = capsys.readouterr().out
    assert rc == 0 and "1 arm(s), 6 at a time on each of 1 GPU(s)" in out
    assert "300 epochs, ~24.5 min on one NVIDIA H200 shared by 6 arms (its records' wall time)" in out


def test_report_without_records_says_not_run_yet_everywhere(tmp_path):
    text = report.report(tmp_path / "records", tmp_path / "RESULTS.md", figures=tmp_path / "figures",
                        notes=tmp_path / "notes.md")
    groups = {a.group for a in arms.MATRIX}
    table_rows = [l for l in text.splitlines() if l.startswith("| ") and "not run yet" in l]
    assert len(table_rows) == len(groups)
    # a decisive setting names its planned length: the 600-epoch rows read apart from the 300-epoch ones
    assert sum("| not run yet (600 epochs) |" in row for row in table_rows) == 2
    for value in ("83.6", "61.5", "62.5", "14.3", "89.55", "89.84", "90.84", "88.07"):  # the papers' numbers
        assert value in text
    assert "No arm has run yet." in text and text.count("Verdict: pending") == 3
    assert "fd_cifar_classifier" in text and "not FID" in text
    assert "## At a glance" not in text  # no verdict written, nothing to lead with


def test_report_leads_with_each_claims_opening_bold_passage(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("## A\n\n**Decisive runs: the probe rises\nby +1.8 ± 1.7.** Preset and records.\n\n"
                     "## C\n\nNo bold lead here, **only later**.\n")
    text = report.render(tmp_path / "records", tmp_path, figures=tmp_path / "figures", notes=notes, draw=False)
    glance = text[text.index("## At a glance"):text.index("## A. ")]
    lines = [l for l in glance.splitlines() if l.startswith("- ")]
    assert lines == [f"- **A. {report.CLAIM_TITLES['A']}**: Decisive runs: the probe rises by +1.8 ± 1.7.",
                     f"- **B. {report.CLAIM_TITLES['B']}**: verdict pending.",
                     f"- **C. {report.CLAIM_TITLES['C']}**: verdict pending."]
    assert "Preset and records." in text[text.index("## A. "):]  # the verdict in full stays in its section


def test_committed_results_md_is_the_report_of_the_committed_records():
    text = report.render(runner.RECORDS_ROOT, runner.REPO_ROOT, draw=False)
    assert (runner.REPO_ROOT / "RESULTS.md").read_text() == text, "rebuild it: python -m experiments.repro --report"


def test_report_reads_every_records_folder_and_the_latest_record_of_an_arm_wins(tmp_path, capsys):
    base = {"claim": "C", "group": "C-vit-none", "task": "classify", "seed": 0, "epochs": 10, "steps": 1,
            "overrides": ["model.droppath_mode=none"], "curves": [], "train": {}, "artifacts": {}, "card": "cpu", "commit": "abc", "command": "x"}
    for folder, date, top1 in (("cpu-2026-01-01-first", "2026-01-01T00:00:00", 0.5),
                               ("cpu-2026-02-01-second", "2026-02-01T00:00:00", 0.75)):
        (tmp_path / folder).mkdir()
        rec = dict(base, arm="C-vit-none-s0", date=date, metrics={"top1": top1})
        (tmp_path / folder / "C-vit-none-s0.json").write_text(json.dumps(rec))
    (tmp_path / "cpu-2026-01-01-first" / "semantics_none_s0.json").write_text("{}")  # not an arm: not read
    # a later record of the arm made with other overrides (another recipe under the name) is not the arm's
    (tmp_path / "cpu-2026-03-01-other").mkdir()
    (tmp_path / "cpu-2026-03-01-other" / "C-vit-none-s0.json").write_text(json.dumps(
        dict(base, arm="C-vit-none-s0", date="2026-03-01T00:00:00", metrics={"top1": 0.1},
             overrides=["model.droppath_mode=none", "optim.ema_decay=0.999"])))
    other = []
    recs = runner.load_records(tmp_path, other)
    assert list(recs) == ["C-vit-none-s0"] and recs["C-vit-none-s0"]["metrics"]["top1"] == 0.75
    assert [p.parent.name for p in other] == ["cpu-2026-03-01-other"]
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=False)
    assert "Not counted (made with other overrides than their arm's today): `cpu-2026-03-01-other/C-vit-none-s0.json`" \
        in text
    assert repro.main(["--run", "C-vit-none-s0", "--epochs", "1", "--gpus", "0"]) == 2
    assert "--run needs --records FOLDER" in capsys.readouterr().err


SMOKE = ["--preset", "mae=quickstart", "--set", "model.depth=2", "--set", "model.decoder_depth=1",
         "--set", "batch_size=64", "--set", "eval.probe_epochs=2", "--set", "eval.curve_probe_epochs=2",
         "--set", "eval.recon=false", "--set", "log.tensorboard=false", "--set", "log.every=2",
         "--set", "optim.warmup_steps=1"]


def test_runner_trains_two_arms_writes_records_and_report(tmp_path, capsys, monkeypatch):
    records, root = tmp_path / "records", tmp_path / "runs"
    names = "A-baseline-a1.0-s0,A-official-a0.6-s0"
    sweep_command = runner.sweep_command  # each arm's probe sweep, on a grid of two settings (the CPU's pace)
    monkeypatch.setattr(runner, "sweep_command", lambda run_dir, recs: None if sweep_command(run_dir, recs) is None
                        else sweep_command(run_dir, recs) + ["--lrs", "0.01", "--wds", "0,0.1", "--epochs", "2"])
    # digits: 1437 training images, 22 steps of 64 a epoch; 0.2 epochs = 4 steps, a curve point every 2
    rc = repro.main(["--run", names, "--epochs", "0.2", "--gpus", "0", "--root", str(root), "--records", str(records),
                     "--curve-every", "2", "--commit", "abc123", "--set", "eval.save_features=true"] + SMOKE)
    assert rc == 0, capsys.readouterr()
    for name in names.split(","):
        rec = json.loads((records / f"{name}.json").read_text())
        assert rec["arm"] == name and rec["epochs"] == 0.2 and rec["commit"] == "abc123" and rec["card"].startswith("cpu")
        assert 0 <= rec["metrics"]["linear_probe_acc"] <= 1 and rec["metrics"]["effective_rank"] >= 1
        assert [p["step"] for p in rec["curves"]] == [2, 4]
        assert {"knn_acc", "linear_probe_acc", "effective_rank", "epoch"} <= set(rec["curves"][0])
        assert "--resume auto" in rec["command"] and "epochs=0.2" in rec["command"]
        assert "ckpt.every=2" in rec["command"]  # a checkpoint at every curve point: a cut call resumes from there
        assert rec["train"]["final_loss"] > 0 and rec["train"]["img_per_s"] > 0  # from metrics.jsonl
        assert rec["train"]["final_epoch_loss"] > 0 and rec["train"]["final_epoch_steps"] > 0
        assert rec["metrics"]["effective_rank_entropy"] == pytest.approx(math.log(rec["metrics"]["effective_rank"]))
        assert (records / rec["artifacts"]["curves_png"]).stat().st_size > 0  # relative to its records folder
        swept = json.loads((records / "probe_sweep" / f"{name}.json").read_text())  # the slot's sweep after the arm
        assert swept["arm"] == name and swept["grid"] == {"lr": [0.01], "weight_decay": [0.0, 0.1], "epochs": [2]}
        assert swept["features"] == str(root / name / "features.pt")
    out = capsys.readouterr().out
    assert out.count("[repro] sweep ") == 2 and out.count("[repro] swept ") == 2
    # a second call skips the recorded arms; --no-probe-sweep leaves the sweep out
    assert repro.main(["--run", names, "--epochs", "0.2", "--gpus", "0", "--root", str(root), "--records",
                       str(records), "--curve-every", "2", "--no-probe-sweep"] + SMOKE) == 0
    assert "A-baseline-a1.0-s0: skipped" in capsys.readouterr().out
    text = report.report(records, tmp_path / "RESULTS.md", figures=tmp_path / "figures", notes=tmp_path / "notes.md")
    row = next(l for l in text.splitlines() if l.startswith("| baseline | 1 | auto | 0.2 |"))
    assert "not run yet" not in row and "| 0 |" in row
    h, exp_h = (float(c) for c in row.split(" | ")[7:9])  # eq. 6's entropy and its exponential, both shown
    assert h == pytest.approx(math.log(exp_h), abs=0.06)
    assert next(l for l in text.splitlines() if l.startswith("| official | 0.5 |")).count("not run yet") == 1
    assert (tmp_path / "figures" / "mae_curves.png").stat().st_size > 0 and "figures/mae_curves.png" in text
    assert "official 0.6 − baseline" not in text and "probe, official 1.0 − baseline 1.0" not in text
    assert "`A-official-a0.6-s0`" not in text.split("Not run yet:")[1] and "`A-official-a0.5-s0`" in text


def test_runner_bad_override_is_one_line_error(tmp_path, capsys):
    rc = repro.main(["--run", "A-baseline-a1.0-s0", "--epochs", "1", "--gpus", "0", "--root", str(tmp_path),
                     "--records", str(tmp_path / "r"), "--set", "model.wat=1"])
    assert rc == 2 and "unknown config key 'model.wat'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_runner_maps_gpu_slots_through_cuda_visible_devices(tmp_path, monkeypatch, capsys):
    """``--gpus 2`` under CUDA_VISIBLE_DEVICES=5,7 starts its arms on devices 5 and 7, not 0 and 1, each
    with half the host's cores for its CPU threads."""
    started, threads, popen = [], [], runner.subprocess.Popen

    class ExitedArm:  # an arm that ends at once (failed: no record is made, no GPU is queried)
        returncode = 1

        def poll(self):
            return self.returncode

    def fake_popen(cmd, **kw):  # arms only; anything else (git) runs
        if "--resume" not in cmd:
            return popen(cmd, **kw)
        started.append(kw["env"]["CUDA_VISIBLE_DEVICES"])
        threads.append(int(kw["env"]["OMP_NUM_THREADS"]))
        return ExitedArm()

    monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rc = repro.main(["--run", "A-baseline-a1.0-s0,A-official-a0.6-s0", "--epochs", "1", "--gpus", "2",
                     "--root", str(tmp_path), "--records", str(tmp_path / "r"), "--curve-every", "2"] + SMOKE)
    assert rc == 1 and sorted(started) == ["5", "7"]
    assert threads == [max(1, (runner.os.cpu_count() or 1) // 2)] * 2  # each arm a share of the host's cores
    assert "CUDA_VISIBLE_DEVICES=5 python" in capsys.readouterr().out
    assert repro.main(["--run", "A-baseline-a1.0-s0", "--epochs", "1", "--gpus", "3", "--root", str(tmp_path),
                       "--records", str(tmp_path / "r")]) == 2
    assert "--gpus 3: CUDA_VISIBLE_DEVICES=5,7 shows 2" in capsys.readouterr().err


def test_run_words_take_their_own_epochs():
    queue = arms.select_epochs("C.resnet50d.s1@100,A.sweep@50,B.short", 10)
    lengths = {a.name: e for a, e, _ in queue}
    assert [a.name for a, _, named in queue if not named] == ["C-vit-none-s0"]
    assert lengths == {**{f"C-resnet50d-{m}-s1": 100 for m in ("none", "drop_path", "residual_droppath")},
                       **{f"A-official-a{x}-s0": 50 for x in (0.5, 0.7, 0.8)},
                       "B-uvit-a1.0-s0": 10, "B-uvit-a0.7-s0": 10, "C-vit-none-s0": 10}  # B's need: B's length
    assert [a.name for a, _, _ in queue] == [a.name for a in arms.MATRIX if a.name in lengths]  # matrix order
    # a need named itself keeps its own length
    assert {a.name: (e, named) for a, e, named in arms.select_epochs("B.short@10,C-vit-none-s0@50", 0)}[
        "C-vit-none-s0"] == (50, True)
    for spec, default, match in (("A.sweep", 0, "give a positive --epochs or A.sweep@EPOCHS"),
                                 ("A.sweep@x", 0, "'x' is not a number of epochs"),
                                 ("A.sweep@50,A-official-a0.5-s0@40", 0, "given 50 and 40 epochs")):
        with pytest.raises(ValueError, match=match):
            arms.select_epochs(spec, default)


def test_force_reruns_named_arms_only_and_a_rebuilt_need_keeps_its_record(tmp_path, monkeypatch, capsys):
    """``--run B-uvit-a1.0-s0@25 --force`` on a machine without the FD classifier's run directory rebuilds
    it for as long as its record says (not B's 25 epochs) and keeps that record; where the directory
    exists, only the named arm reruns."""
    records, root = tmp_path / "records", tmp_path / "runs"
    records.mkdir()
    need = {"arm": "C-vit-none-s0", "epochs": 50, "metrics": {"top1": 0.77}}
    for name, rec in (("C-vit-none-s0", need), ("B-uvit-a1.0-s0", {"arm": "B-uvit-a1.0-s0", "epochs": 10})):
        (records / f"{name}.json").write_text(json.dumps(rec))
    started, popen = [], runner.subprocess.Popen

    class ExitedArm:
        returncode = 1

        def poll(self):
            return self.returncode

    def fake_popen(cmd, **kw):
        if "--resume" not in cmd:
            return popen(cmd, **kw)
        started.append(cmd[cmd.index("--out") + 1].rsplit("/", 1)[-1] + " " +
                       next(c for c in cmd if c.startswith("epochs=")))
        return ExitedArm()

    monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
    args = ["--run", "B-uvit-a1.0-s0@25", "--force", "--gpus", "0", "--root", str(root), "--records", str(records)]
    assert repro.main(args) == 1
    assert started == ["C-vit-none-s0 epochs=50"]  # then B is blocked by the failed need
    assert json.loads((records / "C-vit-none-s0.json").read_text()) == need
    (root / "C-vit-none-s0").mkdir(parents=True)
    (root / "C-vit-none-s0" / "summary.json").write_text("{}")
    started.clear()
    assert repro.main(args) == 1
    assert started == ["B-uvit-a1.0-s0 epochs=25"] and "C-vit-none-s0: skipped" in capsys.readouterr().out


def test_dry_run_says_what_the_run_does_with_each_arm(tmp_path, monkeypatch, capsys):
    """One decision (arm_actions) for --dry-run and --run: the FD classifier has a record but no run folder
    here, so it is rebuilt (its record kept) before the B arms; B 1.0 resumes from its checkpoint; B 0.7 has a
    record and is skipped. The dry run names each action and the command the run then starts."""
    records, root = tmp_path / "records", tmp_path / "runs"
    records.mkdir()
    need = {"arm": "C-vit-none-s0", "epochs": 50, "metrics": {"top1": 0.77}}
    (records / "C-vit-none-s0.json").write_text(json.dumps(need))
    (records / "B-uvit-a0.7-s0.json").write_text(json.dumps({"arm": "B-uvit-a0.7-s0", "epochs": 10}))
    (root / "B-uvit-a1.0-s0" / "checkpoints").mkdir(parents=True)
    (root / "B-uvit-a1.0-s0" / "checkpoints" / "step_00000004.pt").write_bytes(b"")
    args = ["--run", "B.short@10", "--gpus", "0", "--root", str(root), "--records", str(records), "--commit", "abc"]

    assert repro.main(args + ["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = {}
    for i, line in enumerate(lines):
        if line.startswith("# "):
            name, what = line[2:].split(": ", 1)
            action = "skip" if what.endswith(("skipped", "(read by other arms)")) else \
                "resume" if "; resumes its run in" in what else "start" if "; starts in" in what else what
            planned[name] = (action, None if action == "skip" else lines[i + 1])
    assert {n: a for n, (a, _) in planned.items()} == {"C-vit-none-s0": "start", "B-uvit-a1.0-s0": "resume",
                                                      "B-uvit-a0.7-s0": "skip"}
    assert any(l.startswith("# C-vit-none-s0: 50 epochs") and "its record in" in l and l.endswith("kept")
               for l in lines)
    # without --img-per-s the estimate is the committed records' wall time of the arm's group, its final
    # evaluation's included (the newest record of C-vit-none-s0: 121 s of training, 0.2 s of evaluation)
    assert any(l.startswith("# C-vit-none-s0: 50 epochs, ~2.0 min on one NVIDIA H") and "(its records' wall time)" in l
               for l in lines)

    class FinishedArm:  # an arm that ends at once with its run folder's summary.json written
        returncode = 0

        def poll(self):
            return self.returncode

    popen = runner.subprocess.Popen

    def fake_popen(cmd, **kw):  # arms only; anything else (platform's uname) runs
        if "--resume" not in cmd:
            return popen(cmd, **kw)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text("{}")
        return FinishedArm()

    monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
    assert repro.main(args) == 0
    out = capsys.readouterr().out
    done = {}
    for line in out.splitlines():
        head, _, command = line.partition(" on CPU: ")
        if command:
            what, name = head.removeprefix("[repro] ").split(" ")
            done[name] = (what, command)
        elif line.endswith(": skipped"):
            done[line.removeprefix("[repro] ").removesuffix(": skipped")] = ("skip", None)
    assert done == planned
    assert json.loads((records / "C-vit-none-s0.json").read_text()) == need  # rebuilt, its record kept
    assert json.loads((records / "B-uvit-a1.0-s0.json").read_text())["epochs"] == 10


def test_final_epoch_means_weight_the_windows_of_the_last_epoch_by_their_steps():
    from dres.eval.curves import final_epoch_means

    # 10 steps an epoch; windows end at steps 5, 10, 15, 18, 20: the last epoch is steps 11-20
    log = [{"step": s, "epoch": s / 10, "loss": loss, "train_acc": acc}
           for s, loss, acc in ((5, 9.0, 0.0), (10, 9.0, 0.0), (15, 2.0, 0.5), (18, 1.0, 0.8), (20, 0.5, 1.0))]
    got = final_epoch_means(log)
    assert got["final_epoch_loss"] == pytest.approx((5 * 2.0 + 3 * 1.0 + 2 * 0.5) / 10)
    assert got["final_epoch_train_acc"] == pytest.approx((5 * 0.5 + 3 * 0.8 + 2 * 1.0) / 10)
    assert got["final_epoch_steps"] == 10
    assert final_epoch_means([{"step": 5, "loss": 1.0}]) == {}  # a stream of unknown size has no epochs


def test_classify_summary_holds_the_final_epochs_training_accuracy_and_loss(tmp_path):
    from dres.eval.curves import final_epoch_means, read_points
    from dres.train import cli

    ovr = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.mean=[0.3]", "data.std=[0.4]",
           "data.aug=rrc_flip", "data.color_jitter=0.4", "data.eval_crop_pct=0.875", "model.img_size=8",
           "model.patch_size=4", "model.in_chans=1", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
           "batch_size=64", "epochs=2", "optim.warmup_steps=2", "log.every=5", "log.progress=false",
           "log.tensorboard=false", "compile=false"]
    assert cli.main(["classify", "--preset", "classify_cifar10", "--out", str(tmp_path)] +
                    sum([["--set", o] for o in ovr], [])) == 0
    ev = json.loads((tmp_path / "summary.json").read_text())["eval"]
    expected = final_epoch_means(read_points(tmp_path / "metrics.jsonl"))
    assert ev["final_epoch_train_acc"] == pytest.approx(expected["final_epoch_train_acc"])
    assert ev["final_epoch_loss"] == pytest.approx(expected["final_epoch_loss"]) and 0 < ev["top1"] <= 1
    # digits: 1437 images, 22 steps of 64 an epoch; the 5-step windows ending in the last (steps 23-44) cover 21-44
    assert expected["final_epoch_steps"] == 24


RUNNER_STAND_IN = '[ "$2" = experiments.repro ] && echo "$@" >"$QUEUE_DIR/args"\nexit 0\n'


def queue_script(tmp_path, python3=RUNNER_STAND_IN, **env_vars):
    """queue.sh with its queue folder and output under tmp_path, a python3 stand-in (the install, the runner: it
    keeps the runner's arguments in QUEUE_DIR/args; ``python3``, its shell script) and ``env_vars`` in its
    environment."""
    script = Path(__file__).resolve().parents[1] / "experiments" / "queue.sh"
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\n" + python3)
    (tmp_path / "bin" / "python3").chmod(0o755)
    host = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # a GPU host's test process has it
    env = {**host, "QUEUE_DIR": str(tmp_path / "queue"), "OUT": str(tmp_path / "out"),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **env_vars}

    def call(*args, cwd=None):
        r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=60, cwd=cwd)
        return r.returncode, r.stdout.strip(), r.stderr.strip()
    return call


def test_queue_script_refuses_bad_calls_with_one_line(tmp_path):
    call = queue_script(tmp_path)
    usage = "usage: bash experiments/queue.sh start WORDS [GPUS] [COMMIT] | job NAME COMMAND | wait SECONDS"
    assert call()[::2] == (2, usage)
    assert call("wait", "soon")[0] == 2
    assert call("job", "a b", "true")[::2] == (2, usage)  # a job name becomes a file name
    assert call("start", "C.timm.resnet50d", "four")[::2] == (
        2, "queue.sh: GPUS must be a number or a list of GPU indices, got 'four'")
    code, _, err = call("wait", "0")
    assert code == 2 and err == f"queue.sh: no queue or job was started on this host ({tmp_path / 'queue'})"
    assert not (tmp_path / "queue").exists() and not (tmp_path / "out").exists()  # a refused call leaves nothing


def test_queue_job_runs_from_the_copy_and_comes_back_packed(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "marker.txt").write_text("the tree\n")
    call = queue_script(tmp_path)
    code, out, _ = call("job", "copy", 'cp marker.txt "$OUT/seen.txt"; pwd >"$OUT/where.txt"', cwd=tree)
    assert code == 0 and out.startswith("job copy started")
    assert call("job", "fails", "exit 3", cwd=tree)[0] == 0
    assert call("job", "slow", 'sleep 3; echo done >"$OUT/slow.txt"', cwd=tree)[0] == 0
    assert call("job", "copy", "true", cwd=tree)[::2] == (2, "queue.sh: job copy was already started on this host")
    code, out, _ = call("wait", "30", cwd=tree)
    assert code == 0 and "job copy: exit 0" in out and "job fails: exit 3" in out
    assert "job slow: exit 0" in out  # wait waited for the slowest job
    with tarfile.open(tmp_path / "out" / "jobs.tgz") as tar:
        assert tar.extractfile("jobs/copy/seen.txt").read() == b"the tree\n"
        assert tar.extractfile("jobs/copy/where.txt").read().decode().strip() == str(tmp_path / "queue" / "tree")
    assert not (tmp_path / "out" / "records.tgz").exists()  # no queue was started


def test_queue_start_passes_the_deadline_and_force_to_the_runner(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    call = queue_script(tmp_path, FORCE="1", DEADLINE_MIN="14")
    assert call("start", "A.pairs", "4", "abc1234", cwd=tree)[0] == 0
    args = (tmp_path / "queue" / "args").read_text().split()
    assert args[args.index("--run") + 1] == "A.pairs" and args[args.index("--gpus") + 1] == "4"
    assert args[args.index("--deadline-min") + 1] == "14" and args[args.index("--commit") + 1] == "abc1234"
    assert "--force" in args and args[args.index("--jobs") + 1] == "1"
    assert call("start", "A.pairs", cwd=tree)[::2] == (2, f"queue.sh: a queue was already started on this host "
                                                         f"({tmp_path / 'queue'})")



def test_queue_start_on_a_list_of_gpus_dry_runs_on_those_devices(tmp_path):
    """GPUS 2,3 runs the queue's slots on devices 2 and 3 (CUDA_VISIBLE_DEVICES); DRY_RUN=1 prints the runner's
    dry run from this tree and starts nothing."""
    import sys

    call = queue_script(tmp_path, python3=f'exec {sys.executable} "$@"\n', DRY_RUN="1")
    code, out, _ = call("start", "C.long.s1,C.long.s2", "2,3", cwd=runner.REPO_ROOT)
    assert code == 0 and "4 arm(s), one at a time on each of 2 GPU(s) (devices 2, 3)" in out
    assert "# C600-resnet50d-residual_droppath-s2: 600 epochs" in out and not (tmp_path / "queue").exists()
    both = queue_script(tmp_path, DRY_RUN="1", CUDA_VISIBLE_DEVICES="1")
    assert both("start", "A.length.e100", "2,3")[::2] == (
        2, "queue.sh: GPUS 2,3 and CUDA_VISIBLE_DEVICES=1: give the GPUs one way")


def mps_control_stand_in(tmp_path):
    """A stand-in for nvidia-cuda-mps-control on tmp_path/bin that makes its control pipe under tmp_path/mps on
    -d, removes it on 'quit' and logs its calls to tmp_path/mps.calls; returns the pipe's folder."""
    pipe = tmp_path / "mps"
    pipe.mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-cuda-mps-control").write_text(
        f'#!/bin/sh\nif [ "$1" = -d ]; then echo -d >>"{tmp_path}/mps.calls"; mkfifo "{pipe}/control"\n'
        f'else cat >>"{tmp_path}/mps.calls"; rm -f "{pipe}/control"; fi\n')
    (tmp_path / "bin" / "nvidia-cuda-mps-control").chmod(0o755)
    return pipe


def test_queue_start_with_mps_starts_the_daemon_once_and_passes_the_arms_per_gpu(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    pipe = mps_control_stand_in(tmp_path)
    call = queue_script(tmp_path, MPS="1", JOBS="5", CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    assert call("start", "C.d0", "2", "abc1234", cwd=tree)[0] == 0
    args = (tmp_path / "queue" / "args").read_text().split()
    assert args[args.index("--jobs") + 1] == "5" and args[args.index("--gpus") + 1] == "2"
    assert (pipe / "control").is_fifo() and (tmp_path / "mps.calls").read_text().split() == ["-d"]
    assert call("job", "tests", "true", cwd=tree)[0] == 0  # a job joins the daemon already there
    assert (tmp_path / "mps.calls").read_text().split() == ["-d"]
    bad = queue_script(tmp_path, JOBS="0", QUEUE_DIR=str(tmp_path / "q2"))
    assert bad("start", "C.d0", cwd=tree)[::2] == (2, "queue.sh: JOBS must be a positive number, got '0'")


def test_queue_start_with_mps_refuses_when_no_context_opens_through_it(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    pipe = mps_control_stand_in(tmp_path)
    no_context = "[ \"$1\" = -c ] && { echo 'RuntimeError: CUDA error: all CUDA-capable devices are busy' >&2; exit 1; }\n"
    call = queue_script(tmp_path, python3=no_context + RUNNER_STAND_IN, MPS="1", CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    code, _, err = call("start", "C.d0", "2", cwd=tree)
    assert code == 1 and err == ("queue.sh: MPS=1: no CUDA context opened through the MPS daemon (stopped again): "
                                 "RuntimeError: CUDA error: all CUDA-capable devices are busy")
    assert not (pipe / "control").exists()  # the daemon it started is stopped again
    assert (tmp_path / "mps.calls").read_text().split() == ["-d", "quit"]
    assert not (tmp_path / "queue" / "repro.pid").exists()  # and no queue started


def test_probe_grid_tables_mark_the_best_cell():
    grid = [{"block": b, "t": t, "linear_probe_acc": acc, "knn_acc": 0.1}
            for (b, t, acc) in [(3, 0.1, 0.40), (6, 0.1, 0.52), (3, 0.3, 0.31), (6, 0.3, 0.45)]]
    recs = {"B64-uvit-a0.7-s0": {"group": "B64-uvit-a0.7", "seed": 0, "metrics": {"probe_grid": grid}},
            "B64-uvit-a1.0-s0": {"group": "B64-uvit-a1.0", "seed": 0, "metrics": {}},
            "C300-resnet50d-none-s0": {"group": "C300-resnet50d-none", "seed": 0, "metrics": {"probe_grid": grid}}}
    lines = report.probe_grid_lines(recs, "B64-uvit")
    assert lines[0] == "`B64-uvit-a0.7-s0` (seed 0): linear-probe accuracy % by noise level t and block"
    assert "| t | block 3 | block 6 |" in lines and "| 0.1 | 40.0 | **52.0** |" in lines and "| 0.3 | 31.0 | 45.0 |" in lines
    assert not any("C300" in ln or "a1.0" in ln for ln in lines)
    assert report.probe_grid_lines({}, "B64-uvit") == []


def test_best_probe_cell_is_paired_over_the_cells_every_record_probed():
    def rec(group, seed, cells):
        return {"group": group, "seed": seed,
                "metrics": {"probe_grid": [{"block": b, "t": t, "linear_probe_acc": acc} for b, t, acc in cells]}}
    coarse = lambda top: [(3, 0.1, 0.40), (9, 0.1, top), (9, 0.3, 0.99)]  # seed 0 probed t 0.3, the others not
    fine = lambda top, deep: [(3, 0.1, 0.41), (9, 0.1, top), (12, 0.02, deep), (12, 0.01, 0.3)]
    recs = {"X-s0": rec("X", 0, coarse(0.50)), "Y-s0": rec("Y", 0, coarse(0.55)),
            "X-s1": rec("X", 1, fine(0.52, 0.70)), "Y-s1": rec("Y", 1, fine(0.58, 0.60)),
            "X-s2": rec("X", 2, fine(0.53, 0.71)), "Y-s2": rec("Y", 2, fine(0.57, 0.62)),
            "Z-s0": rec("Z", 0, [(1, 0.5, 0.9)])}
    # over the cells all six probed (blocks 3, 9 at t 0.1): -5, -6, -4 -> mean -5, sd 1, t(0.975, 2) = 4.303
    line = report.grid_best_line(recs, "X", "Y", "best, X − Y")
    assert line.startswith("- best, X − Y (the best of the 2 cells every record probed: blocks 3, 9; t 0.1): "
                           "-5.00 ± 2.48 (95% CI over 3 seed pairs 0,1,2;")
    # the largest grid (seeds 1 and 2): block 12 at t 0.02 wins for X, +10 and +9
    largest = report.grid_best_line(recs, "X", "Y", "best, X − Y", largest=True)
    assert "4 cells of the largest grid: blocks 3, 9, 12; t 0.01, 0.02, 0.1): +9.50 ±" in largest
    assert "over 2 seed pairs 1,2; per seed +10.00, +9.00" in largest
    assert report.grid_best_line(recs, "X", "Z", "d") is None  # no cell in common
    assert report.grid_best_line({}, "X", "Y", "d") is None


def test_record_keeps_the_probe_grid_and_the_numbers_of_the_evaluation(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    grid = [{"block": 3, "t": 0.1, "linear_probe_acc": 0.4, "knn_acc": 0.3}]
    (run / "summary.json").write_text(json.dumps({"eval": {"probe_t0.1_knn_acc": 0.5, "probe_grid": grid,
                                                           "samples_png": "/nowhere.png", "finite": True},
                                                  "wall_s": 600.0, "eval_wall_s": 120.0}))
    arm = next(a for a in arms.build_matrix() if a.name == "B64-uvit-a0.7-s0")
    rec = runner.make_record(arm, run, epochs=64, command="c", card="card", commit="abc", records=tmp_path / "rec")
    assert rec["metrics"] == {"probe_t0.1_knn_acc": 0.5, "probe_grid": grid}
    assert (rec["train"]["wall_s_last_process"], rec["train"]["eval_wall_s"]) == (600.0, 120.0)
    assert (rec["train"]["arms_per_device"], rec["train"]["gpu_sharing"]) == (1, None)
    shared = runner.make_record(arm, run, epochs=64, command="c", card="card", commit="abc", records=tmp_path / "rec",
                                arms_per_device=5, gpu_sharing="mps")
    assert (shared["train"]["arms_per_device"], shared["train"]["gpu_sharing"]) == (5, "mps")


def test_seed_curves_average_the_seeds_that_have_a_metric_and_shade_their_range():
    s0 = [{"epoch": 10, "acc": 0.5}, {"epoch": 20, "acc": 0.6}]  # seed 0 drew no fd
    s1 = [{"epoch": 10, "acc": 0.7, "fd": 50.0}, {"epoch": 20, "acc": 0.8, "fd": 30.0}, {"epoch": 30, "acc": 0.9}]
    s2 = [{"epoch": 10, "acc": 0.6, "fd": 60.0}, {"epoch": 20, "acc": 0.7, "fd": 40.0}]
    mean, bands = report.seed_curves([s0, s1, s2], ["acc", "fd"])
    assert [p["epoch"] for p in mean] == [10, 20]  # epoch 30: one seed only
    assert mean[0]["acc"] == pytest.approx(0.6) and mean[1]["acc"] == pytest.approx(0.7)
    assert (mean[0]["fd"], mean[1]["fd"]) == (55.0, 35.0)  # over seeds 1 and 2, the two that have it
    assert bands["acc"] == ([10, 20], [0.5, 0.6], [0.7, 0.8]) and bands["fd"] == ([10, 20], [50.0, 30.0], [60.0, 40.0])
    assert report.seed_curves([s1], ["acc"]) == (s1, {})  # one seed: its own points, no band


def test_arm_slots_take_the_gpus_in_turn():
    assert runner.gpu_slots(2, 3) == [0, 1, 0, 1, 0, 1]  # two arms go to two GPUs, not both to GPU 0
    assert runner.gpu_slots(3, 1) == [0, 1, 2]
    assert runner.gpu_slots(0, 2) == [None, None]
    assert runner.gpu_slots(2, 0) == [0, 1]  # at least one arm a GPU


def test_mps_is_seen_by_its_control_pipe(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not runner.mps_running()
    (tmp_path / "control").write_text("")  # a plain file is not the daemon's pipe
    assert not runner.mps_running()
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert runner.mps_running()
    (tmp_path / "control").unlink()
    with socket.socket(socket.AF_UNIX) as endpoint:  # what the daemon makes on a current driver
        endpoint.bind(str(tmp_path / "control"))
        assert runner.mps_running()


def test_recorded_minutes_scale_training_to_the_length_and_add_the_final_evaluation():
    arm = next(a for a in arms.build_matrix() if a.name == "B64-uvit-a0.7-s1")

    def rec(seed, wall, ev, card="H200", sharing=None):
        return {"arm": f"B64-uvit-a0.7-s{seed}", "group": "B64-uvit-a0.7", "epochs": 64, "card": card,
                "train": {"wall_s_last_process": wall, **({"eval_wall_s": ev} if ev is not None else {}),
                          **({"arms_per_device": sharing} if sharing else {})}}
    measured = {"a": rec(1, 960.0, 480.0), "b": rec(2, 1020.0, 480.0)}
    # half the length: half of the training (480 / 510 s) plus the whole evaluation, median of the two
    assert runner.recorded_minutes(arm, 32, measured) == (((480 + 480) + (510 + 480)) / 2 / 60, "H200", True, 1)
    older = {**measured, "c": rec(0, 900.0, None)}  # a record from before eval_wall_s: training alone
    minutes, card, every_eval, _ = runner.recorded_minutes(arm, 64, older)
    assert (minutes, every_eval) == ((960 + 480) / 60, False)
    assert runner.recorded_minutes(arm, 64, {}) is None
    shared = {"d": rec(3, 3000.0, 480.0, sharing=6)}  # six arms on one GPU: slower an arm
    assert runner.recorded_minutes(arm, 64, {**measured, **shared})[::3] == ((960 + 480 + 1020 + 480) / 2 / 60, 1)
    assert runner.recorded_minutes(arm, 64, shared) == ((3000 + 480) / 60, "H200", True, 6)  # only shared ones


def test_claim_a_pairs_hold_four_seeds_queued_before_the_sweep():
    pairs = [a for a in arms.MATRIX if "A.pairs" in a.tags]
    assert sorted((a.labels["alpha_min"], a.seed) for a in pairs) == [(al, s) for al in (0.6, 1.0) for s in range(4)]
    assert all("model.zero_init=true" in a.overrides and a.epochs == 400 for a in pairs)
    order = [a.name for a in arms.MATRIX]
    assert max(order.index(a.name) for a in pairs) < order.index("A400-official-a0.5-s0")
    # the preset every A arm runs scores both feature kinds with both probes and keeps its features
    e = build_config("mae", "mae_cifar10", list(pairs[0].overrides)).eval
    assert (e.feature, e.extra_feature_kinds(), e.authors_probe, e.knn_standardized, e.save_features) == \
        ("cls", ["stream_mean"], True, True, True)


def _features_run(run, n_per_class=6, classes=3, dim=8):
    """A finished run folder holding a summary and a features file of well-separated blobs."""
    from dres.eval.features import features_state

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, dim, generator=g) * 4
    y = torch.arange(classes).repeat(n_per_class)
    x = {k: centers[y] * s + torch.randn(len(y), dim, generator=g) for k, s in (("cls", 1), ("stream_mean", 3))}
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"eval": {"linear_probe_acc": 0.9}}))
    torch.save(features_state(x, y, x, y, primary="cls"), run / "features.pt")


def test_record_keeps_a_balanced_part_of_the_features_and_rescore_scores_it(tmp_path, capsys):
    from dres.eval.features import balanced_subset, load_features

    run, records = tmp_path / "runs" / "A400-official-a0.6-s2", tmp_path / "rec"
    _features_run(run)
    arm = arms.BY_NAME["A400-official-a0.6-s2"]
    rec = runner.make_record(arm, run, epochs=400, command="c", card="card", commit="abc", records=records)
    kept = load_features(records / rec["artifacts"]["features"])
    assert rec["artifacts"]["features"] == "features/A400-official-a0.6-s2.pt"
    assert set(kept["train"]) == {"cls", "stream_mean"} and kept["train"]["cls"].dtype == torch.float16
    assert kept["meta"]["per_class"] == runner.RECORD_FEATURES_PER_CLASS and len(kept["test_labels"]) == 18
    assert balanced_subset(torch.tensor([2, 0, 2, 1, 0, 2, 0]), 2).tolist() == [0, 1, 2, 3, 4]
    assert repro.main(["--rescore", str(records)]) == 0
    out = json.loads((records / "rescored" / "A400-official-a0.6-s2.json").read_text())
    m = out["metrics"]
    for key in ("linear_probe_acc", "authors_probe_acc", "knn_acc", "knn_std_acc"):
        assert m[key] > 0.9 and m["stream_mean_" + key] > 0.9, (key, m)
    assert out["n_train"] == out["n_test"] == 18 and out["protocol"]["probe_epochs"] == 200
    # a run root's full features file is found too; an existing rescore is kept without --force
    assert repro.main(["--rescore", str(tmp_path / "runs"), "--records", str(records / "rescored")]) == 0
    assert "exists; kept" in capsys.readouterr().out
    assert repro.main(["--rescore", str(tmp_path / "nothing")]) == 2
    assert "records/IN_HISTORY.md" in capsys.readouterr().err  # where a record's kept features went


def test_later_arms_of_b_and_c_resolve_to_their_recipes():
    """B's later seeds probe every block at t 0.01-0.1 and measure FD over three draws with the real floor and
    along training; C's arms without head dropout and with the literal Algorithm 1, three seeds each."""
    for seed in (1, 2):
        for alpha in (1.0, 0.7):
            e = build_config("uvit", "uvit_cifar10", list(arms.BY_NAME[f"B64-uvit-a{alpha}-s{seed}"].overrides)).eval
            assert e.probe_grid_blocks == list(range(13)) and e.probe_grid_ts == [0.01, 0.02, 0.05, 0.1]
            assert (e.fd_draws, e.fd_real_floor, e.curve_fd_samples) == (3, True, 2000)
    seed0 = build_config("uvit", "uvit_cifar10", list(arms.BY_NAME["B64-uvit-a1.0-s0"].overrides)).eval
    assert seed0.probe_grid_blocks == [3, 6, 9] and seed0.fd_draws == 1  # its record's recipe, still counted
    for seed in arms.RDP_SEEDS:
        for mode in arms.MODES:
            cfg = build_config("classify", arms.TIMM_PRESET, list(arms.BY_NAME[f"C300d0-resnet50d-{mode}-s{seed}"].overrides))
            assert cfg.model.drop_rate == 0 and cfg.model.droppath_mode == mode and cfg.model.drop_path == 0.1
        literal = arms.BY_NAME[f"C300-resnet50d-residual_droppath_literal-s{seed}"]
        cfg = build_config("classify", literal.preset, list(literal.overrides))
        assert cfg.model.droppath_mode == "residual_droppath_literal" and cfg.model.drop_rate == 0.1
        frozen = arms.BY_NAME[f"C300-resnet50d-residual_droppath_frozen-s{seed}"]
        cfg = build_config("classify", frozen.preset, list(frozen.overrides))
        assert cfg.model.droppath_mode == "residual_droppath_frozen" and cfg.model.drop_rate == 0.1
    names = [a.name for a in arms.select("C.d0,C.literal,C.frozen")]
    assert len(names) == 15 and all(arms.BY_NAME[n].epochs == 300 for n in names)
    # twice the length, the standard arm beside ResidualDroppath, their recipe otherwise the 300-epoch arms'
    long = arms.select("C.long")
    assert [a.name for a in long] == [f"C600-resnet50d-{m}-s{s}" for s in (0, 1, 2) for m in ("none", "residual_droppath")]
    assert [a.name for a in arms.select("C.long.s1,C.long.s2")] == [a.name for a in long[2:]]
    for a in long:
        assert a.epochs == 600 and a.overrides == arms.BY_NAME[a.name.replace("C600", "C300")].overrides


def test_report_lists_fd_draws_the_real_floor_and_fd_along_training():
    m = {"fd_cifar_classifier_dpm50": 21.0, "fd_cifar_classifier_dpm50_draw0": 20.0,
         "fd_cifar_classifier_dpm50_draw1": 21.0, "fd_cifar_classifier_dpm50_draw2": 22.0,
         "fd_cifar_classifier_dpm50_sd": 1.0, "fd_real_cifar_classifier": 3.5}
    curves = [{"step": s, "fd_cifar_classifier_curve": f} for s, f in ((100, 90.0), (200, 60.0), (300, 65.0),
                                                                      (400, 30.0))]
    recs = {"B64-uvit-a0.7-s1": {"group": "B64-uvit-a0.7", "seed": 1, "metrics": m, "curves": curves},
            "B64-uvit-a1.0-s0": {"group": "B64-uvit-a1.0", "seed": 0, "metrics": {"fd_cifar_classifier_dpm50": 28.0},
                                 "curves": []}}
    assert report.fd_draw_lines(recs, "B64-uvit") == [
        "- `B64-uvit-a0.7-s1`: fd_cifar_classifier of 3 draws 20.00 / 21.00 / 22.00 (sd 1.00); real train images "
        "against the test images 3.50", ""]
    # ranks of FD against the steps 1..4: 4, 2, 3, 1 -> rho = 1 - 6 * (9 + 0 + 0 + 9) / (4 * 15) = -0.8
    assert report.fd_along_training_lines(recs, "B64-uvit") == [
        "- `B64-uvit-a0.7-s1`: 4 points, FD 90.0 at step 100 to 30.0 at step 400; Spearman's rho of FD with the "
        "step -0.80", ""]
    assert report.fd_draw_lines(recs, "C300") == [] and report.fd_along_training_lines({}, "B64-uvit") == []


def test_report_pairs_claim_a_every_way_its_decisive_arms_score_it(tmp_path):
    folder = tmp_path / "h100-2026-01-01-decisive"
    folder.mkdir()
    for alpha, base in ((0.6, 0.80), (1.0, 0.78)):
        for seed in (2, 3):
            arm = arms.BY_NAME[f"A400-official-a{alpha}-s{seed}"]
            metrics = {k: base + 0.01 * seed for k in ("linear_probe_acc", "knn_acc", "knn_std_acc",
                                                       "authors_probe_acc", "stream_mean_authors_probe_acc",
                                                       "stream_mean_linear_probe_acc", "stream_mean_knn_acc",
                                                       "stream_mean_knn_std_acc")}
            (folder / f"{arm.name}.json").write_text(json.dumps({
                "arm": arm.name, "claim": "A", "group": arm.group, "seed": seed, "epochs": 400, "steps": 19200,
                "overrides": list(arm.overrides), "curves": [], "train": {}, "artifacts": {}, "card": "cpu",
                "date": "2026-01-01T00:00:00", "commit": "abc", "command": "x",
                "metrics": {**metrics, "effective_rank_entropy": 3.0, "effective_rank": 20.0}}))
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=False)
    rows = {l.split(" | ")[0].lstrip("| "): l for l in text.splitlines() if l.startswith("| ")}
    for _, what in report.A_SECONDARY:  # every readout at 400 epochs, the secondary ones Bonferroni-adjusted for 8
        assert ("| — | — | +2.00 ± 0.00 (+2.00 to +2.00, n=2 pairs); Bonferroni x8: ± 0.00 | — |") in rows[what]
    assert "| — | — | +2.00 ± 0.00 (+2.00 to +2.00, n=2 pairs) | — |" in rows["**primary**: the authors' probe on the class token"]
    assert "| official | 0.6 | true | 400 | 2,3 | 82.5 ± 0.7 (n=2) | 82.5 ± 0.7 (n=2) | 82.5 ± 0.7 (n=2) |" in text


def test_queue_wait_packs_the_records_with_their_kept_features(tmp_path):
    """The records travel with their kept features (records.tgz, 1.5 MB an arm); the run folders without
    checkpoints or full features (runs.tgz)."""
    queue = tmp_path / "queue"
    (queue / "records" / "features").mkdir(parents=True)
    (queue / "records" / "A400-official-a0.6-s2.json").write_text("{}")
    (queue / "records" / "features" / "A400-official-a0.6-s2.pt").write_bytes(b"kept")
    (queue / "runs" / "A400-official-a0.6-s2" / "checkpoints").mkdir(parents=True)
    (queue / "runs" / "A400-official-a0.6-s2" / "features.pt").write_bytes(b"full")
    (queue / "runs" / "A400-official-a0.6-s2" / "metrics.jsonl").write_text("{}\n")
    (queue / "repro.log").write_text("[repro] done A400-official-a0.6-s2: {}\n")
    (queue / "repro.pid").write_text("999999999\n")  # no such process: the queue has ended
    code, out, _ = queue_script(tmp_path)("wait", "0")
    assert code == 0 and "[repro] done A400-official-a0.6-s2" in out
    with tarfile.open(tmp_path / "out" / "records.tgz") as tar:
        assert sorted(tar.getnames()) == ["records", "records/A400-official-a0.6-s2.json", "records/features",
                                          "records/features/A400-official-a0.6-s2.pt"]
        assert tar.extractfile("records/features/A400-official-a0.6-s2.pt").read() == b"kept"
    with tarfile.open(tmp_path / "out" / "runs.tgz") as tar:
        assert "runs/A400-official-a0.6-s2/metrics.jsonl" in tar.getnames()
        assert not any(n.endswith(("features.pt", "checkpoints")) for n in tar.getnames())


def test_queue_wait_that_ends_with_arms_still_running_packs_them_and_exits_3_naming_them(tmp_path):
    """A pack made while arms still train is partial: wait says which arms run on, and exits 3, so that the host
    is not given back with them (their run folders live there only)."""
    queue = tmp_path / "queue"
    (queue / "records").mkdir(parents=True)
    (queue / "runs" / "C600-resnet50d-none-s2").mkdir(parents=True)
    (queue / "repro.log").write_text(
        "[repro] start C600-resnet50d-none-s2 on GPU 1: python -m dres.train.classify\n"
        "[repro] start C600-resnet50d-residual_droppath-s2 on GPU 1: python -m dres.train.classify\n"
        "[repro] done C600-resnet50d-residual_droppath-s2: {'top1': 0.87}\n"
        "[repro] resume A800-official-a0.6-s0 on GPU 0: python -m dres.train.mae\n")
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (queue / "repro.pid").write_text(f"{alive.pid}\n")
        code, out, err = queue_script(tmp_path)("wait", "0")
    finally:
        alive.kill()
    assert code == 3
    assert err.startswith("queue.sh: still running after 0 s (arms ") and "what is packed is partial" in err
    named = err.split("(arms ", 1)[1].split(";", 1)[0].split()
    assert sorted(named) == ["A800-official-a0.6-s0", "C600-resnet50d-none-s2"]
    with tarfile.open(tmp_path / "out" / "runs.tgz") as tar:
        assert "runs/C600-resnet50d-none-s2" in tar.getnames()


def _a_record(folder, length, alpha, seed, gap_points, **metrics):
    """A claim-A record of the official arm at ``length`` epochs whose every accuracy is 0.80 + gap_points / 100
    (alpha 0.6) or 0.80 (alpha 1.0), unless ``metrics`` gives it."""
    arm = arms.BY_NAME[f"A{length}-official-a{alpha}-s{seed}"]
    acc = 0.80 + (gap_points / 100 if alpha == 0.6 else 0.0)
    m = {k: acc for k in [report.A_PRIMARY[0]] + [k for k, _ in report.A_SECONDARY]} | metrics
    (folder / f"{arm.name}.json").write_text(json.dumps({
        "arm": arm.name, "claim": "A", "group": arm.group, "seed": seed, "epochs": length, "steps": 1,
        "overrides": list(arm.overrides), "curves": [], "train": {}, "artifacts": {}, "card": "cpu",
        "date": "2026-01-01T00:00:00", "commit": "abc", "command": "x", "metrics": m}))


def test_claim_a_verdict_is_the_primary_readout_per_length_with_its_n_interval_and_trend(tmp_path):
    """The verdict lines of claim A carry each length's n and 95% t interval of the primary readout, and the
    least-squares slope of the gap on log2(epochs) with its own; the top of the report says how many readouts
    were looked at; the gap against length is drawn."""
    from scipy.stats import linregress, t

    folder = tmp_path / "cpu-2026-01-01-lengths"
    folder.mkdir()
    gaps = {100: (-3.0, -2.0, -4.0), 400: (1.0, 2.0, 0.0)}
    for length, per_seed in gaps.items():
        for seed, gap in enumerate(per_seed):
            for alpha in (0.6, 1.0):
                _a_record(folder, length, alpha, seed, gap)
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=True)
    verdict = [l for l in text.splitlines() if l.startswith("- primary readout (the authors' probe on the class token)")]
    half = t.ppf(0.975, 2) * 1.0 / math.sqrt(3)  # sd 1 over three pairs
    assert verdict[0].endswith(f"100 epochs: -3.00 ± {half:.2f} ({-3 - half:+.2f} to {-3 + half:+.2f}, n=3 pairs), "
                               "95% t interval; seed 0 -3.00, seed 1 -2.00, seed 2 -4.00")
    assert verdict[1].endswith("200 epochs: not run yet") and "400 epochs: +1.00 ± " in verdict[2]
    fit = linregress([math.log2(100)] * 3 + [math.log2(400)] * 3, [-3.0, -2.0, -4.0, 1.0, 2.0, 0.0])
    trend = next(l for l in text.splitlines() if l.startswith("- trend of the primary readout"))
    assert f"{fit.slope:+.2f} ± {t.ppf(0.975, 4) * fit.stderr:.2f} points per doubling" in trend
    assert "n=6 pairs at 100, 400 epochs" in trend and abs(fit.slope - 2.0) < 1e-9  # 4 points over two doublings
    glance = text[text.index("## At a glance"):text.index("## A. ")]
    assert "one of 8 readouts looked at" in glance and "100 epochs -3.00 ± " in glance and "n=3 pairs" in glance
    assert (tmp_path / "figures" / "mae_gap_by_length.png").stat().st_size > 0
    # one pair at a length: its value, said to carry no interval
    _a_record(folder, 800, 0.6, 0, 5.0), _a_record(folder, 800, 1.0, 0, 0.0)
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=False)
    assert "800 epochs: +5.00 (n=1 pair, no interval)" in text


PLUS_MINUS = re.compile(r"[+-]?\d+(\.\d+)? ± \d+(\.\d+)?")


def test_committed_verdicts_say_no_more_than_their_intervals():
    """Every interval RESULTS.md's "At a glance" quotes names how many pairs it rests on, in its sentence; "excludes
    0" comes with the readouts it was one of; no verdict there is "decided" or "recovers all"."""
    text = (runner.REPO_ROOT / "RESULTS.md").read_text()
    glance = text[text.index("## At a glance"):text.index("## A. ")]
    for sentence in re.split(r"(?<=[.;])\s", glance):
        if PLUS_MINUS.search(sentence):
            assert re.search(r"n=\d+|\b(two|three|four|\d+) (seed )?pairs", sentence), sentence
        if "excludes 0" in sentence:
            assert "readouts" in sentence, sentence
    assert not re.search(r"\bdecided\b|recovers all|\bties\b", glance)


# ------------------------------------------------------------------------------------------------
# Claim A's probe sweep (experiments/probe_sweep.py)


def _noisy_features(n_train=300, n_test=100, classes=4, dim=8, noise=2.0, seed=0):
    """Blobs of ``classes`` centres with Gaussian noise, separable but not perfectly; the stream mean's channels
    of unequal scale (what the raw and the standardised probe read differently)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 3
    y = torch.randint(0, classes, (n_train + n_test,), generator=g)
    cls = centers[y] + noise * torch.randn(len(y), dim, generator=g)
    stream_mean = (centers[y] + noise * torch.randn(len(y), dim, generator=g)) * torch.logspace(-2, 2, dim)
    return {"cls": cls, "stream_mean": stream_mean}, y


def _sweep_run(run, seed=0, finished=True):
    """A run folder of a claim-A arm: its kept features and, where ``finished``, its summary's fixed-recipe probes."""
    from dres.eval.features import features_state

    x, y = _noisy_features(seed=seed)
    run.mkdir(parents=True)
    torch.save(features_state({k: v[:300] for k, v in x.items()}, y[:300], {k: v[300:] for k, v in x.items()},
                              y[300:], primary="cls"), run / "features.pt")
    if finished:
        (run / "summary.json").write_text(json.dumps({"eval": {"linear_probe_acc": 0.5 + seed / 100,
                                                               "authors_probe_acc": 0.4, "knn_acc": 0.3}}))


def test_headwise_adamw_is_torchs_adamw_with_each_heads_lr_and_weight_decay():
    """Each head moves as torch's AdamW with that head's learning rate and weight decay, the schedule's scale
    included; a head at scale 0 holds."""
    from experiments.probe_sweep import HeadwiseAdamW

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, generator=g)
    lrs, wds, scale = [1e-3, 1e-2, 1e-1], [0.0, 0.01, 0.5], [1.0, 0.5, 0.0]
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    opt = HeadwiseAdamW([w, b], lr=torch.tensor(lrs), weight_decay=torch.tensor(wds))
    lone = [(weight[h].clone().requires_grad_(), bias[h].clone().requires_grad_()) for h in range(3)]
    lone_opts = [torch.optim.AdamW(p, lr=lrs[h], weight_decay=wds[h]) for h, p in enumerate(lone)]
    for step in range(6):
        if step == 3:
            opt.lr_scale = torch.tensor(scale)
            for h, o in enumerate(lone_opts):
                o.param_groups[0]["lr"] = lrs[h] * scale[h]
            held = w[2].detach().clone()
        grad_w, grad_b = torch.randn(weight.shape, generator=g), torch.randn(bias.shape, generator=g)
        w.grad, b.grad = grad_w.clone(), grad_b.clone()
        opt.step()
        for h, (lw, lb) in enumerate(lone):
            lw.grad, lb.grad = grad_w[h].clone(), grad_b[h].clone()
            lone_opts[h].step()
    for h, (lw, lb) in enumerate(lone):
        torch.testing.assert_close(w[h], lw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b[h], lb, rtol=1e-5, atol=1e-6)
    assert torch.equal(w[2], held)


def test_every_head_of_the_sweep_is_the_lone_probe_of_its_setting():
    """The grid's probes trained together score as each setting's dres.eval.linear_probe alone: the same draw,
    batches, schedule over its own epochs, raw or standardised features."""
    from dres.eval import linear_probe
    from experiments.probe_sweep import grid_settings, sweep_accuracies

    x, y = _noisy_features()
    x = x["stream_mean"]
    settings = grid_settings((1e-3, 1e-1), (0.0, 0.3), (1, 3))
    assert [s.standardized for s in settings] == [False] * 8 + [True] * 8
    together = sweep_accuracies(x[:300], y[:300], x[300:], y[300:], settings, batch_size=64)
    alone = [linear_probe(x[:300], y[:300], x[300:], y[300:], epochs=s.epochs, lr=s.lr, weight_decay=s.weight_decay,
                          standardized=s.standardized, batch_size=64)["linear_probe_acc"] for s in settings]
    assert together == alone
    assert len(set(alone)) > 3  # the settings differ: the comparison is not of a few saturated scores


def test_probe_sweep_chooses_on_held_out_train_images_and_scores_the_choice_on_test(tmp_path, capsys):
    """A run root's finished claim-A arms swept into one JSON each: every setting's held-out accuracy on 10% of the
    train split, the best one trained on the whole train split and scored on test, the run's fixed-recipe probes
    kept; an unfinished arm passed over, an existing JSON kept, bad input one line (exit 2)."""
    from dres.eval import linear_probe
    from experiments import probe_sweep

    root, out = tmp_path / "runs", tmp_path / "sweep"
    _sweep_run(root / "A100-official-a0.6-s0")
    _sweep_run(root / "A100-official-a1.0-s0", finished=False)
    _sweep_run(root / "C300-resnet50d-none-s0")  # not a claim-A arm
    grid = ["--lrs", "0.001,0.1", "--wds", "0,0.1", "--epochs", "1,3"]
    assert probe_sweep.main([str(root), "--out", str(out)] + grid) == 0
    assert sorted(p.name for p in out.iterdir()) == ["A100-official-a0.6-s0.json"]
    assert "A100-official-a1.0-s0: its run has not finished" in capsys.readouterr().out
    res = json.loads((out / "A100-official-a0.6-s0.json").read_text())
    assert res["run_eval"] == {"linear_probe_acc": 0.5, "authors_probe_acc": 0.4}
    assert (res["n_train"], res["n_test"], res["primary"]) == (300, 100, "cls")
    assert res["grid"] == {"lr": [0.001, 0.1], "weight_decay": [0.0, 0.1], "epochs": [1, 3]}
    x, y = _noisy_features()
    for kind, metric in (("cls", "swept_probe_acc"), ("stream_mean", "stream_mean_swept_probe_acc")):
        k = res["kinds"][kind]
        assert (k["n_fit"], k["n_held_out"]) == (270, 30) and len(k["held_out"]) == 16
        accs = [h["acc"] for h in k["held_out"]]
        assert k["held_out_acc"] == max(accs) and k["chosen"] == {
            key: v for key, v in k["held_out"][accs.index(max(accs))].items() if key != "acc"}
        c = k["chosen"]
        final = linear_probe(x[kind][:300], y[:300], x[kind][300:], y[300:], epochs=c["epochs"], lr=c["lr"],
                             weight_decay=c["weight_decay"], standardized=c["standardized"], batch_size=1024)
        assert res["metrics"][metric] == k["test_acc"] == final["linear_probe_acc"] > 0.6
    # the channels of unequal scale: the raw probe below the standardised one at the same setting on held-out images
    held = {(h["lr"], h["weight_decay"], h["epochs"], h["standardized"]): h["acc"]
            for h in res["kinds"]["stream_mean"]["held_out"]}
    assert held[0.001, 0.0, 3, False] < held[0.001, 0.0, 3, True]
    assert probe_sweep.main([str(root), "--out", str(out)] + grid) == 0
    assert "exists; kept" in capsys.readouterr().out
    # a run folder or a features file named alone; --arms picks a run root's arms
    assert probe_sweep.main([str(root / "C300-resnet50d-none-s0"), "--out", str(out)] + grid) == 0
    assert (out / "C300-resnet50d-none-s0.json").is_file()
    for args, message in (([str(tmp_path / "none")], "RUN_OR_FEATURES: "), ([str(root), "--arms", "A.nothing"],
                                                                             "--arms: no arm, group, tag or claim"),
                          ([str(root), "--lrs", "0,0.1"], "--lrs: '0,0.1' must be positive"),
                          ([str(root), "--epochs", "2.5"], "--epochs: '2.5' is not a comma list"),
                          ([str(root), "--held-out", "1"], "--held-out: 1 must be between 0 and 1"),
                          ([str(root), "--arms", "A.length.e200"], "no run root with a claim-A arm")):
        assert probe_sweep.main(args + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_report_shows_the_sweep_beside_the_fixed_recipe_as_a_secondary_readout(tmp_path):
    """Sweeps of the records' runs: a row per arm and feature kind with the record's fixed-recipe probes, official
    0.6 − official 1.0 of the swept probe with its n and interval, adjusted for the ten readouts now counted (the
    top of the report too); a sweep of another run than the record's is not counted."""
    from experiments import probe_sweep

    folder, runs = tmp_path / "cpu-2026-01-01-lengths", tmp_path / "runs"
    folder.mkdir()
    data_seed = {(0.6, 0): 0, (1.0, 0): 1, (0.6, 1): 2, (1.0, 1): 3, (0.6, 2): 4}
    for (alpha, seed), data in data_seed.items():
        _sweep_run(runs / f"A400-official-a{alpha}-s{seed}", seed=data)
        recorded = 0.99 if seed == 2 else 0.5 + data / 100  # seed 2's record is of another run
        _a_record(folder, 400, alpha, seed, 1.0, linear_probe_acc=recorded, authors_probe_acc=0.4)
    assert probe_sweep.main([str(runs), "--out", str(folder / "probe_sweep"), "--lrs", "0.1", "--wds", "0",
                             "--epochs", "2"]) == 0
    sweeps = probe_sweep.load_sweeps(tmp_path)
    assert sorted(sweeps) == sorted(f"A400-official-a{a}-s{s}" for a, s in data_seed)
    text = report.render(tmp_path, tmp_path, figures=tmp_path / "figures", notes=tmp_path / "notes.md", draw=False)
    section = text[text.index("### Claim A: the probe sweep, a secondary readout"):]
    assert "counts 10 readouts" in section and "learning rate 0.1 x weight decay 0 x 2 epochs" in section
    swept = sweeps["A400-official-a0.6-s0"]["kinds"]["stream_mean"]
    chosen = f"lr 0.1, wd 0, 2 epochs, {'standardised' if swept['chosen']['standardized'] else 'raw'}"
    assert (f"| `A400-official-a0.6-s0` | stream_mean | 300 (30 held out) / 100 | 81.0 | 81.0 | "
            f"**{100 * swept['test_acc']:.1f}** | {chosen} | {100 * swept['held_out_acc']:.1f} |") in section
    assert "| `A400-official-a0.6-s0` | cls | 300 (30 held out) / 100 | 50.0 | 40.0 |" in section
    for metric, what in report.A_SWEPT:
        d = [100 * (sweeps[f"A400-official-a0.6-s{s}"]["metrics"][metric]
                    - sweeps[f"A400-official-a1.0-s{s}"]["metrics"][metric]) for s in (0, 1)]
        assert (f"- {what}, official 0.6 − official 1.0, 400 epochs: {report.interval(d)}, 95% t interval; "
                f"Bonferroni x10: ± {report.t_half_width(d, 10):.2f}") in section
        assert "n=2 pairs" in report.interval(d)
    assert "Not counted (a sweep of another run than the arm's record, or of an arm without one): " \
           "`A400-official-a0.6-s2`." in section
    glance = text[text.index("## At a glance"):text.index("## A. ")]
    assert "one of 10 readouts looked at" in glance
    rows = {l.split(" | ")[0].lstrip("| "): l for l in text.splitlines() if l.startswith("| ")}
    assert all("Bonferroni x10" in rows[w] for w in ("the swept probe on the class token", "kNN on the class token"))
