"""benchmarks/bench_data.py without a GPU: the trainer and loader commands it runs (one process or DDP through the
launcher, the taskset range, the overrides), its argument checks and its table."""

import os
import sys

import pytest

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

