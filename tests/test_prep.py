"""Shards made once from an ImageFolder tree (dres-prep) and shards read through a command or over HTTP."""

import functools
import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_data import encode
from dres.data import CorruptCounter, DataError, build_loader, expand_shards, iter_shard
from dres.data.prep import main as prep_main
from dres.data.prep import prepare_shards, resized_jpeg
from dres.train.config import DataConfig


def _image(kind, w, h, seed=0):
    return encode(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), kind)


def _tree(root, n=30, classes=3, bad=(), cut=()):
    """``n`` images in ``classes`` class folders; those in ``bad`` are not images, those in ``cut`` JPEGs cut short."""
    kinds = ["jpeg", "grey", "cmyk", "png"]
    for i in range(n):
        d = root / f"class{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        data = b"broken" if i in bad else _image("jpeg" if i in cut else kinds[i % len(kinds)], 40 + i, 30 + i, seed=i)
        (d / f"{i:03d}.JPEG").write_bytes(data[: len(data) * 2 // 3] if i in cut else data)
    return root


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_resized_jpeg_keeps_the_shorter_side_and_small_rgb_jpegs_as_they_are():
    from PIL import Image

    big = _image("cmyk", 90, 60)
    with Image.open(io.BytesIO(resized_jpeg(big, 30, 90))) as im:
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (45, 30))
    small = _image("jpeg", 20, 24)
    assert resized_jpeg(small, 30, 90) == small


def test_prep_writes_shards_and_a_manifest_the_streaming_loader_reads(tmp_path):
    src, out = _tree(tmp_path / "src", bad=(7,)), tmp_path / "shards"
    lines = []
    manifest = prepare_shards(str(src), str(out), short_side=24, shard_size=8, workers=2, log=lines.append)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "prep.json"] + [f"shard-{i:06d}.tar" for i in range(4)] + ["sources.json"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert sum(e["samples"] for e in manifest["shards"].values()) == 29 and manifest["classes"] == ["class0", "class1", "class2"]
    assert manifest["lost"] == [f"{src / 'class1' / '007.JPEG'}: UnidentifiedImageError: cannot identify image file"]
    for name, entry in manifest["shards"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"]
    # every file readable as the shards are (0666 less the umask), the JSON ones too
    assert {(out / n).stat().st_mode & 0o777 for n in names} == {0o666 & ~_umask()}
    # sources.json names each sample's source file, in the shard's order
    sources = json.loads((out / "sources.json").read_text())
    assert sources["source"] == str(src) and sorted(p for keys in sources["shards"].values() for p in keys.values()) == \
        sorted(f"class{i % 3}/{i:03d}.JPEG" for i in range(30) if i != 7)
    # every label once per image, class mixed across shards; every image an RGB JPEG with its shorter side 24
    counter = CorruptCounter()
    samples = [s for name in sorted(manifest["shards"]) for s in iter_shard(str(out / name), counter)]
    assert len(samples) == 29 and counter.count == 0
    assert sorted(int(label) for _, _, label in samples) == sorted(i % 3 for i in range(30) if i != 7)
    d = DataConfig(name="wds", path=str(out), img_size=16, num_classes=3, gpu_resident=False, decode="cpu",
                   num_workers=0, shuffle_buffer=0)
    loader = build_loader(d, "train", 4)
    assert len(loader) == 29 // 4  # the epoch's length from the manifest
    assert loader.next()["image"].shape == (4, 3, 16, 16)
    assert "train with --set data.name=wds" in lines[-1]


def test_prep_continues_after_an_interruption_and_refuses_a_folder_of_other_files(tmp_path, capsys):
    src, out = _tree(tmp_path / "src", bad=(3, 7)), tmp_path / "shards"
    first = prepare_shards(str(src), str(out), short_side=24, shard_size=8, workers=1, log=lambda m: None)
    (out / "shard-000002.tar").unlink()  # as if cut before its rename
    (out / "shard-000002.tar.tmp").write_bytes(b"half a shard")
    (out / "manifest.json").unlink()
    kept = (out / "shard-000000.tar").stat().st_mtime_ns
    again = prepare_shards(str(src), str(out), short_side=24, shard_size=8, workers=1, log=lambda m: None)
    # the same shards and the same files left out, with their reasons, those of the shards kept included
    assert again == first and len(again["lost"]) == 2 and (out / "shard-000000.tar").stat().st_mtime_ns == kept
    assert not list(out.glob("*.tmp"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert prep_main([str(src), str(other)]) == 2
    assert "holds files that are not this command's shards (notes.txt" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        prep_main([str(src), str(tmp_path / "x"), "--quality", "0"])


def test_a_truncated_jpeg_is_decoded_in_full_and_left_out_with_its_reason(tmp_path):
    src = _tree(tmp_path / "src", n=6, cut=(4,))
    manifest = prepare_shards(str(src), str(tmp_path / "out"), short_side=320, shard_size=8, workers=1,
                              log=lambda m: None)
    assert len(manifest["lost"]) == 1  # an RGB JPEG small enough to keep its bytes: only a full decode finds the cut
    assert manifest["lost"][0].startswith(f"{src / 'class1' / '004.JPEG'}: OSError: image file is truncated")
    assert sum(e["samples"] for e in manifest["shards"].values()) == 5


def _prep_files(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_prep_refuses_shards_of_another_source_or_settings_and_replace_writes_new_ones(tmp_path, capsys):
    src, other, out = _tree(tmp_path / "src"), _tree(tmp_path / "other", n=12, classes=2), tmp_path / "out"
    assert prep_main([str(src), str(out), "--short-side", "24", "--shard-size", "8", "--workers", "1"]) == 0
    before = _prep_files(out)
    capsys.readouterr()
    for argv, differ in (([str(other), str(out), "--short-side", "24", "--shard-size", "8"], "source"),
                         ([str(src), str(out), "--short-side", "32", "--shard-size", "8"], "short_side 24 there, 32 now"),
                         ([str(src), str(out), "--short-side", "24", "--shard-size", "4"], "shard_size 8 there, 4 now")):
        assert prep_main(argv + ["--workers", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "holds shards of another source or settings" in err and differ in err
        assert "--replace" in err and _prep_files(out) == before
    (src / "class0" / "999.JPEG").write_bytes(_image("jpeg", 40, 30))  # the source gained a file
    assert prep_main([str(src), str(out), "--short-side", "24", "--shard-size", "8", "--workers", "1"]) == 2
    assert "images 30 there, 31 now, the source's files differ)" in capsys.readouterr().err
    argv = [str(other), str(out), "--short-side", "24", "--shard-size", "4", "--workers", "1", "--replace"]
    assert prep_main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == str(other) and manifest["classes"] == ["class0", "class1"]
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(manifest["shards"]) == [f"shard-{i:06d}.tar" for i in range(3)]


@pytest.mark.parametrize("case", ["inside the source", "source a file", "output a file", "source missing"])
def test_prep_refuses_an_output_inside_the_source_and_files_for_folders_in_one_line(tmp_path, capsys, case):
    src = _tree(tmp_path / "src", n=6)
    (tmp_path / "file").write_text("mine")
    argv, message = {"inside the source": ([src, src / "shards"], "is inside the source"),
                     "source a file": ([tmp_path / "file", tmp_path / "out"], "is a file, not a folder"),
                     "output a file": ([src, tmp_path / "file"], "is a file: the shards need a folder"),
                     "source missing": ([tmp_path / "nope", tmp_path / "out"], "data path not found")}[case]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert prep_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dres-prep: error: ") and message in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before and (tmp_path / "file").read_text() == "mine"


def test_a_signal_stops_prep_in_one_line_and_the_same_command_continues(tmp_path):
    src, out = _tree(tmp_path / "src", n=120), tmp_path / "out"
    argv = [sys.executable, "-m", "dres.data.prep", str(src), str(out), "--short-side", "24", "--shard-size", "2",
            "--workers", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(out.glob("*.tar")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as Slurm and timeout send it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert err.strip() == ("dres-prep: stopped by SIGTERM: the shards written are kept; run the same command again "
                           "to continue")
    assert not list(out.glob("*.tmp")) and not (out / "manifest.json").exists()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh = prepare_shards(str(src), str(tmp_path / "fresh"), short_side=24, shard_size=2, workers=2,
                           log=lambda m: None)
    assert json.loads((out / "manifest.json").read_text())["shards"] == fresh["shards"]


def _shard(path, n, seed=0):
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, payload in (("jpg", _image("jpeg", 12, 10, seed + i)), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return path


def test_shards_read_through_a_pipe_command(tmp_path):
    shard = _shard(tmp_path / "a.tar", 6)
    counter = CorruptCounter()
    assert expand_shards(f"pipe:cat {tmp_path}/{{a,a}}.tar") == [f"pipe:cat {tmp_path}/a.tar"] * 2
    samples = list(iter_shard(f"pipe:cat {shard}", counter))
    assert [k for k, _, _ in samples] == [f"{i:04d}" for i in range(6)] and counter.count == 0
    failed = CorruptCounter()
    list(iter_shard(f"pipe:cat {tmp_path}/missing.tar", failed))
    assert failed.damaged == [f"pipe:cat {tmp_path}/missing.tar"]


def test_shards_over_http_are_checked_against_their_manifest_as_they_stream(tmp_path):
    good, bad = _shard(tmp_path / "s-000.tar", 5), _shard(tmp_path / "s-001.tar", 5, seed=10)
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (good, bad)}
    manifest = {"shards": {"s-000.tar": {"samples": 5, "sha256": sha["s-000.tar"]},
                           "s-001.tar": {"samples": 5, "sha256": "0" * 64}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        pattern = f"{base}/s-{{000..001}}.tar"
        d = DataConfig(name="wds", path=pattern, img_size=8, num_classes=2, gpu_resident=False, decode="cpu",
                       num_workers=0, shuffle_buffer=0, max_corrupt_frac=1.0)
        loader = build_loader(d, "train", 2, train=False)
        assert len(loader) == 5  # the manifest's counts reached over HTTP
        for _ in range(4):
            assert loader.next()["image"].shape == (2, 3, 8, 8)
        counter = CorruptCounter()
        assert len(list(iter_shard(f"{base}/s-001.tar", counter))) == 5
        assert counter.damaged == [f"{base}/s-001.tar"] and "is not its manifest's" in counter.examples[0]
        assert len(list(iter_shard(f"{base}/s-000.tar", CorruptCounter()))) == 5
    finally:
        server.shutdown()


def test_a_local_shard_that_is_not_a_regular_file_is_a_one_line_error(tmp_path):
    import os

    os.mkfifo(tmp_path / "s.tar")
    with pytest.raises(DataError, match="is not a regular file"):
        expand_shards(str(tmp_path / "s.tar"))
