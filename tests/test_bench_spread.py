"""bench_spread without a GPU: the plan of fresh processes, reading a child's record, the summary."""

import json

from benchmarks import bench_spread


def test_dry_run_plans_one_fresh_process_per_model_and_repeat(capsys):
    assert bench_spread.main(["--dry-run", "--models", "timm,dres_baseline", "--processes", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # models interleaved: timm, dres_baseline, timm, dres_baseline
    assert ["--models timm" in line for line in lines] == [True, False, True, False]
    assert all("-m benchmarks.bench_train --only mae" in line and "--modes compile" in line for line in lines)


def test_read_record_finds_the_childs_throughput_record(tmp_path):
    recs = [{"kind": "max_batch", "model": "timm", "mode": "eager"},
            {"kind": "throughput", "model": "timm", "mode": "compile", "images_per_s": 10.0}]
    (tmp_path / "h100-train.json").write_text(json.dumps(recs))
    assert bench_spread.read_record(tmp_path, "timm", "compile")["images_per_s"] == 10.0
    assert bench_spread.read_record(tmp_path, "dres_baseline", "compile") is None


def test_summary_gives_median_and_spread_per_model():
    recs = [{"model": m, "mode": "compile", "images_per_s": r, "peak_mem_gib": 10.0}
            for m, r in [("a", 100.0), ("a", 90.0), ("a", 110.0), ("b", 200.0)]]
    rows = {r["model"]: r for r in bench_spread.summarize(recs)}
    assert rows["a"]["median"] == 100.0 and rows["a"]["spread_pct"] == 20.0 and rows["a"]["processes"] == 3
    assert rows["b"]["spread_pct"] == 0.0
    table = bench_spread.markdown(list(rows.values()), "h100", 256)
    assert any("| b | compile | 1 | 200 |" in line and "2.000 |" in line for line in table)


def test_spread_summary_and_table_show_each_process_gpu_busy():
    recs = [{"model": "timm", "mode": "compile", "images_per_s": r, "peak_mem_gib": 13.4, "gpu_busy_pct": b}
            for r, b in ((4445, 99.1), (4469, 99.4), (4457, None))]
    recs += [{"model": "dres_baseline", "mode": "compile", "images_per_s": r, "peak_mem_gib": 13.1, "gpu_busy_pct": b}
             for r, b in ((5230, 98.7), (5051, 95.2))]
    rows = bench_spread.summarize(recs)
    assert [r["model"] for r in rows] == ["timm", "dres_baseline"]
    assert rows[0]["median"] == 4457 and rows[0]["gpu_busy_pct"] == [99.1, 99.4, None]
    assert abs(rows[1]["spread_pct"] - 100 * 179 / 5140.5) < 1e-9
    table = bench_spread.markdown(rows, "h100", 256)
    assert table[-2].endswith("| 1.000 | 99.1, 99.4, – |")
    assert table[-1].startswith("| dres_baseline | compile | 2 | 5,140 |") and table[-1].endswith("| 98.7, 95.2 |")
