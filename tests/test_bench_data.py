"""benchmarks/bench_data.py: the trainer and loader commands it runs (one process or DDP through the launcher, the
taskset range, the overrides), its argument checks and its table; on a GPU, the GPU half's rate and what it makes
the host wait for."""

import os
import sys
import warnings

import pytest
import torch

from benchmarks import bench_data
from benchmarks.bench_data import error_line, loader_command, main, markdown, trainer_command
from benchmarks.trainer_runs import TRAINER_EVAL_OFF

FILES = ["data.path=/data/inet", "data.name=imagefolder", "data.decode=gpu", "data.num_workers=4"]


def _sets(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]


def test_trainer_command_on_one_gpu_is_one_process_without_dist():
    cmd = trainer_command("mae_vit_b16_baseline", FILES, 4, 8, 1, 60, 256, "/tmp/run", [])
    assert cmd[:4] == ["taskset", "-c", "8-11", sys.executable]
    assert cmd[4:10] == ["-m", "dres.train.mae", "--preset", "mae_vit_b16_in1k", "--out", "/tmp/run"]
    assert "dres.train.launch" not in cmd
    sets = _sets(cmd)
    assert sets[:5] == ["model.variant=baseline", *FILES]
    assert {"dist=none", "batch_size=256", "steps=60", "ckpt.every=0", *TRAINER_EVAL_OFF} <= set(sets)


def test_trainer_command_on_two_gpus_is_ddp_through_the_launcher():
    cmd = trainer_command("resnet50d_224", FILES, 4, 16, 2, 60, 256, "/tmp/run", [])
    # cores a GPU: 2 x 4 cores from core 16
    assert cmd[:3] == ["taskset", "-c", "16-23"]
    assert cmd[3:12] == [sys.executable, "-m", "dres.train.launch", "--standalone", "--nproc_per_node", "2", "-m",
                         "dres.train.classify", "--preset"]
    sets = _sets(cmd)
    assert "dist=ddp" in sets and "dist=none" not in sets
    assert "batch_size=512" in sets and "data.num_workers=4" in sets


def test_trainer_overrides_come_last():
    overrides = ["compile_scope=model", "cuda_graphs=false"]
    cmd = trainer_command("mae_vit_b16_official", FILES, 4, 0, 2, 60, 256, "/tmp/run", overrides)
    assert _sets(cmd)[-2:] == overrides and cmd[-4:] == ["--set", overrides[0], "--set", overrides[1]]


def test_loader_command_starts_its_range_at_the_first_core():
    cmd = loader_command("/data/inet", "cpu", 4, 4, 12)
    assert cmd == ["taskset", "-c", "12-15", sys.executable, "-m", "benchmarks.bench_data", "loader", "--root",
                   "/data/inet", "--decode", "cpu", "--workers", "4"]


CORES = f"this machine's cores 0-{os.cpu_count() - 1}"


@pytest.mark.parametrize("extra, message", [
    (["--first-core", str(os.cpu_count() - 1), "--cores", "1", "--gpus", "2"],
     f"--first-core {os.cpu_count() - 1}, --cores 1 a GPU x --gpus 2: not within {CORES}"),
    (["--cores", str(os.cpu_count() + 1)],
     f"--first-core 0, --cores {os.cpu_count() + 1} a GPU x --gpus 1: not within {CORES}"),
    (["--first-core", "-1", "--cores", "1"], f"--first-core -1, --cores 1 a GPU x --gpus 1: not within {CORES}"),
    (["--gpus", "0"], "--gpus 0: at least 1"),
    (["--gpu-workers", "0"], "--gpu-workers 0: at least 1"),
    (["--cores", "1", "--trainer-decodes", "gpu,nvjpeg"], "--trainer-decodes gpu,nvjpeg: each of cpu, gpu, auto"),
])
def test_a_core_range_off_the_machine_or_no_gpus_is_an_argument_error(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["all", "--root", str(tmp_path), "--out", str(tmp_path / "out"), *extra])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def _trainer_row(data_name, gpus, overrides, rate, cores=4):
    data = [f"data.name={data_name}", "data.decode=gpu", "data.num_workers=4"]
    return {"kind": "trainer", "name": "vit", "data": data, "cores": cores, "gpus": gpus, "overrides": overrides,
            "images_per_s": rate}


