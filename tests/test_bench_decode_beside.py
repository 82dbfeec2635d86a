"""benchmarks/bench_decode_beside.py: its decoder specs, argument checks and table; on a GPU, every case of a small
folder's batches alone and beside the load, in threads and in a process of its own."""

import json

import pytest
import torch

from benchmarks import bench_data
from benchmarks.bench_data import prepared_batches
from benchmarks.bench_decode_beside import calls_markdown, main, markdown, parse_decoders


def test_decoder_specs_parse_with_the_hardware_share_defaulting_to_the_hardware():
    assert parse_decoders("torchvision,nvimgcodec:0.65,nvimgcodec,nvjpeg,nvjpeg:0") == [
        ("torchvision", 0.0), ("nvimgcodec", 0.65), ("nvimgcodec", 1.0), ("nvjpeg", 1.0), ("nvjpeg", 0.0)]
    for bad in ("dali", "nvimgcodec:1.5", "nvimgcodec:x", "torchvision:1", "nvjpeg:2", ","):
        with pytest.raises(ValueError, match=f"--decoders {bad}: "):
            parse_decoders(bad)


@pytest.mark.parametrize("extra, message", [
    (["--decoders", "dali"],
     "--decoders dali: each of torchvision, nvimgcodec[:SHARE] or nvjpeg[:SHARE], SHARE in [0, 1]"),
    (["--threads", "1,0"], "--threads 1,0: counts of at least 1, comma-separated"),
    (["--threads", "two"], "--threads two: counts of at least 1, comma-separated"),
    (["--priorities", "low"], "--priorities low: each of high, default"),
    (["--batch", "0"], "--batch 0: at least 1"),
    (["--batches", "0"], "--batches 0: at least 1"),
    (["--load-size", "64"], "--load-size 64: at least 256"),
    (["--load-streams", "blocking"], "--load-streams blocking: each of default, own"),
    (["--load-kinds", "gemm,spin"], "--load-kinds gemm,spin: each of gemm, sleep"),
    (["--sleep-ms", "0.5"], "--sleep-ms 0.5: at least 1"),
    (["--hardware-queues", "33"], "--hardware-queues is 33: CUDA takes 1 to 32 hardware queues"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), *extra])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_root_that_is_not_a_folder_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path / "none")])
    assert e.value.code == 2
    assert f"--root {tmp_path / 'none'}: not a folder (make one: python -m benchmarks.bench_data make" in \
        capsys.readouterr().err


def test_hardware_queues_are_the_asked_the_environments_or_the_trainers(monkeypatch):
    from benchmarks.bench_decode_beside import hardware_queues

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert hardware_queues(None) == 32 and hardware_queues(8) == 8
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert hardware_queues(None) == 8 and hardware_queues(16) == 16
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "many")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS in the environment is many: CUDA takes 1 to 32"):
        hardware_queues(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path)])
    assert e.value.code == 2
    assert "no CUDA device: the GPU half runs on a GPU" in capsys.readouterr().err


def test_prepared_batches_are_pinned_where_asked_and_hold_the_jpegs_bytes(tmp_path):
    bench_data.make_folder(str(tmp_path), images=12, classes=2)
    batches = prepared_batches(str(tmp_path), 4, 2)
    assert len(batches) == 2 and all(len(b["labels"]) == 4 for b in batches)
    assert len(prepared_batches(str(tmp_path), 4, 5)) == 3 and len(prepared_batches(str(tmp_path), 16, 2)) == 1
    assert sum(len(b["jpeg_rows"]) for b in batches) > 0
    assert not batches[0]["jpeg_bytes"].is_pinned()
    if torch.cuda.is_available():
        assert prepared_batches(str(tmp_path), 4, 1, pin=True)[0]["jpeg_bytes"].is_pinned()


