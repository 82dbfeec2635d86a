"""The benchmark harness on the CPU: byte model, card names, record schema and writers, the CLIs'
dry runs, and one end-to-end kernel sweep through Triton's interpreter (numbers meaningless, the
plumbing real). The GPU measurements themselves run on the device (BENCHMARKS.md)."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks import (bench_kernels, bench_train, measure, train_distributed, train_memory, train_models,
                        train_report, train_step, trainer_runs)
from benchmarks.measure import kernel_bytes

BF16, FP32 = torch.bfloat16, torch.float32


# ---------------------------------------------------------------------------------------------
# card names


@pytest.mark.parametrize("raw,clean", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ("  Tesla V100-SXM2-16GB ", "tesla-v100-sxm2-16gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
    ("???", "unknown-device"),
])
def test_sanitize_card_name(raw, clean):
    assert measure.sanitize_card_name(raw) == clean


# ---------------------------------------------------------------------------------------------
# the byte model


def test_bytes_match_design_anchors():
    """The brief's (docs/brief.md) 'bytes at ceiling' column (copy ceiling 2998 GB/s, whole microseconds, truncated)
    follows from the byte model."""
    anchors = [((12800, BF16), 59), ((65536, BF16), 302), ((262144, BF16), 1208), ((262144, FP32), 1880)]
    for (rows, xdt), us in anchors:
        nb = kernel_bytes("residual_layer_norm", "fwd_bwd", rows, 768, xdt, BF16)
        assert int(measure.us_at_ceiling(nb, 2998)) == us


def test_bytes_residual_layer_norm_exact():
    n, d, b = 1000 * 64, 64, 20
    # fwd: read x, h (bf16), w, b (fp32); write out, y (bf16)
    assert kernel_bytes("residual_layer_norm", "fwd", 1000, d, BF16, BF16) == 4 * n * 2 + 2 * d * 4
    # bwd: read g_out, g_y, out + weight; write dx, dh + dweight, dbias
    assert kernel_bytes("residual_layer_norm", "bwd", 1000, d, BF16, BF16) == 5 * n * 2 + 3 * d * 4
    # fp32 stream, bf16 branch: x, out, g_out, out(saved), dx fp32; h, y, g_y, dh bf16
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, FP32, BF16) == 5 * n * 4 + 4 * n * 2 + 5 * d * 4
    plain = kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "plain", b)
    # per-sample scales: B fp32 read forward and backward (drop_path / rdp_even), backward only (rdp_odd)
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "drop_path", b) == plain + 2 * b * 4
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "rdp_even", b) == plain + 2 * b * 4
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "rdp_odd", b) == plain + b * 4
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "alpha", b) == plain
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "alpha_tensor", b) == plain + 8
    # a learnable alpha: the backward also reads x (for dalpha) and writes the scalar dalpha
    assert kernel_bytes("residual_layer_norm", "fwd_bwd", 1000, d, BF16, BF16, "alpha_grad", b) == plain + 8 + n * 2 + 4


def test_bytes_residual_add_and_layer_norm_exact():
    n, d = 512 * 128, 128
    assert kernel_bytes("residual_add", "fwd", 512, d, FP32, BF16) == n * (4 + 2) + n * 4
    assert kernel_bytes("residual_add", "bwd", 512, d, FP32, BF16) == n * 4 + n * (4 + 2)
    assert kernel_bytes("residual_add", "bwd", 512, d, FP32, BF16, "rdp_odd", 8) == n * 4 + n * (4 + 2) + 32
    # layer_norm: x fp32 in, y bf16 out (h_dtype is y's dtype for this op)
    assert kernel_bytes("layer_norm", "fwd", 512, d, FP32, BF16) == n * 4 + n * 2 + 2 * d * 4
    assert kernel_bytes("layer_norm", "bwd", 512, d, FP32, BF16) == n * 2 + n * 4 + n * 4 + 3 * d * 4
    assert (kernel_bytes("layer_norm", "fwd_bwd", 512, d, FP32, BF16)
            == kernel_bytes("layer_norm", "fwd", 512, d, FP32, BF16) + kernel_bytes("layer_norm", "bwd", 512, d, FP32, BF16))


def test_bytes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="op"):
        kernel_bytes("rms_norm", "fwd", 8, 8, BF16, BF16)
    with pytest.raises(ValueError, match="pass"):
        kernel_bytes("layer_norm", "forward", 8, 8, BF16, BF16)
    with pytest.raises(ValueError, match="mode"):
        kernel_bytes("layer_norm", "fwd", 8, 8, BF16, BF16, "drop_path")


def test_rates():
    assert measure.gbps(3_000_000_000, 1e3) == pytest.approx(3000.0)  # 3 GB in 1 ms
    assert measure.us_at_ceiling(2998_000_000, 2998) == pytest.approx(1000.0)  # 2.998 GB at 2998 GB/s: 1 ms


def test_split_rows():
    assert bench_kernels.split_rows(12800) == (256, 50)
    assert bench_kernels.split_rows(65536) == (256, 256)
    assert bench_kernels.split_rows(262144) == (1024, 256)
    assert bench_kernels.split_rows(7) == (7, 1)


# ---------------------------------------------------------------------------------------------
# records, merging, Markdown, plot


def _rec(impl, us, mode="plain", pass_="fwd_bwd", rows=12800, card="h100-80gb-hbm3"):
    nb = kernel_bytes("residual_layer_norm", pass_, rows, 768, BF16, BF16, mode, 256)
    return measure.make_kernel_record(op="residual_layer_norm", rows=rows, dim=768, x_dtype="bf16", h_dtype="bf16",
                                     mode=mode, pass_=pass_, impl=impl, us=us, nbytes=nb, ceiling_gbps=3000.0,
                                     card=card, env={"torch": "2.x", "triton": "3.x"}, date="2026-11-26")


def test_record_schema_and_derived_fields():
    r = _rec("dres_triton", 100.0)
    measure.validate_kernel_record(r)
    for f in measure.KERNEL_FIELDS:
        assert f in r
    assert r["gbps"] == pytest.approx(r["bytes"] / 100e-6 / 1e9)
    assert r["pct_ceiling"] == pytest.approx(100 * r["gbps"] / 3000.0)
    assert r["us_at_ceiling"] == pytest.approx(r["bytes"] / 3000e9 * 1e6)
    json.dumps(r)  # serialisable as is
    bad = dict(r, us=float("nan"))
    with pytest.raises(ValueError):
        measure.validate_kernel_record(bad)
    with pytest.raises(ValueError):
        measure.validate_kernel_record({k: v for k, v in r.items() if k != "card"})


def test_speedups_and_merge():
    recs = [_rec("compile", 300.0), _rec("dres_triton", 100.0), _rec("eager", 200.0, mode="rdp_odd")]
    measure.add_speedups(recs)
    assert recs[0]["speedup_vs_compile"] == pytest.approx(1.0)
    assert recs[1]["speedup_vs_compile"] == pytest.approx(3.0)
    assert recs[2]["speedup_vs_compile"] is None  # no compile measurement of that mode
    merged = measure.merge_records(recs, [_rec("dres_triton", 50.0), _rec("dres_triton", 60.0, rows=65536)])
    assert len(merged) == 4
    triton = [r for r in merged if r["impl"] == "dres_triton" and r["rows"] == 12800]
    assert len(triton) == 1 and triton[0]["us"] == 50.0


def test_markdown_table():
    recs = [_rec("compile", 300.0), _rec("dres_triton", 100.0), _rec("eager", 221.0),
            _rec("dres_triton", 40.0, pass_="fwd")]
    recs[1]["us_loop"] = 95.5
    recs[2]["check_ok"] = False
    measure.add_speedups(recs)
    md = measure.kernel_markdown(recs)
    assert "## h100-80gb-hbm3" in md and "### residual_layer_norm" in md
    header = next(line for line in md.splitlines() if line.startswith("| rows x D"))
    # implementations in the fixed order: dres first, then eager, then compile
    assert header.index("dres_triton") < header.index("eager") < header.index("compile")
    row = next(line for line in md.splitlines() if "fwd_bwd" in line and line.startswith("| 12800"))
    assert "100.0 (59%, 3.00x) loop 95.5" in row
    assert "MISMATCH" in row
    at_ceiling = f"{recs[1]['us_at_ceiling']:.1f}"
    assert f"| {at_ceiling} |" in row
    assert measure.kernel_markdown([]) == "No measurements.\n"


def test_json_roundtrip_and_plot(tmp_path):
    recs = [_rec("compile", 300.0), _rec("dres_triton", 100.0), _rec("dres_triton", 800.0, rows=65536),
            _rec("compile", 900.0, rows=65536)]
    path = tmp_path / "h100-80gb-hbm3-kernels.json"
    measure.write_json_atomic(path, recs)
    assert measure.load_records(path) == recs
    assert list(tmp_path.glob("*.tmp")) == []
    png = tmp_path / "plot.png"
    assert measure.kernel_plot(recs, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# the kernel CLI


def test_dry_run_lists_plan_without_gpu(capsys):
    assert bench_kernels.main(["--dry-run", "--quick"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 8 * 2  # 2 rows x 1 D x 2 dtype pairs x 2 modes, fwd and fwd_bwd
    assert any("rows=12800 dim=768 (B=256, T=50) x/h=bf16/bf16 mode=plain pass=fwd_bwd bytes=176962560" in ln
               for ln in lines)
    assert all("dres_triton" in ln and "compile" in ln for ln in lines)
    # the small shape is also timed as CUDA graphs
    assert "dres_triton_graph" in next(ln for ln in lines if "rows=12800" in ln)
    assert "dres_triton_graph" not in next(ln for ln in lines if "rows=65536" in ln)


def test_dry_run_default_plan_covers_matrix(capsys):
    assert bench_kernels.main(["--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    # residual ops: 3 rows x 4 D x 3 dtypes x 8 modes; layer_norm: plain only; x 2 passes
    assert len(lines) == (2 * 3 * 4 * 3 * 8 + 3 * 4 * 3) * 2
    assert not any("layer_norm rows" in ln and "mode=rdp_odd" in ln and ln.startswith("layer_norm") for ln in lines)


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench_kernels.main(["--dry-run", "--modes", "sideways"])
    with pytest.raises(SystemExit):
        bench_kernels.main(["--dry-run", "--dtypes", "bf16"])
    with pytest.raises(SystemExit):
        bench_kernels.main(["--dry-run", "--impls", "tensorflow"])


def test_cpu_sweep_end_to_end(tmp_path, monkeypatch):
    """The whole measuring path (inputs, modes, autograd.grad, checks against eager, records, files)
    on the CPU through Triton's interpreter; only the timer differs from the GPU run."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path is for machines without a GPU")
    # the CLI points compile caches into the repo unless set; keep this test's out of it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    rc = bench_kernels.main(["--device", "cpu", "--ops", "residual_layer_norm", "--rows", "100", "--dims", "32",
                  "--dtypes", "fp32/bf16", "--modes", "rdp_odd,alpha_grad", "--impls", "triton,eager",
                  "--out", str(tmp_path)])
    assert rc == 0
    recs = measure.load_records(tmp_path / "cpu-kernels.json")
    assert len(recs) == 2 * 2 * 2  # modes x passes x impls
    for r in recs:
        measure.validate_kernel_record(r)
        assert r["check_ok"] is True, r
    assert (tmp_path / "cpu-kernels.md").exists() and (tmp_path / "cpu-kernels.png").exists()
    # dropout: the implementations draw other masks, so the check compares norms (a shape large enough
    # for them to agree to 5e-3)
    rc = bench_kernels.main(["--device", "cpu", "--ops", "residual_layer_norm", "--rows", "2000", "--dims", "64",
                             "--dtypes", "fp32/fp32", "--modes", "dropout", "--impls", "triton,eager",
                             "--passes", "fwd_bwd", "--out", str(tmp_path)])
    assert rc == 0
    dropout = [r for r in measure.load_records(tmp_path / "cpu-kernels.json") if r["mode"] == "dropout"]
    assert len(dropout) == 2 and all(r["check_ok"] is True for r in dropout), dropout
    # --report-only rewrites the table from the JSON without measuring
    (tmp_path / "cpu-kernels.md").unlink()
    assert bench_kernels.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "rdp_odd" in (tmp_path / "cpu-kernels.md").read_text()