def test_markdown_divides_by_the_synthetic_row_of_the_same_gpus_and_overrides():
    rows = [_trainer_row("synthetic", 1, [], 1000.0), _trainer_row("synthetic", 2, [], 2000.0),
            _trainer_row("synthetic", 2, ["compile_scope=model"], 4000.0),
            _trainer_row("imagefolder", 1, [], 900.0), _trainer_row("imagefolder", 2, [], 1000.0),
            _trainer_row("imagefolder", 2, ["compile_scope=model"], 3000.0),
            _trainer_row("imagefolder", 4, [], 3000.0)]
    table = markdown(rows, "h100").splitlines()
    assert "| what | decode | gpus | cores a GPU | workers a GPU | img/s | vs synthetic |" in table
    assert "| trainer vit (imagefolder) | gpu | 1 | 4 | 4 | 900 | 0.90x |" in table
    assert "| trainer vit (imagefolder) | gpu | 2 | 4 | 4 | 1,000 | 0.50x |" in table
    assert "| trainer vit (imagefolder; compile_scope=model) | gpu | 2 | 4 | 4 | 3,000 | 0.75x |" in table
    # no synthetic row on 4 GPUs: no ratio rather than another row's
    assert "| trainer vit (imagefolder) | gpu | 4 | 4 | 4 | 3,000 |  |" in table


def test_a_trainer_row_gives_the_last_epoch_lines_finishing_times():
    from collections import Counter

    from dres.data.decode import decode_paths_line

    epoch_line = decode_paths_line(1, Counter(nvjpeg=19501, workers=467),  # the trainer's own line, as it logs it
                                   [{"finish_s": 0.0581, "decode_s": 0.055, "finish_cpu_s": 0.0062}] * 78)
    row = {**_trainer_row("imagefolder", 1, [], 900.0), "data_lines": [
        "[dres] data: imagefolder, decoded on the GPU (torchvision), 4 workers (8 cores a process)", epoch_line]}
    assert ("| trainer vit (imagefolder; a batch finished in 58.1 ms, 55.0 of them in the decode call, 6.2 on the "
            "thread's CPU) | gpu | 1 | 4 | 4 "
            "| 900 |  |") in markdown([row], "h200").splitlines()
    assert bench_data.finishing_times(row["data_lines"][:1]) == ""


def test_a_trainer_row_is_timed_after_the_batches_its_loader_made_ahead():
    line = "[dres] data: wds, decoded on the CPU, 7 workers (8 cores a process), up to 31 batches made ahead of the step"
    assert bench_data.batches_made_ahead([line, "[dres] data: epoch 1, 100 images decoded: 100 on the CPU"]) == 31
    assert bench_data.batches_made_ahead(["[dres] data: synthetic, 4096 images in memory on cuda:0"]) == 0
    row = {**_trainer_row("wds", 1, [], 3000.0), "batches_ahead": 31, "data_lines": [line]}
    assert "| trainer vit (wds; timed after its 31 batches made ahead) |" in markdown([row], "h200")


def test_markdown_gives_the_gpu_halfs_rate_and_its_host_waits():
    row = {"kind": "decoder", "backend": "torchvision", "hw_load": None, "batch": 256, "images_per_s": 4602.0,
           "decode_call_images_per_s": 4273.0,
           "host_waits_a_batch": {"runtime_calls": {"cudaStreamSynchronize": 2, "cudaEventSynchronize": 236},
                                  "torch_lines": {}}}
    assert ("| GPU half alone (torchvision; the decode call alone 4,273; 236 cudaEventSynchronize a batch; "
            "2 cudaStreamSynchronize a batch) | gpu | 1 | | | 4,602 | |") in markdown([row], "h200").splitlines()


def test_sync_sites_count_the_synchronising_lines_not_the_modes_own_notice():
    def caught(message, filename, lineno):
        return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)

    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation"
    sites = bench_data.sync_sites([caught(notice, "/torch/cuda/__init__.py", 1270),
                                   caught(sync, "/x/decode.py", 7), caught(sync, "/x/decode.py", 7),
                                   caught(sync, "/x/loaders.py", 3), caught("unrelated", "/x/a.py", 1)])
    assert sites == {"decode.py:7": 2, "loaders.py:3": 1}


