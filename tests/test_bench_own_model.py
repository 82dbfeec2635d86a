"""The "your model" benchmark's harness on the CPU (benchmarks/bench_own_model.py): the plan, the arms'
processes and records, the summary and its table from hand-made arm records, failed and unstarted arms,
``--skip-existing``. One tiny end-to-end run (a timm and a Hugging Face model, eager arms, 3 steps); the
figures themselves are the GPU's."""

from __future__ import annotations

import dataclasses
import json
import sys
from unittest import mock

import pytest
import torch

from benchmarks import bench_own_model as bench
from dres.ops import csrc_backend

pytest.importorskip("timm")
pytest.importorskip("transformers")

TINY_RUN = ["--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1"]


def arm_record(model: str, arm: str, rate: float | None, *, repeat: int = 0, peak: float | None = None,
               reserved: float | None = None, losses: list | None = None, error: str | None = None, **extra) -> dict:
    """An arm record as a worker writes it, with the figures the summary reads."""
    return {**bench.arm_identity(model, arm, repeat, tiny=False), "samples_per_s": rate, "peak_mem_gib": peak,
            "peak_reserved_gib": reserved, "losses": losses or [2.0, 1.5, 1.0], "error": error, **extra}


# ---------------------------------------------------------------------------------------------
# the plan and the command line


def test_plan_runs_model_by_model_slowest_arms_first_and_alternates_plain_and_converted():
    jobs = bench.plan_jobs(["vit_b16", "hf_bert"], ["plain_eager", "converted_eager", "plain_step"], repeats=2)
    assert [j.name for j in jobs] == [
        "vit_b16-plain_step-0", "vit_b16-converted_eager-0", "vit_b16-plain_eager-0",
        "hf_bert-plain_step-0", "hf_bert-converted_eager-0", "hf_bert-plain_eager-0",
        "vit_b16-plain_step-1", "vit_b16-plain_eager-1", "vit_b16-converted_eager-1",
        "hf_bert-plain_step-1", "hf_bert-plain_eager-1", "hf_bert-converted_eager-1"]