def test_table_gives_each_case_its_ratios_and_a_failed_case_its_error():
    rows = [{"decoder": "torchvision", "share": None, "load": "gemm", "load_stream": "default", "priority": "high",
             "where": "thread", "threads": 1, "ms_alone": 13.0, "ms_beside": 58.5, "load_rate_alone": 4700.0,
             "load_rate_beside": 4230.0},
            {"decoder": "nvimgcodec", "share": 0.65, "load": "sleep", "load_stream": "own", "priority": "default",
             "where": "process", "threads": 1, "error": "RuntimeError: nvimgcodec is not installed"}]
    table = markdown(rows, "h200", 256, 4096, 40.0, 32).splitlines()
    assert table[0].startswith("The GPU half of 256-image batches alone and beside a load (h200, 32 hardware queues): "
                               "gemm, 4096^3 bf16 GEMMs; sleep, kernels that wait 40 ms each.")
    assert "| torchvision | gemm | default | thread | 1 | high | 13.0 | 58.5 | 4.50x | 0.90 |" in table
    assert ("| nvimgcodec, hardware share 0.65 | sleep | own | process | 1 | default | RuntimeError: nvimgcodec is "
            "not installed | | | |") in table


@pytest.mark.gpu
def test_gpu_every_case_of_a_small_folder_runs_in_threads_and_in_a_process(tmp_path):
    pytest.importorskip("torchvision")
    root, out = tmp_path / "imgs", tmp_path / "out"
    bench_data.make_folder(str(root), images=64, classes=2)
    assert main(["--root", str(root), "--batch", "16", "--batches", "2", "--threads", "1,2",
                 "--priorities", "high,default", "--load-size", "512", "--load-streams", "default,own",
                 "--load-kinds", "gemm,sleep", "--sleep-ms", "5", "--out", str(out)]) == 0
    rows = json.loads((out / "decode_beside.json").read_text())["rows"]
    cases = [("thread", 1, "high"), ("thread", 2, "high"), ("process", 1, "high"),
             ("thread", 1, "default"), ("thread", 2, "default"), ("process", 1, "default")]
    assert [(r["load"], r["load_stream"], r["where"], r["threads"], r["priority"]) for r in rows] == [
        (kind, stream, *case) for kind in ("gemm", "sleep") for stream in ("default", "own") for case in cases]
    for r in rows:
        assert "error" not in r, r
        assert r["ms_alone"] > 0 and r["ms_beside"] > 0 and r["load_rate_alone"] > 0 and r["load_rate_beside"] > 0
    assert "| torchvision | sleep | own | process | 1 | default |" in (out / "decode_beside.md").read_text()


def test_calls_table_gives_each_threads_costliest_calls_alone_and_beside():
    rows = [{"decoder": "nvjpeg", "share": 1.0, "load": "sleep", "where": "thread", "threads": 1,
             "calls_alone": {"7": {"cudaStreamSynchronize": [1.0, 9.5], "cuLaunchKernel": [4.0, 0.1]}},
             "calls_beside": {"7": {"cudaStreamSynchronize": [1.0, 21.0], "cuLaunchKernel": [4.0, 0.1],
                                    "cudaEventSynchronize": [2.0, 3.0]},
                              "9": {"cudaLaunchKernel": [1.0, 0.02]}}},
            {"decoder": "torchvision", "share": None, "load": "sleep", "where": "process", "threads": 1}]
    table = calls_markdown(rows, top=2).splitlines()
    assert table[2:] == ["| decoder | load | thread | call | alone | beside |", "|---|---|---|---|---|---|",
                         "| nvjpeg, share 1 | sleep | 7 | cudaStreamSynchronize | 1.0, 9.50 | 1.0, 21.00 |",
                         "| nvjpeg, share 1 | sleep | 7 | cudaEventSynchronize | – | 2.0, 3.00 |",
                         "| nvjpeg, share 1 | sleep | 9 | cudaLaunchKernel | – | 1.0, 0.02 |"]


@pytest.mark.gpu
def test_gpu_profiled_calls_of_a_one_thread_case_come_alone_and_beside(tmp_path):
    pytest.importorskip("torchvision")
    root, out = tmp_path / "imgs", tmp_path / "out"
    bench_data.make_folder(str(root), images=32, classes=2)
    assert main(["--root", str(root), "--batch", "16", "--batches", "2", "--threads", "1,2", "--no-process",
                 "--load-size", "512", "--load-kinds", "sleep", "--sleep-ms", "5", "--profile-calls",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "decode_beside.json").read_text())["rows"]
    assert [r["threads"] for r in rows] == [1, 2] and "calls_beside" not in rows[1]
    called = {call for calls in rows[0]["calls_beside"].values() for call in calls}
    assert rows[0]["calls_alone"] and any(c.startswith("cuda") for c in called), called
    assert "CUDA calls a batch" in (out / "decode_beside.md").read_text()