@pytest.mark.gpu
def test_host_waits_counts_the_runtimes_waits_and_names_pytorchs_lines():
    x = torch.ones(4, device="cuda")
    waits = bench_data.host_waits(lambda: (x * 2).sum().item())  # a copy to the host: one wait
    assert sum(waits["runtime_calls"].values()) >= 1
    assert [line for line in waits["torch_lines"] if line.startswith("test_bench_data.py:")], waits
    quiet = bench_data.host_waits(lambda: x * 2)  # queued work only
    assert not quiet["runtime_calls"] and not quiet["torch_lines"], quiet


@pytest.mark.gpu
def test_the_gpu_halfs_row_on_a_small_folder(tmp_path):
    pytest.importorskip("torchvision")
    bench_data.make_folder(str(tmp_path), images=16, classes=2)
    row = bench_data.decoder_rate(str(tmp_path), "torchvision", batch=4, batches=2)
    assert row["images_per_s"] > 0 and row["decode_call_images_per_s"] > 0
    assert set(row["host_waits_a_batch"]) == {"runtime_calls", "torch_lines"}


def test_markdown_shows_a_failed_row_with_what_failed():
    torchrun_report = ("[rank1]: Traceback (most recent call last):\n"
                       "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                       "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                       "====\ndres.train.mae FAILED\n----\n  exitcode  : 1 (pid: 7)\n====\n")
    failed = {k: v for k, v in _trainer_row("imagefolder", 2, [], 0.0).items() if k != "images_per_s"}
    rows = [_trainer_row("synthetic", 2, [], 2000.0), {**failed, "error": torchrun_report},
            {**failed, "cores": 8, "error": "over 300 s"},
            {"kind": "loader", "source": "wds", "decode": "cpu", "workers": 4, "cores": 4, "error": "a | b\nlast\n"}]
    table = markdown(rows, "h100").splitlines()
    assert ("| trainer vit (imagefolder) | gpu | 2 | 4 | 4 | failed: [rank1]: torch.OutOfMemoryError: CUDA out of "
            "memory. Tried to allocate 2.00 GiB |  |") in table
    assert "| trainer vit (imagefolder) | gpu | 2 | 8 | 4 | failed: over 300 s |  |" in table
    assert "| loader wds | cpu | 1 | 4 | 4 | failed: last |  |" in table
    assert error_line("x | y") == "x | y" and error_line("") == "no message"
    assert "failed: x \\| y |" in markdown([{**failed, "error": "x | y"}], "h100")


