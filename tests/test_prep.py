"""Shards made once from an ImageFolder tree (dres-prep) and shards read through a command or over HTTP."""

import functools
import hashlib
import http.server
import io
import json
import tarfile
import threading

import numpy as np
import pytest

from benchmarks.bench_data import encode
from dres.data import CorruptCounter, DataError, build_loader, expand_shards, iter_shard
from dres.data.prep import main as prep_main
from dres.data.prep import prepare_shards, resized_jpeg
from dres.train.config import DataConfig


def _image(kind, w, h, seed=0):
    return encode(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), kind)


def _tree(root, n=30, classes=3, bad=()):
    kinds = ["jpeg", "grey", "cmyk", "png"]
    for i in range(n):
        d = root / f"class{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        data = b"broken" if i in bad else _image(kinds[i % len(kinds)], 40 + i, 30 + i, seed=i)
        (d / f"{i:03d}.JPEG").write_bytes(data)
    return root


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
    assert names == ["manifest.json"] + [f"shard-{i:06d}.tar" for i in range(4)]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert sum(e["samples"] for e in manifest["shards"].values()) == 29 and manifest["classes"] == ["class0", "class1", "class2"]
    assert manifest["lost"] == [f"{src / 'class1' / '007.JPEG'}: UnidentifiedImageError"]
    for name, entry in manifest["shards"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"]
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
    src, out = _tree(tmp_path / "src"), tmp_path / "shards"
    first = prepare_shards(str(src), str(out), short_side=24, shard_size=8, workers=1, log=lambda m: None)
    (out / "shard-000002.tar").unlink()  # as if cut before its rename
    (out / "manifest.json").unlink()
    kept = (out / "shard-000000.tar").stat().st_mtime_ns
    again = prepare_shards(str(src), str(out), short_side=24, shard_size=8, workers=1, log=lambda m: None)
    assert again == first and (out / "shard-000000.tar").stat().st_mtime_ns == kept
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert prep_main([str(src), str(other)]) == 2
    assert "holds files that are not this command's shards (notes.txt" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        prep_main([str(src), str(tmp_path / "x"), "--quality", "0"])


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
