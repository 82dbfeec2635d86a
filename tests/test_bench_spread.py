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


def test_spread_summary_and_table_show_the_replay_of_each_process():
    # batch 256: replay 50 ms = 5,120 img/s; the third timm process has no replay (its capture failed)
    recs = [{"model": "timm", "mode": "compile", "batch": 256, "images_per_s": r, "peak_mem_gib": 13.4,
             "replay_ms": ms, "step_vs_replay": v} for r, ms, v in ((4445, 50.0, 1.152), (4469, 51.2, 1.119),
                                                                   (4457, None, None))]
    recs += [{"model": "dres_baseline", "mode": "compile", "batch": 256, "images_per_s": r, "peak_mem_gib": 13.1,
              "replay_ms": ms, "step_vs_replay": v} for r, ms, v in ((5230, 48.0, 1.021), (5051, 48.0, 1.057))]
    rows = bench_spread.summarize(recs)
    assert [r["model"] for r in rows] == ["timm", "dres_baseline"]
    assert rows[0]["median"] == 4457 and rows[0]["replay_ms"] == [50.0, 51.2, None]
    assert rows[0]["step_vs_replay"] == [1.152, 1.119, None]
    assert rows[0]["replay_median"] == (5120 + 5000) / 2  # of the two processes with a replay
    assert abs(rows[0]["replay_spread_pct"] - 100 * 120 / 5060) < 1e-9
    assert rows[1]["replay_median"] == 256 / 0.048 and rows[1]["replay_spread_pct"] == 0.0
    assert abs(rows[1]["spread_pct"] - 100 * 179 / 5140.5) < 1e-9
    table = bench_spread.markdown(rows, "h100", 256)
    assert "| replay img/s median | replay spread | step / replay (per process) |" in table[2]
    assert table[3].count("---") == table[2].count("|") - 1
    assert table[-2].endswith("| 1.000 | 5,060 | 2.4% | 1.152, 1.119, – |")
    assert table[-1].startswith("| dres_baseline | compile | 2 | 5,140 |")
    assert table[-1].endswith("| 5,333 | 0.0% | 1.021, 1.057 |")


def test_spread_table_without_any_replay():
    recs = [{"model": "timm", "mode": "compile", "batch": 256, "images_per_s": r, "peak_mem_gib": 13.4,
             "replay_ms": None, "step_vs_replay": None} for r in (4445, 4469)]
    rows = bench_spread.summarize(recs)
    assert rows[0]["replay_median"] is None and rows[0]["replay_spread_pct"] is None
    assert bench_spread.markdown(rows, "h100", 256)[-1].endswith("| 1.000 | – | – | –, – |")