def test_trainer_rows_from_files_take_the_gpu_workers_and_the_data_settings(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import benchmarks.bench_data as bench_data

    runs = []
    monkeypatch.setattr(bench_data, "trainer_rate", lambda name, data, cores, **run: runs.append((data, cores)) or {})
    args = SimpleNamespace(root=str(tmp_path), sources=[str(tmp_path)], data_sets=["hw_decode_load=1"], first_core=0,
                           gpus=1, steps=10, trainer_sets=[], trainer_timeout=60, trainers=["mae_vit_b16_baseline"],
                           cores=[16, 4], trainer_decodes=["gpu", "cpu", "auto"], gpu_workers=8, variants=[[]])
    bench_data._trainer_rows(args, [])
    workers = [(cores, next((d for d in data if d.startswith("data.num_workers=")), "-")) for data, cores in runs[1:]]
    # the CPU decode and auto: the trainer's own workers (dres.data.factory.loader_workers, per rank)
    assert workers == [(16, "data.num_workers=8"), (16, "-"), (16, "-"), (4, "data.num_workers=4"), (4, "-"), (4, "-")]
    assert "data.decode=auto" in runs[3][0]
    assert all("data.hw_decode_load=1" in data for data, _ in runs[1:]) and runs[0][1] == 16
    # the GPU decode's own rows read bytes only, whatever share the cores would give the workers; auto: the trainer's
    assert [("data.cpu_decode_share=0" in data) for data, _ in runs[1:]] == [True, False, False] * 2
    # workers that decode a share of the JPEGs themselves: the trainer's own count (its cores less one)
    runs.clear()
    args.cores, args.trainer_decodes, args.variants = [8], ["gpu"], [["cpu_decode_share=0.25"]]
    bench_data._trainer_rows(args, [])
    assert not any(d.startswith("data.num_workers=") for d in runs[1][0]) and "data.cpu_decode_share=0.25" in runs[1][0]


def test_each_variant_is_a_set_of_rows_from_files_with_its_settings_last(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import benchmarks.bench_data as bench_data

    runs = []
    monkeypatch.setattr(bench_data, "trainer_rate", lambda name, data, cores, **run: runs.append(data) or {})
    monkeypatch.setattr(bench_data, "_in_subprocess_loader",
                        lambda root, decode, workers, cores, first, sets: runs.append((decode, sets)) or {})
    args = SimpleNamespace(root=str(tmp_path), sources=[str(tmp_path)], data_sets=["hw_decode_load=1"], first_core=0,
                           gpus=1, steps=10, trainer_sets=[], trainer_timeout=60, trainers=["mae_vit_b16_baseline"],
                           cores=[16], trainer_decodes=["gpu"], loader_decodes=["gpu", "cpu"], gpu_workers=4,
                           variants=[[], ["finish_ahead=0", "num_workers=8"]])
    rows = []
    bench_data._loader_rows(args, rows)
    assert runs == [("gpu", ["hw_decode_load=1"]), ("cpu", ["hw_decode_load=1"]),
                    ("gpu", ["hw_decode_load=1", "finish_ahead=0", "num_workers=8"]),
                    ("cpu", ["hw_decode_load=1", "finish_ahead=0", "num_workers=8"])]
    runs.clear()
    bench_data._trainer_rows(args, rows)
    assert len(runs) == 3 and runs[0] == ["data.name=synthetic", "data.num_classes=100"]
    assert runs[1][-1] == "data.num_workers=4" and "data.hw_decode_load=1" in runs[1]
    assert runs[2][-2:] == ["data.finish_ahead=0", "data.num_workers=8"]  # after the benchmark's own: they win
    assert [r["variant"] for r in rows[-2:]] == [[], ["finish_ahead=0", "num_workers=8"]]
    row = {"kind": "trainer", "name": "vit", "data": ["data.name=imagefolder", "data.decode=gpu", "data.num_workers=8"],
           "cores": 16, "gpus": 1, "overrides": [], "images_per_s": 100.0, "variant": ["finish_ahead=0"]}
    assert "| trainer vit (imagefolder; finish_ahead=0) | gpu | 1 | 16 | 8 | 100 |  |" in markdown([row], "h100")
    # what the run's metrics said of its steps: the host's wait for batches, the captured step's GPU time
    timed = {**row, "data_ms": 12.34, "gpu_ms_per_step": 44.0}
    assert ("| trainer vit (imagefolder; finish_ahead=0; waits for data 12.3 ms a step; step's GPU time 44.0 ms a "
            "step) | gpu |") in markdown([timed], "h100")



def _matrix_args(tmp_path, **kw):
    from types import SimpleNamespace

    from benchmarks.bench_data import MATRIX_VARIANTS

    args = dict(root=str(tmp_path), cores=[4, 8, 16], trainers=["mae_vit_b16_baseline", "resnet50d_224"],
                all_variants_for=["mae_vit_b16_baseline"], ddp=[("mae_vit_b16_baseline", 8)],
                variants=[v.split(",") for v in MATRIX_VARIANTS], devices=["4", "5", "6", "7"], first_core=0, block=16,
                steps=80, trainer_sets=[], trainer_timeout=300, budget_s=450)
    return SimpleNamespace(**{**args, **kw})


def test_the_matrix_runs_ddp_first_then_each_trainer_on_synthetic_data_and_its_variants(tmp_path):
    from benchmarks.bench_data import RUN_PLAN_S, matrix_jobs, matrix_plan_s

    jobs = matrix_jobs(_matrix_args(tmp_path))
    assert (jobs[0]["name"], jobs[0]["gpus"], jobs[0]["cores"]) == ("mae_vit_b16_baseline", 2, 8)
    assert "data.decode=auto" in jobs[0]["data"] and jobs[0]["against_one_gpu"]
    mae = [j for j in jobs[1:] if j["name"] == "mae_vit_b16_baseline"]
    resnet = [j for j in jobs[1:] if j["name"] == "resnet50d_224"]
    assert mae[0]["data"] == ["data.name=synthetic", "data.num_classes=100"] and mae[0]["cores"] == 16
    # every variant at every core count for the lever trainer, the first two (CPU and GPU decode) for the other
    assert len(mae) == 1 + 3 * 4 and len(resnet) == 1 + 3 * 2
    assert {tuple(j["variant"]) for j in resnet[1:]} == {("decode=cpu",), ("decode=gpu",)}
    low = next(j for j in mae if j["cores"] == 4 and "finish_high_priority=false" in j["variant"])
    assert low["data"][-2:] == ["data.decode=gpu", "data.finish_high_priority=false"]
    assert f"data.path={tmp_path}" in low["data"] and "data.gpu_resident=false" in low["data"]
    assert matrix_plan_s(jobs, 4) == RUN_PLAN_S * (len(jobs) + 1) / 4  # the DDP run holds two GPUs


def test_matrix_runs_share_the_gpus_one_run_a_gpu_each_on_its_own_cores(tmp_path, monkeypatch):
    import threading
    import time

    import benchmarks.bench_data as bench_data

    busy, seen, lock = set(), [], threading.Lock()

    def fake_rate(name, data, cores, first_core, gpus, steps, batch, overrides, timeout_s, cpus, devices):
        mine = devices.split(",")
        with lock:
            assert not busy & set(mine), (busy, mine)  # no GPU runs two at once
            busy.update(mine)
        time.sleep(0.02)
        with lock:
            busy.difference_update(mine)
            seen.append((gpus, cores, cpus, devices))
        return {"kind": "trainer", "name": name, "data": data, "cores": cores, "gpus": gpus, "overrides": overrides,
                "images_per_s": 100.0 * gpus}

    monkeypatch.setattr(bench_data, "trainer_rate", fake_rate)
    args = _matrix_args(tmp_path)
    rows, ended = [], []
    rows = bench_data.run_matrix(args, bench_data.matrix_jobs(args), ended.append)
    assert len(rows) == len(ended) == len(seen) == 21 and all("error" not in r for r in rows)
    assert seen[0] == (2, 8, "0-7,16-23", "4,5")  # the DDP run first: two GPUs, 8 of each one's 16 cores
    for gpus, cores, cpus, devices in seen:
        slots = [args.devices.index(d) for d in devices.split(",")]
        assert cpus == ",".join(f"{16 * k}-{16 * k + cores - 1}" for k in slots)
    assert [r["variant"] for r in rows] == [j["variant"] for j in bench_data.matrix_jobs(args)]  # in the plan's order
    table = bench_data.markdown(rows, "h200")
    ddp = "| trainer mae_vit_b16_baseline (imagefolder) | auto | 2 | 8 | by the decode | 200 | 1.00x of 2 x one GPU's |"
    assert ddp in table.splitlines()


def test_matrix_runs_past_the_budget_are_rows_that_say_so(tmp_path, monkeypatch):
    import benchmarks.bench_data as bench_data

    monkeypatch.setattr(bench_data, "trainer_rate", lambda *a, **k: pytest.fail("no run starts past the budget"))
    args = _matrix_args(tmp_path, budget_s=bench_data.RUN_PLAN_S - 1, trainers=["resnet50d_224"], ddp=[], cores=[4])
    rows = bench_data.run_matrix(args, bench_data.matrix_jobs(args), lambda row: None)
    budget = bench_data.RUN_PLAN_S - 1
    assert len(rows) == 3 and all(r["error"].startswith(f"not started: past --budget-s {budget} at ") for r in rows)
    assert f"failed: not started: past --budget-s {budget}" in bench_data.markdown(rows, "h200")


@pytest.mark.parametrize("extra, message", [
    (["--devices", "0,0"], "--devices 0,0: distinct GPUs, at least one"),
    (["--devices", "0", "--ddp", "resnet50d_224:4"], "--ddp needs two of --devices 0"),
    (["--devices", "0,1", "--ddp", "vit:4"], "--ddp vit: vit not among mae_vit_b16_baseline, mae_vit_b16_official, "
                                               "resnet50d_224"),
    (["--devices", "0,1", "--cores", "4,x"], "--cores 4,x: comma-separated integers"),
    (["--devices", "0,1", "--ddp", "resnet50d_224"], "--ddp resnet50d_224: TRAINER:CORES, comma-separated"),
    (["--devices", ",".join(map(str, range(os.cpu_count() + 1))), "--ddp", ""],
     f"more than the 0 cores of each of {os.cpu_count() + 1} GPUs' blocks"),
])
def test_matrix_argument_errors_name_the_argument(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["matrix", "--root", str(tmp_path), "--out", str(tmp_path / "out"), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_trainer_run_is_held_to_its_core_list_on_its_gpus():
    cmd = trainer_command("mae_vit_b16_baseline", FILES, 8, 0, 2, 60, 256, "/tmp/run", [], cpus="0-7,16-23")
    assert cmd[:3] == ["taskset", "-c", "0-7,16-23"] and "--nproc_per_node" in cmd


def test_a_matrix_run_that_leaves_no_rate_is_a_row_that_says_why(tmp_path, monkeypatch):
    import benchmarks.bench_data as bench_data

    def no_metrics(*args, **kwargs):
        raise FileNotFoundError("metrics.jsonl")

    monkeypatch.setattr(bench_data, "trainer_rate", no_metrics)
    args = _matrix_args(tmp_path, trainers=["resnet50d_224"], ddp=[], cores=[4], variants=[["decode=gpu"]])
    rows = bench_data.run_matrix(args, bench_data.matrix_jobs(args), lambda row: None)
    assert [r["error"] for r in rows] == ["FileNotFoundError: metrics.jsonl"] * 2
    assert rows[1]["variant"] == ["decode=gpu"] and rows[1]["cores"] == 4


def test_the_fastest_decode_by_cores_stands_beside_what_auto_takes():
    from benchmarks.bench_data import fastest_decodes

    def row(cores, variant, rate, **kw):
        return {"kind": "trainer", "name": "vit", "data": ["data.name=imagefolder"], "cores": cores, "gpus": 1,
                "variant": variant, "images_per_s": rate, **kw}

    rows = [{**row(16, [], 9000.0), "data": ["data.name=synthetic"]}, row(4, ["decode=cpu"], 100.0),
            row(4, ["decode=gpu"], 300.0), row(4, ["decode=gpu", "finish_high_priority=false"], 200.0),
            row(16, ["decode=cpu"], 500.0), row(16, ["decode=gpu"], 400.0), row(8, ["decode=gpu"], 900.0, gpus=2),
            {k: v for k, v in row(8, ["decode=cpu"], 0.0).items() if k != "images_per_s"} | {"error": "over 300 s"},
            row(24, ["decode=gpu"], 700.0)]
    # auto: the GPU decode below 24 cores, from 16 with half the JPEGs on the workers, the CPU decode from 24
    assert fastest_decodes(rows).splitlines()[2:] == [
        "| vit | 4 | decode=gpu | 300 | decode=gpu |",
        "| vit | 16 | decode=cpu | 500 | decode=gpu; cpu_decode_share=0.5 |",
        "| vit | 24 | decode=gpu | 700 | decode=cpu |"]


def test_matrix_prints_its_plan_and_writes_a_json_a_row_and_the_tables(tmp_path, monkeypatch, capsys):
    import json

    import benchmarks.bench_data as bench_data

    def rate(name, data, cores, first_core, gpus, steps, batch, overrides, timeout_s, cpus, devices):
        return {"kind": "trainer", "name": name, "data": data, "cores": cores, "gpus": gpus, "overrides": overrides,
                "images_per_s": 1000.0 * gpus if "data.name=synthetic" in data else 900.0 * gpus}

    monkeypatch.setattr(bench_data, "trainer_rate", rate)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # a block of 4 cores a GPU
    out = tmp_path / "out"
    assert main(["matrix", "--root", str(tmp_path), "--out", str(out), "--devices", "0,1", "--cores", "2,1",
                 "--trainers", "resnet50d_224", "--ddp", "resnet50d_224:1", "--variant", "decode=gpu"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    assert plan.startswith("matrix: 4 trainer runs on GPUs 0,1, 4 cores a GPU, about ")
    assert plan.endswith(" min (100 s a run; none starts past 450 s)")
    rows = json.loads((out / "data_matrix.json").read_text())["rows"]
    assert len(rows) == 4 == len(list((out / "data_matrix").glob("*.json")))
    assert json.loads((out / "data_matrix" / "resnet50d_224-1gpu-1cores-imagefolder-decode-gpu.json").read_text()) == \
        rows[-1]
    table = (out / "data_matrix.md").read_text()
    assert "| trainer resnet50d_224 (imagefolder) | auto | 2 | 1 | by the decode | 1,800 | 0.90x of 2 x one GPU's |" \
        in table and "| resnet50d_224 | 1 | decode=gpu | 900 | decode=gpu |" in table