def test_dry_run_lists_every_arm_process(tmp_path, capsys):
    out = tmp_path / "records"
    assert bench.main(["--dry-run", "--models", "resnet50d_32", "--repeats", "2", "--gpus", "0,1", "--out",
                       str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# 12 arm process(es), 2 at a time, 60 steps each (20 warm-up)")
    arms = [line.split(":")[0] for line in lines[1:] if not line.startswith("  ")]
    assert arms == [j.name for j in bench.plan_jobs(["resnet50d_32"], bench.DEFAULT_ARMS, 2)]
    commands = [line.strip() for line in lines if line.startswith("  ")]
    assert len(commands) == 12 and "--models resnet50d_32 --arms converted_step --worker 0" in commands[0]
    assert not any("--no-csrc" in c for c in commands)
    assert bench.main(["--dry-run", "--models", "resnet50d_32", "--no-csrc", "--out", str(out)]) == 0
    commands = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(commands) == 6 and all(c.endswith("--no-csrc") for c in commands)  # every arm's process
    assert not out.exists()


def test_parallel_arms_get_their_own_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(range(64, 128)))
    shares = bench.core_shares(4)
    assert shares == [list(range(64 + 16 * k, 80 + 16 * k)) for k in range(4)]
    args = bench.build_parser().parse_args(["--out", "x"])
    command = bench.worker_command(bench.Job("hf_vit", "plain_eager", 1), args, shares[1])
    assert command[-2:] == ["--cores", ",".join(map(str, range(80, 96)))]
    assert bench.build_parser().parse_args(command[3:]).cores == list(range(80, 96))


@pytest.mark.parametrize("argv,named", [
    (["--models", "vit_b16,resnet"], "--models"),
    (["--arms", "plain_eager,graphed"], "--arms"),
    (["--gpus", "0,x"], "--gpus"),
    (["--gpus", "0,0"], "--gpus"),
    (["--steps", "5", "--warmup", "5"], "--steps"),
    (["--warmup", "0"], "--warmup"),
    (["--arms", "plain_eager,converted_step", "--warmup", "3"], "--warmup"),
    (["--repeats", "0"], "--repeats"),
    (["--profile-steps", "-1"], "--profile-steps"),
    (["--host-steps", "-2"], "--host-steps"),
    (["--device", "cpu", "--gpus", "0"], "--gpus"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err.splitlines()[-1]


def test_every_arm_starts_from_the_same_weights_and_batches():
    """Plain and converted models are built from one seed (the drop path of the plain ViT is timm's, the
    converted one's the controller's, neither a parameter); the batches are drawn from their seed, MAE's
    masking noise the same in every batch."""
    for name in ("vit_b16", "hf_vitmae"):
        spec = bench.MODELS[name]
        weights = []
        for converted in (False, True):
            torch.manual_seed(bench.MODEL_SEED)
            model = spec.build(spec.tiny, converted, {})
            weights.append({k: v for k, v in model.state_dict().items() if not k.startswith("droppath.")})
        assert weights[0].keys() == weights[1].keys()
        for key, value in weights[0].items():
            torch.testing.assert_close(weights[1][key], value, rtol=0, atol=0)
    first, again = (bench.make_batches(bench.MODELS["hf_vitmae"], bench.MODELS["hf_vitmae"].tiny, torch.device("cpu"))
                    for _ in range(2))
    assert len(first) == bench.NUM_BATCHES
    assert not torch.equal(first[0][0], first[1][0])  # distinct images
    assert all(torch.equal(b[1], first[0][1]) for b in first)  # one noise
    assert all(torch.equal(a, b) for x, y in zip(first, again) for a, b in zip(x, y))


@pytest.mark.parametrize("name", ["vit_b16", "hf_bert", "hf_clip_vision", "resnet50d_32"])
def test_no_fused_mlp_converts_with_the_models_own_mlps(name):
    """--no-fused-mlp: the converted model's forward calls dres.ops.fused_mlp nowhere (a ResNet has no MLP);
    the default conversion calls it in every block; the arm's command passes the flag on."""
    import dres.ops

    spec = bench.MODELS[name]
    batch = bench.make_batches(spec, spec.tiny, torch.device("cpu"))[0]
    calls = []
    for fused_mlp in (True, False):
        torch.manual_seed(bench.MODEL_SEED)
        model = spec.build(spec.tiny, True, {"fused_mlp": fused_mlp})
        with mock.patch.object(dres.ops, "fused_mlp", wraps=dres.ops.fused_mlp) as counted:
            spec.loss(model, *batch)
        calls.append(counted.call_count)
    assert calls == ([0, 0] if name.startswith("resnet") else [2, 0])  # the tiny configs' two blocks
    args = bench.build_parser().parse_args(["--no-fused-mlp", "--models", name, "--arms", "converted_eager"])
    assert "--no-fused-mlp" in bench.worker_command(bench.Job(name, "converted_eager", 0), args)


@pytest.mark.parametrize("flag,model,key,said", [
    ("--no-fused-mlp", "hf_bert", "fused_mlp", "the converted models keep their own MLPs (--no-fused-mlp)"),
    ("--no-aligned-head", "hf_gpt2", "aligned_head", "heads left as HF has them (--no-aligned-head)")])
def test_a_conversion_flag_says_so_in_its_records_and_table(tmp_path, flag, model, key, said):
    out = tmp_path / "own"
    assert bench.main([*TINY_RUN, flag, "--models", model, "--arms", "converted_eager", "--out", str(out)]) == 0
    assert [r[key] for r in bench.load_arm_records(out)] == [False]
    assert json.loads((out / "summary.json").read_text())[key] == [False]
    assert said in (out / "own-models.md").read_text()
    args = bench.build_parser().parse_args([flag, "--models", model, "--arms", "converted_eager"])
    assert flag in bench.worker_command(bench.Job(model, "converted_eager", 0), args)


def test_no_aligned_head_keeps_the_language_models_heads():
    """The converted language models' heads are AlignedLinear by default, HF's Linear with aligned_head=False; the
    converters that do not take the argument build as before."""
    from dres.convert import AlignedLinear

    for name in ("hf_bert", "hf_gpt2", "vit_b16"):
        spec = bench.MODELS[name]
        heads = []
        for aligned_head in (True, False):
            torch.manual_seed(bench.MODEL_SEED)
            model = spec.build(spec.tiny, True, {"fused_mlp": True, "aligned_head": aligned_head})
            heads.append(type(model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None)
        assert heads == ([AlignedLinear, torch.nn.Linear] if name != "vit_b16" else [None, None])  # tiny vocab: 100


def test_a_bf16_stream_run_converts_the_timm_vits_with_it_and_says_so(tmp_path, capsys):
    """--stream-dtype bf16: the converted timm ViT's stream_dtype, the arm's command passes it on, the records and
    the table say so; a model whose converter does not take it is an argument error (exit 2, naming both)."""
    spec = bench.MODELS["vit_b16"]
    torch.manual_seed(bench.MODEL_SEED)
    assert spec.build(spec.tiny, True, {"stream_dtype": torch.bfloat16}).blocks.stream_dtype is torch.bfloat16
    out = tmp_path / "own"
    assert bench.main([*TINY_RUN, "--stream-dtype", "bf16", "--models", "dinov2_s14", "--arms", "converted_eager",
                       "--out", str(out)]) == 0
    assert [r["stream_dtype"] for r in bench.load_arm_records(out)] == ["bf16"]
    assert json.loads((out / "summary.json").read_text())["stream_dtype"] == ["bf16"]
    assert "residual stream in bf16 under autocast (--stream-dtype bf16)" in (out / "own-models.md").read_text()
    args = bench.build_parser().parse_args(["--stream-dtype", "bf16", "--models", "vit_b16", "--arms", "plain_eager"])
    assert bench.worker_command(bench.Job("vit_b16", "plain_eager", 0), args)[-2:] == ["--stream-dtype", "bf16"]
    with pytest.raises(SystemExit) as e:
        bench.main(["--stream-dtype", "bf16", "--models", "vit_b16,hf_vit", "--dry-run"])
    assert e.value.code == 2
    assert ("--stream-dtype bf16: only the timm ViTs' converter takes it (vit_b16, dinov2_s14), not hf_vit"
            in capsys.readouterr().err)


@pytest.mark.parametrize("arm, calls", [("converted_eager", 1), ("plain_eager", 0)])
def test_backend_points_the_converted_models_ops_at_it(arm, calls):
    """--backend: every fused module of a converted model takes it (the plain model has none); the arm's command
    passes it on."""
    import dres.nn

    with mock.patch.object(dres.nn, "set_backend", wraps=dres.nn.set_backend) as pointed:
        bench.measure_arm("vit_b16", arm, device=torch.device("cpu"), tiny=True, steps=2, warmup=1, backend="torch")
    assert pointed.call_count == calls
    if calls:
        model = pointed.call_args.args[0]
        assert pointed.call_args.args[1] == "torch" and model.blocks.backend == "torch"
    args = bench.build_parser().parse_args(["--backend", "torch", "--models", "vit_b16", "--arms", arm])
    assert bench.worker_command(bench.Job("vit_b16", arm, 0), args)[-2:] == ["--backend", "torch"]


def test_the_inductor_arm_puts_the_converted_models_ops_on_torch_whatever_backend_says():
    """converted_compiled_inductor: the converted model compiled with its ops on their PyTorch formulas, beside the
    arms on the dres kernels in one command; not run unless named."""
    import dres.nn

    with mock.patch.object(dres.nn, "set_backend", wraps=dres.nn.set_backend) as pointed, \
            mock.patch.object(torch, "compile", lambda model: model):  # the choice of backend, not Inductor on a CPU
        rec = bench.run_arm("vit_b16", "converted_compiled_inductor", 0, device=torch.device("cpu"), tiny=True,
                            steps=2, warmup=1, backend="triton")
    assert rec["error"] is None and rec["backend"] == "torch"
    assert pointed.call_args.args[1] == "torch" and pointed.call_args.args[0].blocks.backend == "torch"
    record = bench.arm_identity("vit_b16", "converted_compiled_inductor", 0, tiny=True)
    assert record["converted"] and record["mode"] == "compiled"
    default_arms = bench.build_parser().parse_args([]).arms
    assert "converted_compiled_inductor" not in default_arms and "converted_compiled_kernels" not in default_arms
    assert bench.ARMS["converted_compiled_kernels"].backend == "triton"  # every op on the dres kernels
    jobs = bench.plan_jobs(["dinov2_s14"], ["plain_compiled", "converted_compiled", "converted_compiled_inductor"], 2)
    assert [j.name for j in jobs] == [
        "dinov2_s14-converted_compiled-0", "dinov2_s14-converted_compiled_inductor-0", "dinov2_s14-plain_compiled-0",
        "dinov2_s14-plain_compiled-1", "dinov2_s14-converted_compiled-1", "dinov2_s14-converted_compiled_inductor-1"]


def test_a_backend_run_says_so_in_its_records_and_table(tmp_path):
    out = tmp_path / "own"
    assert bench.main([*TINY_RUN, "--backend", "torch", "--models", "hf_bert", "--arms", "converted_eager",
                       "--out", str(out)]) == 0
    assert [r["backend"] for r in bench.load_arm_records(out)] == ["torch"]
    assert json.loads((out / "summary.json").read_text())["backend"] == ["torch"]
    assert "the converted models' dres.ops backend: torch" in (out / "own-models.md").read_text()


# ---------------------------------------------------------------------------------------------
# the summary and the table


def hand_made_records() -> list[dict]:
    vit = [
        arm_record("vit_b16", "plain_eager", 1000.0, peak=10.0, losses=[2.0, 1.5, 1.0]),
        arm_record("vit_b16", "converted_eager", 1500.0, peak=8.0, losses=[2.0, 1.52, 1.03]),
        arm_record("vit_b16", "plain_compiled", 2000.0, peak=9.0, losses=[2.0, 1.49, 1.01]),
        arm_record("vit_b16", "converted_compiled", 2400.0, peak=8.0, losses=[2.0, 1.5, 0.98], graphs=3,
                   graph_breaks=2),
        arm_record("vit_b16", "converted_compiled", 2600.0, repeat=1, peak=9.0, losses=[2.0, 1.5, 0.9], graphs=3,
                   graph_breaks=2),
        arm_record("vit_b16", "converted_compiled_inductor", 2200.0, peak=8.8, losses=[2.0, 1.5, 1.0], graphs=1,
                   graph_breaks=0, backend="torch"),
        arm_record("vit_b16", "converted_compiled_kernels", 2300.0, peak=8.0, backend="triton"),
        # a replayed graph's activations are reserved, not allocated: the steps compare the reserved peaks
        arm_record("vit_b16", "plain_step", 2200.0, peak=1.5, reserved=10.0, captured=True, why_eager=None),
        arm_record("vit_b16", "converted_step", 3000.0, peak=1.5, reserved=9.0, captured=True, why_eager=None),
    ]
    bert = [
        arm_record("hf_bert", "plain_eager", 500.0, peak=4.0),
        arm_record("hf_bert", "converted_eager", None, error="OutOfMemoryError: CUDA out of memory."),
        arm_record("hf_bert", "converted_step", 700.0, peak=3.0, captured=False,
                   why_eager="dres.compile_step: the step runs eagerly: the device is cpu, not CUDA"),
    ]
    return bert + vit


def test_summary_ratios_come_from_the_arms_figures():
    rows = bench.summarize(hand_made_records())
    assert [r["model"] for r in rows] == ["vit_b16", "hf_bert"]  # MODELS' order
    vit, bert = rows
    compiled = vit["arms"]["converted_compiled"]
    assert compiled["samples_per_s"] == 2500.0 and compiled["processes"] == 2  # the median of the repeats
    assert compiled["spread_pct"] == pytest.approx(100 * 200 / 2500)
    assert vit["eager_ratio"] == pytest.approx(1.5)
    assert vit["compiled_ratio"] == pytest.approx(1.25)
    assert vit["compiled_inductor_ratio"] == pytest.approx(1.1)
    assert vit["compiled_kernels_ratio"] == pytest.approx(1.15)
    assert bert["compiled_inductor_ratio"] is None
    assert vit["step_vs_plain_compiled"] == pytest.approx(1.5)
    assert vit["plain_step_vs_plain_compiled"] == pytest.approx(1.1)
    assert vit["peak_mem_ratio"] == pytest.approx({"eager": 0.8, "compiled": 8.5 / 9.0, "step": 0.9})
    assert vit["loss_diff"]["converted_eager"] == pytest.approx(0.03)
    # repeat 1 has no plain eager repeat to be compared with: repeat 0's difference alone
    assert vit["loss_diff"]["converted_compiled"] == pytest.approx(0.02)
    assert vit["loss_noise"] == vit["loss_diff"]["plain_compiled"] == pytest.approx(0.01)
    assert vit["loss_diff"]["converted_step"] == 0.0
    assert bert["arms"]["converted_eager"] == {"processes": 0, "errors": ["OutOfMemoryError: CUDA out of memory."]}
    assert bert["eager_ratio"] is None and bert["compiled_ratio"] is None and bert["step_vs_plain_compiled"] is None
    assert bert["loss_diff"] == {"converted_eager": None, "converted_step": 0.0} and bert["loss_noise"] is None


def test_table_quotes_each_model_with_its_ratios_failures_and_unstarted_arms():
    records = hand_made_records()
    failed = [r for r in records if r.get("error")]
    table = bench.markdown(bench.summarize(records), header=["HEADER"], failed=failed,
                           not_run=["hf_bert-plain_compiled-0"])
    lines = table.splitlines()
    assert lines[0] == "HEADER"
    vit = next(line for line in lines if line.startswith("| timm vit_base_patch16_224"))
    cells = [c.strip() for c in vit.strip("|").split(" | ")]
    assert cells[1:] == ["img/s", "1,000 -> 1,500 (1.50x)",
                         "2,000 -> 2,500 (1.25x); the ops on Inductor's code 2,200 (1.10x); every op on the dres "
                         "kernels 2,300 (1.15x)", "1.50x (plain step 1.10x)",
                         "eager 0.80, compiled 0.94, step 0.90", "0.03 (noise 0.01)"]
    bert = next(line for line in lines if line.startswith("| HF BertForMaskedLM"))
    assert "500 -> failed (–)" in bert and "not run -> not run (–) |" in bert  # no Inductor arm: nothing said
    assert "| hf_bert | converted_step | 700 seq/s | 1 | – | 3.00 | – | 0 | – | eager: dres.compile_step: the " \
           "step runs eagerly: the device is cpu, not CUDA |" in lines
    assert "| vit_b16 | converted_compiled | 2,500 img/s | 2 | 8.0% | 8.50 | – | 0.02 | 3 (2) |  |" in lines
    assert "| vit_b16 | converted_step | 3,000 img/s | 1 | – | 1.50 | 9.00 | 0 | – | captured |" in lines
    assert "- hf_bert converted_eager (repeat 0): OutOfMemoryError: CUDA out of memory." in lines
    assert lines[-1] == "Not run: hf_bert-plain_compiled-0"


def test_ratios_also_by_round_where_the_host_moved_between_rounds():
    # round 1 ran faster for every arm: the medians' ratio mixes the rounds, each round's ratio does not
    records = [arm_record("dinov2_s14", arm, rate, repeat=k)
               for k, rates in enumerate([(5222.0, 4510.0, 5697.0), (6125.0, 5055.0, 6290.0)])
               for arm, rate in zip(("plain_compiled", "converted_compiled", "converted_compiled_inductor"), rates)]
    records.append(arm_record("dinov2_s14", "converted_compiled", 9999.0, repeat=2))  # no plain arm in its round
    row, = bench.summarize(records)
    assert row["compiled_ratio"] == pytest.approx(5055.0 / 5673.5)  # the medians' (three converted processes)
    assert row["by_round"]["compiled_ratio"] == pytest.approx([4510 / 5222, 5055 / 6125])
    assert row["by_round"]["compiled_inductor_ratio"] == pytest.approx([5697 / 5222, 6290 / 6125])
    assert row["by_round"]["eager_ratio"] == [] and row["eager_ratio"] is None
    table = bench.markdown([row], header=[], failed=[], not_run=[])
    assert ("5,674 -> 5,055 (0.89x; by round 0.86x, 0.83x); the ops on Inductor's code 5,994 (1.06x; by round "
            "1.09x, 1.03x)") in table


# ---------------------------------------------------------------------------------------------
# runs: a tiny one on the CPU, arms that fail, time running out


def test_host_steps_time_the_hosts_part_of_a_step_by_where_its_python_lives(tmp_path, capsys):
    """``--host-steps``: each arm's host time a step, and under cProfile by place; the converted model's step runs dres
    Python, the plain one's none; every place's own time adds up to the profiled total; profiles.md tabulates both."""
    out = tmp_path / "own"
    argv = [*TINY_RUN, "--models", "vit_b16", "--arms", "plain_eager,converted_eager", "--host-steps", "2", "--out",
            str(out)]
    assert bench.main(argv) == 0
    records = {r["arm"]: r for r in bench.load_arm_records(out)}
    for arm, rec in records.items():
        host = rec["host"]
        assert rec["error"] is None and len(rec["losses"]) == 3
        assert 0 < host["host_ms_min"] <= host["host_ms_per_step"]
        assert host["profiled_ms_per_step"] == pytest.approx(sum(host["by_place_ms"].values()), rel=1e-3, abs=0.01)
        assert "C functions (torch ops, launches)" in host["by_place_ms"] and "the benchmark's loop" in host["by_place_ms"]
        assert 0 < len(host["top_own"]) <= bench.PROFILE_TOP
        assert [f["own_ms"] for f in host["top_own"]] == sorted((f["own_ms"] for f in host["top_own"]), reverse=True)
    assert records["converted_eager"]["host"]["by_place_ms"].get("dres", 0) > 0
    assert "dres" not in records["plain_eager"]["host"]["by_place_ms"]
    text = (out / "profiles.md").read_text()
    assert "# The host's time a step" in text and "| vit_b16 | converted_eager |" in text and "| vit_b16 | plain_eager |" in text
    assert "# Where each arm's step goes" not in text  # no torch.profiler steps were asked for


def test_host_place_reads_the_package_after_site_packages():
    from benchmarks.profile_train import DRES_PACKAGE, REPO, host_place

    venv = "/opt/torch/.venv/lib/python3.12/site-packages"  # a venv inside a folder named torch
    assert host_place(f"{venv}/torch/autograd/function.py") == "torch autograd"
    assert host_place(f"{venv}/torch/nn/modules/module.py") == "torch nn"
    assert host_place(f"{venv}/torch/_tensor.py") == "torch other"
    assert host_place(f"{venv}/transformers/models/vit/modeling_vit.py") == "transformers"
    assert host_place(f"{venv}/dres/ops/residual_norm.py") == "dres"
    assert host_place(f"{venv}/numpy/core/numeric.py") == "other Python"
    assert host_place(str(REPO / "kernels" / "utils.py")) == "dres"
    assert host_place(str(DRES_PACKAGE / "kernels" / "utils.py")) == "dres"  # installed elsewhere (pip --target)
    assert host_place(str(REPO / "benchmarks" / "bench_own_model.py")) == "the benchmark's loop"
    assert host_place("/usr/lib/python3.12/functools.py") == "other Python"
    assert host_place("~") == "C functions (torch ops, launches)"


def test_tiny_cpu_run_writes_the_records_and_skip_existing_resumes(tmp_path, capsys):
    out = tmp_path / "own"
    argv = [*TINY_RUN, "--models", "vit_b16,hf_vitmae", "--arms", "plain_eager,converted_eager", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("[own-models] started") == 4 and printed.count("[own-models] finished") == 4
    records = {r["model"] + "-" + r["arm"]: r for r in bench.load_arm_records(out)}
    assert sorted(records) == ["hf_vitmae-converted_eager", "hf_vitmae-plain_eager", "vit_b16-converted_eager",
                               "vit_b16-plain_eager"]
    for rec in records.values():
        assert rec["error"] is None and rec["device"] == "cpu" and rec["steps"] == 3 and rec["warmup"] == 1
        assert len(rec["losses"]) == 3 and all(loss > 0 for loss in rec["losses"])
        assert rec["samples_per_s"] == pytest.approx(rec["batch"] / (rec["step_ms"] / 1e3))
        for key in ("title", "unit", "converted", "mode", "batch", "card", "torch", "triton", "timm", "transformers",
                    "date", "peak_mem_gib", "peak_reserved_gib", "step_ms_min", "step_ms_max", "warmup_s", "wall_s"):
            assert key in rec
        assert rec["csrc_extension"] is csrc_backend.available()  # the extension's CPU build where it is built
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == [] and summary["not_run"] == [] and summary["arms_at_a_time"] == 1
    assert summary["torch"] == records["vit_b16-plain_eager"]["torch"] and summary["cards"] == ["cpu"]
    assert summary["fused_mlp"] == [True]
    for row in summary["rows"]:
        plain, converted = records[f"{row['model']}-plain_eager"], records[f"{row['model']}-converted_eager"]
        assert row["eager_ratio"] == pytest.approx(converted["samples_per_s"] / plain["samples_per_s"])
        assert row["loss_diff"]["converted_eager"] == pytest.approx(
            max(abs(a - b) for a, b in zip(converted["losses"], plain["losses"])))
    table = (out / "own-models.md").read_text()
    assert "| timm vit_base_patch16_224, drop path 0.1 (tiny config), batch 4 | img/s |" in table
    kernels = "the csrc extension's kernels and C++ autograd" if csrc_backend.available() else "the Triton kernels alone"
    assert f"the residual ops' eager calls on {kernels}" in table
    assert (out / "loss-tracks.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "logs").iterdir()) == sorted(f"{k}-0.log" for k in records)

    # a failed arm runs again, the finished ones are kept
    kept = (out / "arms" / "vit_b16-plain_eager-0.json").read_text()
    failed = {**records["hf_vitmae-plain_eager"], "error": "OutOfMemoryError: out of memory"}
    (out / "arms" / "hf_vitmae-plain_eager-0.json").write_text(json.dumps(failed))
    assert bench.main([*argv, "--skip-existing"]) == 0
    printed = capsys.readouterr().out
    assert "--skip-existing: 3 arm(s) recorded already" in printed
    assert [line.split()[2] for line in printed.splitlines() if "[own-models] started" in line] == \
           ["hf_vitmae-plain_eager-0"]
    assert (out / "arms" / "vit_b16-plain_eager-0.json").read_text() == kept
    assert json.loads((out / "arms" / "hf_vitmae-plain_eager-0.json").read_text())["error"] is None


def test_an_arm_that_raises_is_recorded_with_its_one_line_error(monkeypatch):
    def no_model(size, converted, conversion):
        raise ImportError("No module named 'timm'\nsecond line")

    monkeypatch.setitem(bench.MODELS, "vit_b16", dataclasses.replace(bench.MODELS["vit_b16"], build=no_model))
    rec = bench.run_arm("vit_b16", "converted_eager", 0, device=torch.device("cpu"), tiny=True, steps=3, warmup=1)
    assert rec["error"] == "ImportError: No module named 'timm'"
    assert rec["model"] == "vit_b16" and rec["arm"] == "converted_eager" and "samples_per_s" not in rec


def fake_worker(code: str):
    """worker_command's stand-in: each arm's process runs ``code`` instead of the benchmark."""
    return lambda job, args, cores=None: [sys.executable, "-c", code]


def test_an_arm_process_that_dies_or_hangs_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    out = tmp_path / "own"
    monkeypatch.setattr(bench, "worker_command", fake_worker("print('Segmentation fault'); raise SystemExit(139)"))
    argv = [*TINY_RUN, "--models", "hf_bert", "--arms", "converted_eager,plain_eager", "--out", str(out)]
    assert bench.main(argv) == 1
    assert json.loads((out / "arms" / "hf_bert-converted_eager-0.json").read_text())["error"] == \
           "exit 139: Segmentation fault"
    assert capsys.readouterr().out.count("[own-models] FAILED") == 2
    summary = json.loads((out / "summary.json").read_text())
    assert [(f["arm"], f["error"]) for f in summary["failed"]] == [("converted_eager", "exit 139: Segmentation fault"),
                                                                   ("plain_eager", "exit 139: Segmentation fault")]

    monkeypatch.setattr(bench, "worker_command", fake_worker("import time; time.sleep(60)"))
    assert bench.main([*argv, "--arms", "plain_eager", "--arm-timeout-s", "1"]) == 1
    assert json.loads((out / "arms" / "hf_bert-plain_eager-0.json").read_text())["error"] == "timed out after 1 s"


def test_max_minutes_starts_no_arm_after_it_and_names_those_not_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "own"
    monkeypatch.setattr(bench, "worker_command", fake_worker("import time; time.sleep(1)"))
    assert bench.main([*TINY_RUN, "--models", "hf_bert", "--arms", "converted_eager,plain_eager", "--max-minutes",
                       "0.001", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "not started: hf_bert-plain_eager-0" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_run"] == ["hf_bert-plain_eager-0"]
    assert "Not run: hf_bert-plain_eager-0" in (out / "own-models.md").read_text()


@pytest.mark.gpu
def test_tiny_gpu_run_captures_the_one_line_step_and_reads_its_memory(tmp_path):
    """On a GPU: the converted one-line step runs as a replayed graph, its loss track is the eager one's
    (a tiny ResNet, no random masks; bf16), both peak memories are read, reserved at least allocated, the
    compiled arm counts its graphs, and the profiled steps say where each arm's step goes."""
    out = tmp_path / "own"
    assert bench.main(["--tiny", "--steps", "6", "--warmup", "4", "--profile-steps", "2", "--models", "resnet50d_32",
                       "--arms", "converted_step,plain_eager", "--out", str(out)]) == 0
    profiles = (out / "profiles.md").read_text()
    for rec in bench.load_arm_records(out):
        assert rec["profile"]["gpu_kernels_per_step"] > 0 and len(rec["losses"]) == 6
        assert f"## resnet50d_32 {rec['arm']}: top GPU kernels" in profiles
    records = {r["arm"]: r for r in bench.load_arm_records(out)}
    step, eager = records["converted_step"], records["plain_eager"]
    assert step["captured"] is True and step["why_eager"] is None and step["card"] != "cpu"
    assert step["graphs"] >= 1 and step["graph_breaks"] >= 0 and eager["graphs"] is None  # what Dynamo compiled
    for rec in (step, eager):
        assert 0 < rec["peak_mem_gib"] <= rec["peak_reserved_gib"]
    torch.testing.assert_close(torch.tensor(step["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=0.1)