# ---------------------------------------------------------------------------------------------
# the training CLI


def test_train_dry_run(capsys):
    assert bench_train.main(["--dry-run", "--only", "mae", "--modes", "eager"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out] == ["mae timm", "mae dres_baseline", "mae dres_official"]
    assert all("batch 256" in ln for ln in out)
    with pytest.raises(SystemExit):
        bench_train.main(["--dry-run", "--models", "resnet50"])


def test_model_variants_are_options_not_names(capsys):
    """The csrc ops and the forced branch fusions are options of a dres model (recorded beside its
    name, part of the merge key), not model names; the baselines take neither."""
    assert bench_train.main(["--dry-run", "--only", "mae", "--models", "timm,dres_baseline", "--modes", "compile",
                             "--fused-branches", "on"]) == 0
    assert [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines()] == [
        "mae timm", "mae dres_baseline [fused branches on]"]
    with pytest.raises(SystemExit):
        bench_train.main(["--dry-run", "--models", "dres_baseline_fused"])
    with pytest.raises(SystemExit):
        bench_train.main(["--dry-run", "--fused-branches", "sometimes"])
    tiny = train_models.build_model("uvit", "dres", fused_branches=False)
    fused = [m.fused for m in tiny.modules() if hasattr(m, "fused")]
    assert fused and all(f is False for f in fused)
    assert train_models.build_model("uvit", "plain", ops_backend="cuda") is not None  # baselines: no dres ops
    # the ops' plain PyTorch code: under torch.compile, Inductor's own kernels in place of dres's
    on_torch = train_models.build_model("uvit", "dres", ops_backend="torch")
    assert {m.backend for m in on_torch.modules() if hasattr(m, "backend")} == {"torch"}
    plain, variant = _trec("dres_baseline", "compile", 6000, 9.1), _trec("dres_baseline", "compile", 5000, 9.0)
    variant.update(ops_backend="cuda", fused_branches=True)
    assert len(measure.merge_records([plain], [variant], train_report.TRAIN_KEY)) == 2
    assert train_models.model_label(variant) == "dres_baseline [ops cuda, fused branches on]"
    assert "| mae | dres_baseline [ops cuda, fused branches on] | compile |" in train_report.train_markdown([plain, variant])


def _trec(model, mode, ips, mem, bench="mae", kind="throughput", world=1):
    return {"kind": kind, "bench": bench, "model": model, "mode": mode, "batch": 256, "world_size": world,
            "checkpointing": False, "images_per_s": ips * world, "images_per_s_per_gpu": ips, "peak_mem_gib": mem,
            "card": "h100-80gb-hbm3", "torch": "2.x", "triton": "3.x", "date": "2026-11-26", "matmul_tflops": 790.0,
            "gflop_per_image": 58.8, "mfu_pct": 33.0}


def test_train_ratios_and_markdown():
    recs = [_trec("timm", "compile", 4000, 13.0), _trec("dres_baseline", "compile", 6000, 9.1),
            _trec("dres_official", "compile", 5400, 9.5), _trec("timm", "eager", 3000, 14.0),
            _trec("timm", "eager", 3800, 10, kind="fsdp"), _trec("timm", "eager", 3420, 6, kind="fsdp", world=2)]
    train_report.add_ratios(recs)
    assert recs[1]["speedup_vs_baseline_compile"] == pytest.approx(1.5)
    assert recs[1]["mem_vs_baseline_compile"] == pytest.approx(0.7)
    assert recs[2]["vs_dres_baseline"] == pytest.approx(0.9)
    assert recs[5]["scaling_efficiency"] == pytest.approx(0.9)
    md = train_report.train_markdown(recs)
    assert "| mae | dres_baseline | compile | 256 | 6000 | 1.50 | 9.1 | 0.70 |" in md
    assert "FSDP2 scaling" in md and "| 0.90 |" in md


def test_fp8_rows_are_compared_with_the_fp8_baseline():
    # the float8 models against the float8 plain model, the bf16 ones against bf16: like for like
    recs = [_trec("timm", "compile", 4000, 13.0), _trec("dres_baseline", "compile", 5000, 11.0),
            {**_trec("timm", "compile", 4800, 12.0), "fp8": True}, {**_trec("dres_baseline", "compile", 6000, 10.8),
                                                                     "fp8": True}]
    train_report.add_ratios(recs)
    assert recs[1]["speedup_vs_baseline_compile"] == pytest.approx(1.25)
    assert recs[3]["speedup_vs_baseline_compile"] == pytest.approx(1.25)
    assert recs[3]["mem_vs_baseline_compile"] == pytest.approx(0.9)
    assert train_models.model_label(recs[3]) == "dres_baseline [fp8]"
    assert len(measure.merge_records(recs[:2], recs[2:], train_report.TRAIN_KEY)) == 4


def test_fp8_converts_the_same_block_linears_in_plain_and_dres_models():
    pytest.importorskip("timm")
    for bench, plain, dres_name, n_blocks in (("mae", "timm", "dres_baseline", 20), ("uvit", "plain", "dres", 13)):
        plain_names = train_models.block_linears(train_models._build_plain(bench, plain))
        dres_names = train_models.block_linears(train_models._build_plain(bench, dres_name))
        # qkv, proj, fc1, fc2 of every block; no skip projection, head or embedding
        assert len(plain_names) == len(dres_names) == 4 * n_blocks
        assert {n.rsplit(".", 2)[-2] for n in plain_names | dres_names} == {"attn", "mlp"}


def test_fp8_conversion_swaps_those_layers():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = train_models.build_model("uvit", "dres", fp8=True)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == train_models.block_linears(train_models._build_plain("uvit", "dres"))
    assert all(m.fused is False for m in model.modules() if type(m).__name__ == "Mlp")


def test_compare_runs_reports_the_relative_difference(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import compare_runs

    for name, scale in (("ref", 1.0), ("other", 1.02)):
        (tmp_path / name).mkdir()
        rows = [{"step": 10 * i, "loss": scale * (2.0 - 0.01 * i)} for i in range(1, 41)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    assert compare_runs.main([f"bf16={tmp_path / 'ref'}", f"fp8={tmp_path / 'other'}", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["bf16"]["mean_rel_diff"] == 0.0
    assert result["fp8"]["mean_rel_diff"] == pytest.approx(0.02) and result["fp8"]["max_rel_diff"] == pytest.approx(0.02)
    assert result["fp8"]["steps_compared"] == 35 and result["fp8"]["final_step"] == 400
    assert out.stat().st_size > 0 and "fp8: final loss" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare_runs.main([str(tmp_path / "ref"), str(tmp_path / "missing"), "--out", str(out)])


def test_max_batch_search(monkeypatch):
    monkeypatch.setattr(train_memory, "fits", lambda bench, name, b, checkpointing, options: b <= 1000)
    assert train_memory.max_batch("mae", "timm", False, 256, 32, 8192) == (992, False)
    monkeypatch.setattr(train_memory, "fits", lambda bench, name, b, checkpointing, options: b <= 100)  # even the start fails
    assert train_memory.max_batch("mae", "timm", False, 256, 32, 8192) == (96, False)
    monkeypatch.setattr(train_memory, "fits", lambda bench, name, b, checkpointing, options: True)
    assert train_memory.max_batch("mae", "timm", False, 256, 32, 1024) == (1024, True)


def test_checkpointing_keeps_gradients():
    from benchmarks.baselines import PlainUViT

    torch.manual_seed(0)
    m = PlainUViT(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2)
    m2 = copy.deepcopy(m)
    assert train_memory.apply_checkpointing(m2) == 2 * 3  # attention + MLP of 3 blocks
    x = torch.randn(2, 3, 8, 8)
    for model in (m, m2):
        torch.manual_seed(1)
        train_models.loss_fn("uvit", model, x).backward()
    for p1, p2 in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad)


def test_tune_backward_plan_and_bad_shapes(capsys):
    from benchmarks import tune_backward

    assert tune_backward.main(["--dry-run", "--shapes", "262144x384:bf16,12800x768:fp32", "--stages", "0,2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["262144x384 x=bf16", "12800x768 x=fp32"]
    for dim in (384, 768):  # every candidate keeps 2..64 values of a tile per thread
        block_d = 1 << (dim - 1).bit_length()  # the next power of two, as the kernels pad D
        configs = tune_backward.candidates(dim, [0, 2])
        assert configs
        for bm, nw, pps, st in configs:
            assert 2 <= bm * block_d / (nw * 32) <= 64 and st in (0, 2) and pps in (2, 4, 8, 16)
    with pytest.raises(SystemExit, match="ROWSxD:DTYPE"):
        tune_backward.main(["--dry-run", "--shapes", "12x3"])
    with pytest.raises(SystemExit, match="dtype 'fp64'"):
        tune_backward.main(["--dry-run", "--shapes", "8x8:fp64"])


def test_tune_attention_plan_and_bad_shapes(capsys):
    from benchmarks import tune_attention

    assert tune_attention.main(["--dry-run", "--shapes", "1024x6x17x64,256x16x197x32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["1024x6x17x64", "256x16x197x32"]
    assert "current (64, 4)" in lines[0] and "current (256, 64, 4, 2)" in lines[1]
    for block, warps in tune_attention.candidates(17):  # packed tiles hold at least one whole sequence
        assert block >= 17 and block & (block - 1) == 0 and warps in (2, 4, 8)
    assert {c[0] for c in tune_attention.candidates(197)} == {256}  # every key in one power-of-two tile
    with pytest.raises(SystemExit, match="BxHxNxD"):
        tune_attention.main(["--dry-run", "--shapes", "2x2"])
    with pytest.raises(SystemExit, match="in \\(16, 32, 64\\) above"):
        tune_attention.main(["--dry-run", "--shapes", "2x2x200x128"])
    with pytest.raises(SystemExit, match="N 1..256"):
        tune_attention.main(["--dry-run", "--shapes", "2x2x257x64"])


def test_profile_train_groups_kernels_by_name():
    from benchmarks import profile_train

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT": "matmul",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "_residual_norm_bwd_kernel": "dres fused ops",
        "_sum_partials_kernel": "dres fused ops",
        "triton_per_fused__to_copy_add_native_layer_norm_7": "inductor norm",
        "triton_poi_fused_gelu_gelu_backward_3": "inductor other",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": profile_train.OTHER,
    }
    for name, cat in names.items():
        assert profile_train.categorize(name) == cat, name
    rec = {"bench": "mae", "model": "timm", "mode": "compile", "fsdp": False, "world_size": 1,
           "wall_us_per_step": 50000.0, "gpu_busy_pct": 90.0, "categories_us": {"matmul": 22000.0}}
    table = profile_train.markdown([rec], "h200")
    assert "| mae timm | compile | none | 1 | 50.0 | 90 |" in table and "| 22.0 |" in table
    assert "| mae timm | eager | fsdp:never | 1 |" in profile_train.markdown([dict(rec, mode="eager", dist="fsdp:never")], "h200")
    assert "| mae timm | compile per block | none |" in profile_train.markdown([dict(rec, compile_scope="per_block")], "h200")


def test_profile_train_trace_names_are_one_file_whatever_the_overrides():
    from benchmarks.profile_train import trainer_trace_name

    name = trainer_trace_name("mae_vit_b16_in1k", ["data.path=/tmp/x y", "data.decode=gpu"])
    assert name == "trace-trainer-mae_vit_b16_in1k-data_path_tmp_x_y-data_decode_gpu.json.gz"
    long = trainer_trace_name("p", [f"data.k{i}=/some/long/path/{i}" for i in range(20)])
    assert "/" not in long and len(long) < 130 and long != trainer_trace_name("p", ["data.k0=/other"])
    assert trainer_trace_name("p", []) == "trace-trainer-p.json.gz"


def test_profile_union_of_kernel_intervals():
    # overlapping compute and NCCL count once; a gap counts zero; an interval inside another adds nothing
    assert measure.union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert measure.union_us([]) == 0
    assert measure.union_us(iter([(3, 4), (0, 1)])) == 2


def test_profile_train_rejects_models_of_another_benchmark(capsys):
    from benchmarks import profile_train

    with pytest.raises(SystemExit):
        profile_train.main(["--bench", "mae", "--models", "plain"])
    assert "none of plain is a mae model" in capsys.readouterr().err


def test_profile_trainer_profiles_the_trainers_own_step(monkeypatch):
    """``--trainer``: the trainer's step (loader batch + train_step) under the profiler, here on CPU
    (the profiler's CUDA synchronisation stubbed): a record with the wall time and the step's CPU ops."""
    from benchmarks import profile_train

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    r = profile_train.profile_trainer("quickstart", ["device=cpu", "data.name=synthetic", "data.synthetic_size=256"],
                           batch=32, steps=2, warmup=1, trace_path=None)
    assert r["mode"] == "trainer eager" and r["batch"] == 32 and r["wall_us_per_step"] > 0
    assert r["overrides"] == "device=cpu data.name=synthetic data.synthetic_size=256"
    assert any(op["name"] == "aten::mm" for op in r["top_cpu_ops"])
    assert "(device=cpu data.name=synthetic" in profile_train.markdown([dict(r, card="cpu")], "cpu")
    with pytest.raises(SystemExit):
        profile_train.main(["--set", "compile=true"])  # --set only with --trainer


def test_attention_bench_plan_and_table(capsys):
    from benchmarks import bench_attention

    assert bench_attention.main(["--dry-run", "--backends", "efficient,cudnn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(bench_attention.SHAPES) and lines[0].endswith("(1024, 6, 17, 64) x efficient, cudnn")
    with pytest.raises(SystemExit):
        bench_attention.main(["--dry-run", "--backends", "xformers"])
    base = dict(where="mae enc", batch=1024, heads=6, tokens=17, head_dim=64, card="h100")
    md = bench_attention.markdown([dict(base, backend="cudnn", supported=True, fwd_bwd_us=350.0),
                      dict(base, backend="efficient", supported=True, fwd_bwd_us=120.0),
                      dict(base, backend="flash", supported=False)])
    assert "| 1024, 6, 17, 64 | mae enc | 350 | n/a | 120 | – | – | efficient |" in md
    md = bench_attention.markdown([dict(base, backend="efficient", supported=True, fwd_bwd_us=120.0),
                                   dict(base, backend="dres", supported=True, fwd_bwd_us=70.0)])
    assert "| 1024, 6, 17, 64 | mae enc | – | – | 120 | – | 70 | dres |" in md


def test_branch_ops_plan_markdown_and_bad_arguments(capsys):
    from benchmarks import bench_branch_ops

    assert bench_branch_ops.main(["--dry-run", "--ops", "mae_loss", "--impls", "dres,compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"mae_loss {'x'.join(map(str, s))}: dres, compile" for s in bench_branch_ops.LOSS_SHAPES]
    # the extension's impl where the op has one: the MLP, not the loss
    assert bench_branch_ops.main(["--dry-run", "--impls", "dres_cuda,eager"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ([f"fused_mlp {'x'.join(map(str, s))}: dres_cuda, eager" for s in bench_branch_ops.MLP_SHAPES]
                     + [f"mae_loss {'x'.join(map(str, s))}: eager" for s in bench_branch_ops.LOSS_SHAPES])
    with pytest.raises(SystemExit, match="--impls: unknown \\['apex'\\]"):
        bench_branch_ops.main(["--dry-run", "--impls", "apex"])
    with pytest.raises(SystemExit, match="--ops: unknown"):
        bench_branch_ops.main(["--dry-run", "--ops", "softmax"])
    base = dict(card="h200", shape="12800x768x3072", dtype="bf16", torch="2.11", triton="3.6", date="2026-11-26",
                check_ok=True, check_rel_err=1e-3)
    records = [dict(base, op="fused_mlp", impl="eager", us=764.0, us_loop=791.5, saved_mib=161.0),
               dict(base, op="fused_mlp", impl="dres", us=972.6, us_loop=910.9, saved_mib=85.0),
               dict(base, op="mae_loss", shape="256x224x16", impl="compile", us=322.4, us_loop=348.3,
                    pct_ceiling=22.5, check_ok=False)]
    md = bench_branch_ops.markdown(records)
    rows = [ln for ln in md.splitlines() if ln.startswith("| fused_mlp") or ln.startswith("| mae_loss")]
    assert rows[0].startswith("| fused_mlp | 12800x768x3072 | dres | 972.6 | 910.9 | 85 MiB")  # dres first
    assert rows[1].startswith("| fused_mlp | 12800x768x3072 | eager | 764.0")
    assert rows[2].startswith("| mae_loss | 256x224x16 | compile | 322.4 | 348.3 | 22% |") and "MISMATCH" in rows[2]
    # --shapes picks the MLP's shapes; a profiled implementation gets its kernels' table
    assert bench_branch_ops.main(["--dry-run", "--ops", "fused_mlp", "--impls", "dres", "--shapes", "64x8x32,3x4x5",
                                  "--profile-steps", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == ["fused_mlp 64x8x32: dres", "fused_mlp 3x4x5: dres"]
    with pytest.raises(SystemExit, match="--shapes: '64x8' is not TOKENSxDIMxHIDDEN"):
        bench_branch_ops.main(["--dry-run", "--shapes", "64x8"])
    with pytest.raises(SystemExit, match="--profile-steps: -1 is negative"):
        bench_branch_ops.main(["--dry-run", "--profile-steps", "-1"])
    records[1]["kernels"] = [{"us": 206.4, "calls": 1, "name": "_bias_gelu_bwd_kernel"}]
    md = bench_branch_ops.markdown(records)
    assert "### fused_mlp 12800x768x3072 dres: GPU time a call by kernel" in md
    assert "| 206.4 | 1 | `_bias_gelu_bwd_kernel` |" in md and "12800x768x3072 eager: GPU" not in md


def test_fsdp_units_are_blocks_for_baselines_and_dres():
    """bench_train shards like the trainer: one FSDP2 unit per transformer block, in execution order,
    for the timm-style MAE, the plain U-ViT and dres' U-ViT alike."""
    from benchmarks.baselines import plain_uvit_small_2, timm_mae_vit_base_patch16
    from dres.models import uvit_small_2
    from dres.train.distributed import parallel_units

    timm_mae = timm_mae_vit_base_patch16()
    assert parallel_units(timm_mae) == list(timm_mae.blocks) + list(timm_mae.decoder_blocks)
    plain = plain_uvit_small_2()
    assert parallel_units(plain) == list(plain.in_blocks) + [plain.mid_block] + list(plain.out_blocks)
    assert len(parallel_units(uvit_small_2())) == 13


# ---------------------------------------------------------------------------------------------
# several GPUs: DDP / FSDP2 scaling and the trainer under torchrun


def test_scaling_plan_parses_worlds_and_wrappings(capsys):
    assert train_distributed.parse_worlds("4,1,2,2") == [1, 2, 4]
    # plain fsdp is the trainer's default (reshard auto, its blocks per unit); ":K" blocks per unit
    assert train_distributed.parse_dists("ddp,fsdp,fsdp:auto,fsdp:except_last,fsdp:always:1,fsdp:never:4,fsdp:never:04,fsdp:never") == [
        ("ddp", ""), ("fsdp", "auto"), ("fsdp", "except_last"), ("fsdp", "always:1"), ("fsdp", "never:4"),
        ("fsdp", "never")]
    assert train_distributed.parse_dists("ddp:bucket_view,fsdp:prefetch:2") == [("ddp", "bucket_view"), ("fsdp", "prefetch:2")]
    assert train_distributed.fsdp_variant_parts("never:4") == ("never", 4) and train_distributed.fsdp_variant_parts("always:1") == ("always", 1)
    assert train_distributed.fsdp_variant_parts("auto") == ("auto", 4)  # the trainer's fsdp_blocks_per_unit
    # one GPU: DDP (any variant) is the unwrapped model (the trainer wraps nothing); several: no unwrapped run
    assert train_distributed.dists_at(1, train_distributed.parse_dists("none,ddp,ddp:bucket_view,fsdp")) == [("none", ""), ("fsdp", "auto")]
    assert train_distributed.dists_at(2, train_distributed.parse_dists("none,ddp,ddp:bucket_view,fsdp")) == [
        ("ddp", ""), ("ddp", "bucket_view"), ("fsdp", "auto")]
    for bad, match in (("0,2", "GPU counts must be >= 1"), ("two", "comma list of GPU counts")):
        with pytest.raises(SystemExit, match=match):
            train_distributed.parse_worlds(bad)
    for bad, match in (("ddp:never", "unknown DDP variant 'never'"), ("fsdp:sometimes", "unknown FSDP2 variant"),
                       ("fsdp:never:0", "unknown FSDP2 variant 'never:0'"),
                       ("fsdp:never:two", "unknown FSDP2 variant"), ("none:x", "unknown 'none:x'"),
                       ("zero", "unknown 'zero'"), (",", "at least one")):
        with pytest.raises(SystemExit, match=match):
            train_distributed.parse_dists(bad)
    assert bench_train.main(["--dry-run", "--only", "mae", "--models", "timm,dres_official", "--modes", "eager",
                    "--scaling", "1,2", "--dist", "ddp,ddp:bucket_view,fsdp,fsdp:never:4"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mae timm eager batch/GPU 256 on 1 GPU(s): none, fsdp, fsdp:never:4",
        "mae dres_official eager batch/GPU 256 on 1 GPU(s): none, fsdp, fsdp:never:4",
        "mae timm eager batch/GPU 256 on 2 GPU(s): ddp, ddp:bucket_view, fsdp, fsdp:never:4",
        "mae dres_official eager batch/GPU 256 on 2 GPU(s): ddp, ddp:bucket_view, fsdp, fsdp:never:4"]
    cmds = train_distributed.scaling_commands("1,4", ["--scaling", "1,4", "--only", "mae"])
    assert [c[c.index("-m") + 1:] for c in cmds] == [
        ["torch.distributed.run", "--standalone", f"--nproc_per_node={w}", "-m", "benchmarks.bench_train",
         "--dist-worker", "--only", "mae"] for w in (1, 4)]


def test_trainer_plan_runs_the_preset_per_world_and_wrapping(capsys):
    assert bench_train.main(["--dry-run", "--trainer", "mae_vit_b16_in1k", "--scaling", "1,4", "--modes", "eager",
                    "--set", "data.name=synthetic"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    for line, world, kind in zip(lines, (1, 1, 4, 4), ("none", "fsdp", "ddp", "fsdp")):
        assert f"--nproc_per_node={world} -m dres.train.mae --preset mae_vit_b16_in1k" in line
        assert f"--set dist={kind} " in line and f"--set batch_size={256 * world} " in line
        assert "--set compile=false" in line and line.endswith("--set data.name=synthetic")  # the user's last
        assert kind != "fsdp" or "--set fsdp_reshard=auto --set fsdp_blocks_per_unit=4 " in line  # its defaults
    # the reshard policies are the trainer's fsdp_reshard, prefetch its fsdp_prefetch, :K its fsdp_blocks_per_unit
    assert bench_train.main(["--dry-run", "--trainer", "mae_vit_b16_in1k", "--scaling", "2", "--modes", "eager",
                    "--dist", "fsdp:never,fsdp:prefetch,fsdp:always:1"]) == 0
    never, prefetch, always = capsys.readouterr().out.splitlines()
    assert "--set fsdp_reshard=never " in never and "--set fsdp_prefetch=false " in never
    assert "--set fsdp_reshard=auto " in prefetch and "--set fsdp_prefetch=true " in prefetch
    assert "--set fsdp_reshard=always --set fsdp_blocks_per_unit=1 " in always
    with pytest.raises(SystemExit, match="the trainer has no variant"):  # a bench-only candidate
        bench_train.main(["--dry-run", "--trainer", "mae_vit_b16_in1k", "--scaling", "2", "--dist", "ddp:bucket_view"])
    # ddp:graph / ddp:eager: the trainer with its whole step captured (DDP's all-reduce inside) or not;
    # plain ddp takes the trainer's default (cuda_graphs=auto)
    assert bench_train.main(["--dry-run", "--trainer", "mae_vit_b16_in1k", "--scaling", "2", "--modes", "eager",
                    "--dist", "ddp,ddp:graph,ddp:eager"]) == 0
    plain, graphed, eager = capsys.readouterr().out.splitlines()
    assert "cuda_graphs" not in plain and "--set dist=ddp " in graphed and "--set cuda_graphs=true " in graphed
    assert "--set cuda_graphs=false " in eager
    assert "--set fsdp_reshard=auto " in graphed  # a DDP variant is no FSDP2 setting (the trainer would refuse it)
    with pytest.raises(SystemExit, match="use it with --trainer"):
        # bench_train's own step has no such setting
        train_distributed.wrap_model(torch.nn.Linear(2, 2), "ddp", "eager", None)
    from dres.train.config import build_config

    args = bench_train.build_parser().parse_args(
        ["--trainer", "mae_vit_b16_in1k", "--scaling", "1,2", "--dist", "ddp,ddp:graph,ddp:eager,fsdp,fsdp:never:4"])
    plan = trainer_runs.trainer_plan(args, bench_train.modes(args))
    for run in plan:  # every planned run's overrides are a configuration the trainer accepts
        build_config(run["task"], run["preset"], run["sets"])
    with pytest.raises(SystemExit, match="must exceed"):
        bench_train.main(["--dry-run", "--trainer", "mae_vit_b16_in1k", "--trainer-steps", "10"])


def test_trainer_steady_state_leaves_out_the_batches_the_loader_made_ahead_during_the_warm_up():
    # warm-up to step 10; a loader 30 batches ahead serves steps 10-40 at the step's rate (5 s for 10 steps of 512),
    # then makes batches at half of it
    metrics = [{"step": 10, "img_per_s": 100.0}] + [{"step": s, "img_per_s": 1024.0} for s in (20, 30, 40)] + \
              [{"step": s, "img_per_s": 512.0, "data_ms": 500.0} for s in (50, 60, 70)]
    assert trainer_runs.steady_state_rate(metrics, 512) == (pytest.approx(60 * 512 / (3 * 5 + 3 * 10)), 60)
    assert trainer_runs.steady_state_rate(metrics, 512, buffered=30) == (pytest.approx(512.0), 30)
    assert trainer_runs.steady_state_waits(metrics, buffered=30) == {"data_ms": 500.0}
    # an interval that begins inside the buffer is left out whole
    assert trainer_runs.steady_state_rate(metrics, 512, buffered=25)[1] == 30
    with pytest.raises(ValueError, match="30 buffered steps.*run more steps"):
        trainer_runs.steady_state_rate(metrics[:4], 512, buffered=30)


def test_trainer_steady_state_leaves_out_the_first_interval(tmp_path):
    # intervals of 10 steps at a global batch of 512: 10 s of warm-up, then 2 s and 3 s
    metrics = [{"step": 10, "img_per_s": 512.0}, {"step": 20, "img_per_s": 2560.0},
               {"step": 30, "img_per_s": 5120 / 3}]
    ips, steps = trainer_runs.steady_state_rate(metrics, 512)
    assert steps == 20 and ips == pytest.approx(20 * 512 / 5)
    # the final interval may be shorter than log.every
    ips, steps = trainer_runs.steady_state_rate(metrics[:2] + [{"step": 25, "img_per_s": 1280.0}], 512)
    assert steps == 15 and ips == pytest.approx(15 * 512 / 4)
    with pytest.raises(ValueError, match="run more steps"):
        trainer_runs.steady_state_rate(metrics[:1], 512)
    # a graphed run: the interval of the capture (the first with replays) is warm-up too
    replayed = {"gpu_ms_per_step": 50.0}
    graphed = [metrics[0], {"step": 20, "img_per_s": 1024.0, **replayed}, {"step": 30, "img_per_s": 5120.0, **replayed},
               {"step": 40, "img_per_s": 2560.0, **replayed}]
    ips, steps = trainer_runs.steady_state_rate(graphed, 512)
    assert steps == 20 and ips == pytest.approx(20 * 512 / 3)
    # the host's wait for data and the step's GPU time over the same windows, weighted by their steps
    waited = [{**r, "data_ms": d} for r, d in zip(graphed, (90.0, 80.0, 1.0, 3.0))]
    waited[-1] = {**waited[-1], "step": 50, "gpu_ms_per_step": 44.0}  # 20 steps at 44 ms, 10 at 50
    assert trainer_runs.steady_state_waits(waited) == pytest.approx({"data_ms": (10 * 1.0 + 20 * 3.0) / 30,
                                                                     "gpu_ms_per_step": (10 * 50.0 + 20 * 44.0) / 30})
    assert trainer_runs.steady_state_waits(metrics) == {}  # older records: neither key
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "summary.json").write_text(json.dumps({"peak_mem_gib": 30.5, "final_loss": 0.9}))
    run = {"task": "mae", "preset": "mae_vit_b16_in1k", "world": 2, "dist": "ddp", "variant": None, "mode": "eager",
           "batch": 256, "sets": ["dist=ddp"]}
    rec = trainer_runs.trainer_record(run, tmp_path, {"torch": "2.x", "triton": "3.x"}, "h100-80gb-hbm3")
    assert rec["kind"] == "trainer" and rec["images_per_s"] == pytest.approx(2048.0)  # 512 images a step
    assert rec["images_per_s_per_gpu"] == pytest.approx(1024.0) and rec["peak_mem_gib"] == 30.5
    assert rec["trainer_vs_replay"] is None and rec["graph_gpu_ms_per_step"] is None  # an eager step
    (tmp_path / "summary.json").write_text(json.dumps({"graph_gpu_ms_per_step": 40.0, "trainer_vs_replay": 1.031}))
    rec = trainer_runs.trainer_record(run, tmp_path, {"torch": "2.x", "triton": "3.x"}, "h100-80gb-hbm3")
    assert rec["graph_gpu_ms_per_step"] == 40.0 and rec["trainer_vs_replay"] == 1.031
    assert train_report.dist_markdown([rec], replay=True)[2].endswith("|  | 40.00 | 1.031 |")  # the trainer table's columns
    assert rec["compile_scope"] is None  # eager
    compiled = {**run, "mode": "compile", "sets": ["compile=true", "model.variant=baseline", "compile_scope=model"]}
    rec = trainer_runs.trainer_record(compiled, tmp_path, {"torch": "2.x", "triton": "3.x"}, "h100-80gb-hbm3")
    assert rec["compile_scope"] == "model"
    row = train_report.dist_markdown([rec], replay=True)[2]
    assert "mae_vit_b16_in1k [model.variant=baseline] | compile (whole model) |" in row
    assert trainer_runs.compile_scope(["compile=true", "dist=ddp"]) == "model"
    assert trainer_runs.compile_scope(["compile=true", "dist=fsdp"]) == "per_block"
    assert trainer_runs.compile_scope(["compile=true", "dist=ddp", "act_ckpt=full"]) == "per_block"
    assert trainer_runs.compile_scope(["compile=true", "dist=none"]) == "model"  # compile_scope=auto, one process
    # runs that differ only in a model key or the scope are kept apart in the record file
    blocks = trainer_runs.trainer_record({**compiled, "sets": ["compile=true", "model.variant=baseline", "dist=fsdp"]}, tmp_path,
                                         {"torch": "2.x", "triton": "3.x"}, "h100-80gb-hbm3")
    train_report.write_outputs(tmp_path, "h100-80gb-hbm3", [rec, blocks])
    train_report.write_outputs(tmp_path, "h100-80gb-hbm3", [rec])
    saved = json.loads((tmp_path / "h100-80gb-hbm3-train.json").read_text())
    assert sorted(r["compile_scope"] for r in saved) == ["model", "per_block"]


def _drec(model, dist, world, per_gpu, kind="dist", variant=None, mode="eager"):
    return {"kind": kind, "bench": "mae", "model": model, "mode": mode, "batch": 256, "world_size": world,
            "dist": dist, "fsdp_variant": variant if dist == "fsdp" else None,
            "ddp_variant": variant if dist == "ddp" else None, "checkpointing": False, "images_per_s": per_gpu * world,
            "images_per_s_per_gpu": per_gpu, "peak_mem_gib": 20.0, "card": "h100-80gb-hbm3", "torch": "2.x",
            "triton": "3.x", "date": "2026-11-27"}


def test_dist_ratios_and_table():
    recs = [_drec("dres_official", "none", 1, 4000), _drec("dres_official", "fsdp", 1, 2200, variant="auto"),
            _drec("dres_official", "ddp", 4, 3900), _drec("dres_official", "fsdp", 4, 1980, variant="auto"),
            _drec("dres_official", "fsdp", 1, 3800, variant="never"),
            _drec("mae_vit_b16_in1k", "ddp", 2, 2950, kind="trainer"),
            _drec("mae_vit_b16_in1k", "none", 1, 2971, kind="trainer"),
            _drec("dres_official", "ddp", 4, 3960, variant="bucket_view"),
            _drec("dres_official", "fsdp", 1, 2000, variant="always")]
    train_report.add_ratios(recs)
    none1, fsdp1, ddp4, fsdp4, never1, tr2, _, view4, always1 = recs
    # a DDP variant scales against the unwrapped model; FSDP2 / DDP is against plain DDP
    assert view4["scaling_efficiency"] == pytest.approx(3960 / 4000) and view4["fsdp_vs_ddp"] is None
    assert always1["fsdp_vs_ddp"] == pytest.approx(0.5) and always1["scaling_efficiency"] == 1
    assert none1["scaling_efficiency"] == 1 and ddp4["scaling_efficiency"] == pytest.approx(3900 / 4000)
    assert fsdp4["scaling_efficiency"] == pytest.approx(0.9)  # against FSDP2 on one GPU
    assert fsdp1["fsdp_vs_ddp"] == pytest.approx(0.55) and fsdp4["fsdp_vs_ddp"] == pytest.approx(1980 / 3900)
    assert never1["fsdp_vs_ddp"] == pytest.approx(0.95) and ddp4["fsdp_vs_ddp"] is None
    assert tr2["scaling_efficiency"] == pytest.approx(2950 / 2971)  # trainer records among themselves
    md = train_report.train_markdown(recs)
    assert "| mae dres_official | eager | ddp | 4 | 256 | 15600 | 3900 | 97.5% |  | 20.0 |" in md
    assert "| mae dres_official | eager | fsdp:never | 1 | 256 | 3800 | 3800 | 100.0% | 0.95 | 20.0 |" in md
    assert "| mae dres_official | eager | ddp:bucket_view | 4 | 256 | 15840 | 3960 | 99.0% |  | 20.0 |" in md
    rows = [ln.split(" | ")[2:4] for ln in md.splitlines() if ln.startswith("| mae dres_official")]
    assert rows == [["none", "1"], ["ddp", "4"], ["ddp:bucket_view", "4"], ["fsdp", "1"], ["fsdp", "4"],
                    ["fsdp:always", "1"], ["fsdp:never", "1"]]
    assert "### The trainer on several GPUs" in md and "| mae mae_vit_b16_in1k | eager | ddp | 2 |" in md


def test_multi_gpu_check_dry_run_fits_the_budget(tmp_path):
    """The device script's plan on a 4-GPU machine: every stage, in priority order, capped to the budget."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    # the script's own settings left out of the caller's environment (a GPU host's job may export STAGES)
    knobs = ("STAGES", "BUDGET_S", "COMPILE_SCALING", "TRAINER_SCALING", "MODELS", "PROFILE_MODELS", "CANDIDATES")
    env = {k: v for k, v in os.environ.items() if k not in knobs}
    env.update(DRY_RUN="1", NGPU="4", OUT=str(tmp_path / "out"))
    out = subprocess.run(["bash", str(repo / "benchmarks" / "multi_gpu_check.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout
    stages = [ln.split("stage ")[1].split(" ")[0] for ln in out.splitlines() if "] stage " in ln]
    assert stages == ["candidates", "profile", "ddp_profile", "ddp_graph_test", "trainer", "trainer_profile",
                      "trainer_profile", "compile"]
    # every candidate against DDP on 1, 2, 4 GPUs; DDP profiled on all 4; the captured DDP step tested and timed
    assert "--scaling 1,2,4 --dist ddp,fsdp,fsdp:auto:1,fsdp:never:4,fsdp:auto:8 " in out
    assert "--nproc_per_node=4 -m benchmarks.profile_train" in out and "--dist none,fsdp:auto:1,fsdp " in out
    assert "--modes compile --scaling 1,4" in out and "--trainer mae_vit_b16_in1k --scaling 1,4 " in out
    assert "tests/test_step.py -k ddp" in out and "--dist ddp:eager,ddp,fsdp " in out
    # the trainer's own step profiled on one GPU and, graphed with DDP, on all four
    assert "--nproc_per_node=4 -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set dist=ddp " in out
    env.update(NGPU="2", BUDGET_S="150", STAGES="trainer compile")
    out = subprocess.run(["bash", str(repo / "benchmarks" / "multi_gpu_check.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "stage trainer (up to 110s)" in out and "--scaling 1,2 " in out  # the budget less the grace
    assert "SKIPPED" not in out  # dry runs take no time: compile still has the budget
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    # the memory search: DDP and FSDP2, then DDP with activation checkpointing at larger batches; the synthetic
    # set (on the GPU) holds one global batch of the largest size tried
    env.update(NGPU="4", BUDGET_S="590", STAGES="memory", MEMORY_PRESETS="mae_vit_l16_in1k")
    out = subprocess.run(["bash", str(repo / "benchmarks" / "multi_gpu_check.sh")], env=env, capture_output=True,
                         text=True, check=True).stdout
    memory = [ln for ln in out.splitlines() if "] stage memory" in ln]
    assert len(memory) == 2 and "(up to 360s)" in memory[0] and "(up to 240s)" in memory[1]
    assert "--dist ddp,fsdp --modes eager --trainer-batches 128,256,512,768 " in memory[0]
    assert "data.synthetic_size=3072 " in memory[0]
    assert "--set act_ckpt=full --modes eager --trainer-batches 1024,2048,3072 " in memory[1]
    assert "data.synthetic_size=12288 " in memory[1]


def test_profile_counts_kernels_not_the_gpu_spans_of_annotated_ranges():
    """An ``Optimizer.step`` or FSDP2 hook range also appears on the GPU as one span from its first to
    its last kernel, idle time included: it is neither a kernel nor busy time."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(device_type=cuda, is_user_annotation=False)
    span = SimpleNamespace(device_type=cuda, is_user_annotation=True)
    assert measure.is_gpu_work(kernel) and not measure.is_gpu_work(span)
    assert not measure.is_gpu_work(SimpleNamespace(device_type=cpu, is_user_annotation=False))
    assert measure.is_gpu_work(SimpleNamespace(device_type=cuda))  # a torch whose events lack the attribute


def test_eager_launch_rounds_are_interleaved_and_recorded(tmp_path, capsys, triton_device):
    """Every implementation gets one time per round, the median is its figure, the unfused code is the
    baseline of each ratio; a round count below one is refused with exit code 2."""
    from benchmarks import bench_eager_launch

    out = tmp_path / "eager.json"
    assert bench_eager_launch.main(["--rows", "64", "--dim", "32", "--dtypes", "fp32/fp32", "--modes", "rdp_odd", "--rounds", "3",
                     "--warmup", "1", "--device", triton_device.type, "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["impl"] for r in records} == set(bench_eager_launch.available_impls(triton_device))
    for r in records:
        assert len(r["us_rounds"]) == 3 and r["us_loop"] == round(statistics.median(r["us_rounds"]), 1)
    assert next(r for r in records if r["impl"] == "unfused")["vs_unfused"] == 1.0
    assert bench_eager_launch.main(["--rounds", "0", "--device", "cpu"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_probe_bench_times_both_ways_and_finds_the_same_accuracies(tmp_path, capsys):
    """The grid's probes one at a time and together on the CPU: the same accuracies, both times and their ratio
    recorded; a count below its minimum is refused with exit code 2."""
    from benchmarks import bench_probe

    out = tmp_path / "probe.json"
    assert bench_probe.main(["--rows", "600", "--heads", "3", "--dim", "16", "--epochs", "3", "--batch", "128",
                             "--device", "cpu", "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["max_acc_diff"] == 0.0 and len(rec["acc"]) == 3 and min(rec["acc"]) > 0.2  # chance is 0.1
    assert rec["one_at_a_time_s"] > 0 and rec["together_s"] > 0 and rec["speedup"] > 0
    assert "3 probes of 600 x 16 features, 3 epochs on cpu" in capsys.readouterr().out
    assert bench_probe.main(["--classes", "1", "--device", "cpu"]) == 2
    assert "--classes must be at least 2, got 1" in capsys.readouterr().err


def _profile_trainer_rank(rank: int, group: dict, out: str) -> None:
    """One rank of a 2-process gloo group on CPU running ``profile_trainer`` with DDP."""
    import os

    from benchmarks import profile_train

    os.environ.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.cuda.synchronize = lambda *a, **k: None  # the profiler's CUDA synchronisation, on CPU
    r = profile_train.profile_trainer("quickstart", ["device=cpu", "dist=ddp", "data.name=synthetic", "data.synthetic_size=256"],
                           batch=32, steps=2, warmup=1, trace_path=None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(r and {k: r[k] for k in ("dist", "world_size", "mode", "batch")}))


def test_profile_trainer_under_ddp_reports_from_the_main_rank(tmp_path):
    """``--trainer`` under torchrun: every rank steps the DDP trainer with ``--batch`` images, rank 0 returns
    the record (the world size and wrapping named), the others None, and the process group is torn down."""
    import torch.multiprocessing as mp
    from helpers import process_group

    with process_group(2) as group:
        mp.spawn(_profile_trainer_rank, args=(group, str(tmp_path)), nprocs=2, join=True)
    main_record = json.loads((tmp_path / "rank0.json").read_text())
    assert main_record == {"dist": "ddp", "world_size": 2, "mode": "trainer eager", "batch": 32}  # --batch is per GPU
    assert json.loads((tmp_path / "rank1.json").read_text()) is None


# ---------------------------------------------------------------------------------------------
# the records' convention (records/README.md)

REPO = Path(__file__).resolve().parent.parent
RECORD_NAME = r"[a-z0-9]+-\d{4}-\d{2}-\d{2}(-[a-z0-9]+)+"
RECORD_ROOTS = ("records/benchmarks", "records/experiments")


@pytest.mark.parametrize("root", RECORD_ROOTS)
def test_records_follow_the_convention(root):
    import re

    base = REPO / root
    index = (base / "README.md").read_text()
    folders = sorted(p for p in base.iterdir() if p.is_dir())
    assert folders, f"{root} holds no record"
    assert sorted(p.name for p in base.iterdir() if p.is_file()) == ["README.md"]
    for folder in folders:
        assert re.fullmatch(RECORD_NAME, folder.name), f"{folder.name}: not <card>-<YYYY-MM-DD>-<what>"
        assert f"`{folder.name}`" in index, f"{folder.name} is not in {root}/README.md's index"
    for path in base.rglob("*"):
        assert path.suffix not in (".py", ".sh"), f"{path.relative_to(REPO)}: no scripts inside records"
        assert "session" not in path.name.lower(), f"{path.relative_to(REPO)}: name the measurement, not the session"


def test_records_hold_the_two_roots_their_convention_and_history():
    assert sorted(p.name for p in (REPO / "records").iterdir()) == [
        "HISTORY.md", "IN_HISTORY.md", "README.md", "benchmarks", "experiments"]


RECORD_FILE_MAX_BYTES = 1 << 20  # the tree and the CIFAR-10 shards travel to a GPU host in one copy of 64 MiB
TREE_MAX_DISK_BYTES = 44 << 20  # that copy counts whole 4 KiB blocks; the shards take 19 of its 64 MiB


def test_no_record_file_is_too_large_to_travel_and_each_one_kept_in_history_is_there():
    import re
    import shutil
    import subprocess

    large = [str(p.relative_to(REPO)) for p in (REPO / "records").rglob("*")
             if p.is_file() and p.stat().st_size > RECORD_FILE_MAX_BYTES]
    assert not large, f"over 1 MiB, to be kept in git history (records/IN_HISTORY.md): {large}"
    kept = re.findall(r"^\| `(records/[^`]+)` \| [\d,]+ \| ([0-9a-f]{7,40}) \|$",
                      (REPO / "records" / "IN_HISTORY.md").read_text(), re.M)
    assert kept and not [path for path, _ in kept if (REPO / path).exists()]
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git history here to look the kept files up in")
    missing = [f"{commit}:{path}" for path, commit in kept if subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:{path}"], capture_output=True).returncode]
    assert not missing, f"not in the history where records/IN_HISTORY.md says: {missing}"


def test_the_tracked_tree_fits_the_gpu_hosts_copy_beside_the_shards():
    """records/IN_HISTORY.md: the tracked files, each counted in whole 4 KiB blocks, stay under 44 MiB."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout here to list the tracked files of")
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True,
                             check=True).stdout.split("\0")
    sizes = [(REPO / f).stat().st_size for f in tracked if f and (REPO / f).is_file()]
    disk = sum(-(-size // 4096) * 4096 for size in sizes)
    assert sizes and disk <= TREE_MAX_DISK_BYTES, (
        f"the tracked tree takes {disk / 2**20:.1f} MiB on disk: take superseded records' raw reports into git "
        "history (records/IN_HISTORY.md)")


@pytest.mark.parametrize("page", ["BENCHMARKS.md", "records/HISTORY.md"])
def test_benchmark_pages_point_at_records_that_exist(page):
    import re

    named = set(re.findall(r"`([a-z0-9]+-\d{4}-\d{2}-\d{2}(?:-[a-z0-9]+)+)", (REPO / page).read_text()))
    roots = [REPO / "records" / root for root in ("benchmarks", "experiments")]
    assert named and not [n for n in named if not any((root / n).is_dir() for root in roots)]


def test_trainer_batch_search_stops_each_wrapping_at_its_first_failure(tmp_path, monkeypatch, capsys):
    """--trainer-batches: ascending batches per wrapping; a failed (out-of-memory) batch ends that wrapping's
    search, the others go on; the largest batch that trained is printed and recorded."""
    fits = {"ddp": 128, "fsdp": 256}
    tried = []

    def fake_launch(cmd):
        sets = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("--"))
        world = 2
        batch, dist = int(sets["batch_size"]) // world, sets["dist"]
        tried.append((dist, batch))
        if batch > fits[dist]:
            return 1
        run_dir = Path(cmd[cmd.index("--out") + 1])
        recs = [{"step": 4, "img_per_s": 100.0}, {"step": 8, "img_per_s": 1000.0}, {"step": 12, "img_per_s": 1000.0}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (run_dir / "summary.json").write_text(json.dumps({"peak_mem_gib": batch / 10}))
        return 0

    monkeypatch.setattr(trainer_runs, "launch", fake_launch)
    monkeypatch.setattr(trainer_runs.measure, "versions", lambda: {"torch": "2.x", "triton": "3.x"})
    args = bench_train.build_parser().parse_args(
        ["--trainer", "mae_vit_l16_in1k", "--scaling", "2", "--dist", "ddp,fsdp", "--modes", "eager",
         "--trainer-batches", "512,64,128,256", "--trainer-steps", "12", "--trainer-log-every", "4"])
    assert trainer_runs.run_trainer(args, ["eager"], tmp_path, "h100-80gb-hbm3") == 0
    assert tried == [("ddp", 64), ("fsdp", 64), ("ddp", 128), ("fsdp", 128), ("ddp", 256), ("fsdp", 256), ("fsdp", 512)]
    out = capsys.readouterr().out
    assert "largest batch that trains: mae_vit_l16_in1k eager ddp x2: 128 per GPU (tried 64,128,256,512)" in out
    assert "largest batch that trains: mae_vit_l16_in1k eager fsdp:auto x2: 256 per GPU" in out
    saved = json.loads((tmp_path / "h100-80gb-hbm3-train.json").read_text())
    assert sorted((r["dist"], r["batch"]) for r in saved) == [("ddp", 64), ("ddp", 128), ("fsdp", 64), ("fsdp", 128),
                                                              ("fsdp", 256)]
    with pytest.raises(SystemExit):
        bench_train.build_parser().parse_args(["--trainer", "x", "--trainer-batches", "64,big"])


def test_bench_attention_times_short_attention_from_the_qkv_layout():
    # the dres column packs q, k, v as the qkv Linear's output and returns out and gradients as (B, H, N, d)
    import torch.nn.functional as F

    from benchmarks import bench_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 5, 16, generator=gen, dtype=torch.float64) for _ in range(4))
    qkv = bench_attention.packed(q, k, v)
    assert qkv.shape == (2, 5, 3 * 3 * 16) and qkv.is_leaf and qkv.requires_grad
    got = bench_attention.dres_fwd_bwd(qkv, 3, grad.transpose(1, 2).reshape(2, 5, 48))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves)
    want = (out, *torch.autograd.grad(out, leaves, grad))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_time_configs_ranks_what_runs_and_skips_what_fails(capsys):
    def time_config(config):
        if config == (3,):
            raise RuntimeError("out of resources")
        return {(1,): 20.0, (2,): 10.0}[config]

    assert measure.time_configs(time_config, [(1,), (2,), (3,)], lambda c: f"c{c[0]}") == [(10.0, (2,)), (20.0, (1,))]
    assert capsys.readouterr().out.splitlines() == ["  skipped c3: RuntimeError", "         10 us  c2",
                                                     "         20 us  c1"]


@pytest.mark.gpu
def test_graph_median_us_replays_the_captured_step():
    a = torch.randn(512, 512, device="cuda")
    graph, out = measure.capture_graph(lambda: a @ a)
    a.copy_(torch.randn_like(a))  # a replay computes from the inputs' memory as it is then
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a @ a)
    us = measure.graph_median_us(lambda: a @ a)
    assert 0 < us < 10_000


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True")
def test_replay_step_ms_times_the_captured_step_with_its_optimizer_step():
    class Tiny(torch.nn.Module):  # MAE's convention: the loss first of what the forward returns
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))

        def forward(self, x):
            return ((self.net(x) - x).square().mean(),)

    model = Tiny().cuda()
    x = torch.randn(64, 256, device="cuda")
    step, _ = train_step.first_training_step("mae", model, x)
    eager_ms = statistics.median(train_step.time_steps(step, 20))
    # each replay moves the parameters: the optimizer step is in the graph, not only forward and backward
    captured = train_step.capturable_step("mae", model, model, x)  # kept: it holds the optimizer's state
    graph, _ = measure.capture_graph(captured, before_capture=lambda: model.zero_grad(set_to_none=True))
    w = model.net[0].weight
    seen = []
    for _ in range(3):
        seen.append(w.detach().clone())
        graph.replay()
        torch.cuda.synchronize()
    seen.append(w.detach().clone())
    assert not any(torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    del graph, captured
    model.zero_grad(set_to_none=True)
    # the GPU time alone: no more than the launched step (a tiny step's time is mostly the host's launches)
    replay_ms = train_step.replay_step_ms("mae", model, model, x, rep_ms=100)
    assert 0 < replay_ms <= 1.5 * eager_ms
    assert all(p.grad is None for p in model.parameters())  # the graph's gradients freed with it


def test_host_cost_times_each_fused_op_against_the_ops_it_replaces_and_restores_the_launches(tmp_path, capsys):
    from benchmarks import bench_host_cost
    from dres.kernels.utils import CachedLaunch
    from dres.ops import checks

    launch, default = CachedLaunch.__call__, checks._default_backend
    assert bench_host_cost.main(["--calls", "3", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert (CachedLaunch.__call__, checks._default_backend) == (launch, default)
    rows = json.loads((tmp_path / "host_cost.json").read_text())["results"]
    assert [(r["op"], r["what"]) for r in rows] == [(op, what) for op in ("residual_layer_norm", "fused_mlp", "layer_norm")
                                                    for what in ("forward", "forward + backward")]
    assert all(r["dres_us"] > 0 and r["torch_us"] > 0 for r in rows)
    assert "| `fused_mlp` | F.linear, F.gelu, F.linear | forward + backward |" in (tmp_path / "host_cost.md").read_text()
    with pytest.raises(SystemExit) as e:
        bench_host_cost.main(["--calls", "0"])
    assert e.value.code == 2 and "--calls and --rounds must be at least 1" in capsys.readouterr().err


def test_tune_bias_gelu_plan_and_bad_arguments(capsys):
    from benchmarks import tune_bias_gelu

    assert tune_bias_gelu.main(["--dry-run", "--shapes", "25216x3072,32896x1536", "--gelu", "none,quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["25216x3072", "32896x1536"]
    from dres.kernels.bias_gelu import backward_config, forward_config

    for n in (3072, 1536, 40):  # the current configs are among the candidates; the others hold 8..64 values a thread
        fwd, bwd = tune_bias_gelu.forward_candidates(n), tune_bias_gelu.backward_candidates(n)
        assert forward_config(n) in fwd and backward_config(n) in bwd
        assert all(8 <= bm * bn / (nw * 32) <= 64 for bm, bn, nw in fwd if (bm, bn, nw) != forward_config(n))
    assert tune_bias_gelu.main(["--dry-run", "--shapes", "12x"]) == 2
    assert tune_bias_gelu.main(["--dry-run", "--gelu", "erf"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "--shapes: '12x' is not ROWSxHIDDEN (e.g. 25216x3072)", "--gelu: 'erf' is not a comma list of none, tanh, quick"]
    if not torch.cuda.is_available():  # the sweep itself: one line and exit 2 without a GPU
        assert tune_bias_gelu.main(["--shapes", "8x8"]) == 2
        assert capsys.readouterr().err == "tune_bias_gelu needs a CUDA GPU (--dry-run shows the plan)\n"


@pytest.mark.gpu
def test_gpu_tune_bias_gelu_and_branch_ops_profile_run_end_to_end(tmp_path, capsys):
    """The sweep ranks its configs against the copy ceiling and PyTorch's GELU; a profiled branch-ops run keeps each
    implementation's kernels, the fused MLP's bias + GELU kernels among them."""
    from benchmarks import bench_branch_ops, tune_bias_gelu

    assert tune_bias_gelu.main(["--shapes", "256x512", "--gelu", "quick"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("256x512")]
    assert [ln.split(":")[0] for ln in lines] == ["256x512 gelu=quick forward", "256x512 gelu=quick backward"]
    assert all("PyTorch's GELU" in ln and "best:" in ln for ln in lines)
    assert bench_branch_ops.main(["--ops", "fused_mlp", "--impls", "dres,eager", "--shapes", "512x64x256",
                                  "--profile-steps", "2", "--rep", "5", "--warmup", "2", "--out", str(tmp_path)]) == 0
    records = json.loads(next(tmp_path.glob("*-branch.json")).read_text())
    kernels = {r["impl"]: [k["name"] for k in r["kernels"]] for r in records}
    assert any("_bias_gelu_bwd_kernel" in k for k in kernels["dres"])
    assert not any("bias_gelu" in k for k in kernels["eager"])
