"""Data: the shared CIFAR-10 shards (labels, counts, rank/worker split), digits, on-device
augmentation, resumable positions, corrupt and missing input."""

import gc
import io
import json
import os
import tarfile
from unittest import mock

import numpy as np
import pytest
import torch

from dres.data import (CorruptCounter, DataError, InMemoryLoader, SamplePrep, ShardLoader, build_loader, check_split, default_cifar10_dir,
                       read_digits, read_shards, rrc_params)
from dres.train.config import DataConfig

CIFAR = default_cifar10_dir()
needs_cifar = pytest.mark.skipif(not (CIFAR / "manifest.json").exists(), reason="../shared/data/cifar10 absent")


@needs_cifar
def test_cifar10_test_split_labels_and_counts():
    manifest = json.loads((CIFAR / "manifest.json").read_text())
    x, y, bad = read_shards(str(CIFAR / "cifar10-test-{000000..000001}.tar.gz"))
    assert bad.count == 0
    assert x.shape == (sum(manifest["shards"][f"cifar10-test-00000{i}.tar.gz"]["samples"] for i in range(2)), 3, 32, 32)
    assert x.dtype == torch.uint8
    # CIFAR-10's test split has exactly 1,000 images of each of the 10 classes
    assert torch.bincount(y, minlength=10).tolist() == [1000] * 10
    # labels belong to the images: a per-class mean colour check (ships/airplanes bluer than frogs/deer)
    mean_blue = [x[y == c, 2].float().mean().item() - x[y == c, 1].float().mean().item() for c in range(10)]
    assert mean_blue[8] > mean_blue[6] and mean_blue[0] > mean_blue[4]


@needs_cifar
def test_cifar10_shards_split_by_rank_and_worker_disjoint_and_complete():
    pattern = str(CIFAR / "cifar10-test-000000.tar.gz")
    seen = []
    for rank in range(2):
        ld = ShardLoader(pattern, 64, rank=rank, world=2, seed=0, num_workers=2, train=False, buffer=0,
                         samples_per_epoch=1000, prep=SamplePrep(32, aug="none"))
        for _ in range(len(ld)):
            b = ld.next()
            assert b["image"].shape == (32, 3, 32, 32)
            seen.extend(hash(img.numpy().tobytes()) for img in b["image"])
    # one shard, 2 ranks x 2 workers: every slot reads every 4th sample; no image is seen twice
    assert len(seen) == 2 * (1000 // 64) * 32
    assert len(set(seen)) == len(seen)


@pytest.mark.parametrize("shards,slots", [(20, 15), (1281, 120), (3, 4), (1, 3), (8, 4), (7, 1), (5, 16)])
def test_shards_are_split_over_slots_once_each_and_evenly(shards, slots):
    """Every sample of every shard goes to exactly one slot; the slots' sample counts differ by half a shard at
    most, and no slot reads more than one shard beyond its whole ones."""
    from dres.data.loaders import slot_shards

    per_shard = 60
    names = [f"s{i}" for i in range(shards)]
    owner, reads = {}, []
    for slot in range(slots):
        mine = slot_shards(names, slot, slots)
        reads.append(len(mine))
        for name, share in mine:
            for i in range(per_shard):
                if share is None or i % share[1] == share[0]:
                    assert (name, i) not in owner
                    owner[name, i] = slot
    assert len(owner) == shards * per_shard
    counts = [sum(o == slot for o in owner.values()) for slot in range(slots)]
    assert max(counts) - min(counts) <= per_shard // 2  # dealing the leftover shards whole: a shard apart
    assert max(reads) <= shards // slots + 1


@needs_cifar
def test_cifar10_wds_in_memory_loader_via_config():
    d = DataConfig(name="cifar10_wds", limit=512, img_size=32)
    ld = build_loader(d, "train", 128, rank=0, world=1, seed=0)
    assert len(ld) == 4
    b = ld.next()
    assert b["image"].shape == (128, 3, 32, 32) and b["label"].max() < 10


def test_digits_split_and_upsampling():
    xtr, ytr = read_digits("train", 16)
    xte, yte = read_digits("test", 16)
    assert len(xtr) + len(xte) == 1797 and xtr.shape[1:] == (1, 16, 16)
    assert set(ytr.tolist()) == set(range(10))


def test_in_memory_loader_world_size_invariant_and_resumable():
    x = torch.randint(0, 256, (200, 3, 16, 16), dtype=torch.uint8)
    y = torch.arange(200)
    one = InMemoryLoader(x, y, 32, seed=3, img_size=12)
    parts = [InMemoryLoader(x, y, 32, rank=r, world=2, seed=3, img_size=12) for r in range(2)]
    for _ in range(8):  # crosses an epoch boundary (6 steps per epoch)
        a = one.next()
        b = [p.next() for p in parts]
        assert torch.equal(a["label"], torch.cat([q["label"] for q in b]))
        assert torch.equal(a["image"], torch.cat([q["image"] for q in b]))
    st = one.state_dict()
    nxt = one.next()
    fresh = InMemoryLoader(x, y, 32, seed=3, img_size=12)
    fresh.load_state_dict(st)
    again = fresh.next()
    assert torch.equal(nxt["label"], again["label"]) and torch.equal(nxt["image"], again["image"])


def test_random_resized_crop_params_in_range():
    w, h, cx, cy = rrc_params(4096, np.random.default_rng(0), scale=(0.2, 1.0))
    area = w * h
    assert area.min() >= 0.2 - 1e-6 and area.max() <= 1 + 1e-6
    assert ((cx - w / 2) >= -1 - 1e-6).all() and ((cx + w / 2) <= 1 + 1e-6).all()  # grid units: [-1, 1], w in [0, 1]


def _write_shard(path, samples):
    with tarfile.open(path, "w:gz") as tf:
        for key, img, cls in samples:
            for ext, data in ((".jpg", img), (".cls", cls)):
                info = tarfile.TarInfo(key + ext)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def _jpeg(v):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def test_corrupt_samples_and_shards_are_skipped_and_counted(tmp_path):
    _write_shard(tmp_path / "s-000.tar.gz", [("a", _jpeg(10), b"1"), ("b", b"not a jpeg", b"2"), ("c", _jpeg(30), b"3")])
    good = tmp_path / "s-001.tar.gz"
    _write_shard(good, [(f"k{i}", _jpeg(i), b"4") for i in range(20)])
    data = good.read_bytes()
    (tmp_path / "s-002.tar.gz").write_bytes(data[: len(data) // 2])  # truncated shard
    x, y, bad = read_shards(str(tmp_path / "s-{000..002}.tar.gz"))
    # the bad jpeg; the truncated shard, whose loss no manifest counts
    assert bad.count == 1 and bad.damaged == bad.uncounted == [str(tmp_path / "s-002.tar.gz")]
    assert bad.summary()["corrupt_samples"] is None and bad.summary()["corrupt_samples_at_least"] == 1
    assert 22 <= len(x) < 42 and y[:2].tolist() == [1, 3]


def test_missing_or_empty_inputs_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="data path not found: .*nope-000.tar"):
        read_shards(str(tmp_path / "nope-{000..001}.tar"))
    with pytest.raises(DataError, match="empty"):
        build_loader(DataConfig(name="imagefolder", path=str(tmp_path), gpu_resident=False), "train", 8)
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(DataError, match="no readable samples"):
        read_shards(str(tmp_path / "empty.tar"))
    with pytest.raises(DataError, match="cannot be split over 3 rank"):
        check_split(64, 3, 1)
    for e in (DataError("x"),):
        assert "\n" not in str(e)


def test_brace_notation_matches_webdataset():
    from dres.data.sources import braceexpand

    assert braceexpand("s-{000008..000011}.tar.gz") == [f"s-{i:06d}.tar.gz" for i in range(8, 12)]
    assert braceexpand("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert braceexpand("plain.tar") == ["plain.tar"]
    wds = pytest.importorskip("braceexpand")
    for pattern in ("x{0..3}y{a,bc}", "cifar10-train-{000000..000009}.tar.gz"):
        assert braceexpand(pattern) == list(wds.braceexpand(pattern))


def _damaged_shards(tmp_path):
    """s-000: one undecodable sample of three; s-001: 20 good samples; s-002: s-001 cut in half."""
    _write_shard(tmp_path / "s-000.tar.gz", [("a", _jpeg(10), b"1"), ("b", b"not a jpeg", b"2"), ("c", _jpeg(30), b"3")])
    good = tmp_path / "s-001.tar.gz"
    _write_shard(good, [(f"k{i}", _jpeg(i), b"4") for i in range(20)])
    (tmp_path / "s-002.tar.gz").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    return str(tmp_path / "s-{000..002}.tar.gz")


@pytest.mark.parametrize("resident", [True, False])
def test_lost_data_is_reported_as_it_happens_and_stops_above_the_limit(tmp_path, resident):
    """A truncated shard's lost samples are reported as they happen (once they were one line at the very end)."""
    pattern = _damaged_shards(tmp_path)
    lines = []
    d = DataConfig(name="wds", path=pattern, img_size=8, gpu_resident=resident, num_workers=0, shuffle_buffer=0,
                   normalize=False, max_corrupt_frac=0.5)
    ld = build_loader(d, "train", 4, log=lines.append)
    for _ in range(3 if resident else 6):
        ld.next()
    assert any("s-000.tar.gz:b: " in l and "1 sample(s)" in l for l in lines), lines
    assert any("s-002.tar.gz: truncated or corrupt shard" in l for l in lines), lines
    lost = ld.counter.summary()
    assert lost["corrupt_samples"] is None and lost["corrupt_samples_at_least"] == 1  # s-002 has no manifest count
    assert lost["damaged_shards"] == lost["uncounted_shards"] == [str(tmp_path / "s-002.tar.gz")]
    # the default limit (0.001): one shard in three lost stops the run, naming it
    with pytest.raises(DataError, match=r"too much unreadable data.*1 of 3 shards lost \(.*s-002.tar.gz\).*"
                                        r"data.max_corrupt_frac=0.001"):
        ld = build_loader(DataConfig(name="wds", path=pattern, img_size=8, gpu_resident=resident, num_workers=0,
                                     shuffle_buffer=0, normalize=False), "train", 4)
        for _ in range(6):
            ld.next()


def test_lost_data_lines_are_rate_limited():
    lines = []
    c = CorruptCounter(lines.append)
    for i in range(25):
        c.add(f"x:{i}: OSError", "x")
    assert len(lines) == CorruptCounter.LOG_FIRST and c.count == 25
    with mock.patch.object(CorruptCounter, "LOG_EVERY_S", 0.0):
        c.add("x:25: OSError", "x")
    assert lines[-1].startswith("[dres] lost data: x:25: OSError (and 15 more since the last report); 26 sample(s)")


def test_manifest_sha256_is_checked_before_use(tmp_path):
    import hashlib

    _write_shard(tmp_path / "s-000.tar.gz", [(f"k{i}", _jpeg(i), b"1") for i in range(8)])
    _write_shard(tmp_path / "s-001.tar.gz", [(f"k{i}", _jpeg(i), b"2") for i in range(8)])
    shards = {p.name: {"samples": 8, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
              for p in sorted(tmp_path.glob("s-*.tar.gz"))}
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": shards}))
    d = DataConfig(name="wds", path=str(tmp_path / "s-{000..001}.tar.gz"), img_size=8, normalize=False)
    assert len(build_loader(d, "train", 4)) == 4
    data = bytearray((tmp_path / "s-001.tar.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte that might still decode
    (tmp_path / "s-001.tar.gz").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard .*s-001.tar.gz does not match .*manifest.json \(sha256"):
        build_loader(d, "train", 4)
    d.verify_manifest, d.max_corrupt_frac = False, 1.0
    assert len(build_loader(d, "train", 4, log=lambda m: None)) >= 1  # the user's choice: used as it is


def test_labels_beyond_num_classes_are_a_data_error():
    with pytest.raises(DataError, match=r"labels in the train split of data.name=digits range over \[0, 9\] but "
                                        r"data.num_classes=5"):
        build_loader(DataConfig(name="digits", img_size=8, in_chans=1, num_classes=5, mean=[0.3], std=[0.4]), "train", 8)


def _lost_data_of_a_run(tmp_path, settings):
    """summary.json's ``lost_data`` after a tiny MAE trained on 8x8 shards with ``settings``."""
    from dres.train.config import build_config
    from dres.train.loop import Trainer
    from dres.train.mae import TASK

    cfg = build_config("mae", None, [
        "data.name=wds", "data.img_size=8", "data.normalize=false", "data.aug=none", "model.img_size=8",
        "model.patch_size=4", "model.embed_dim=16", "model.depth=1", "model.num_heads=2", "model.decoder_embed_dim=16",
        "model.decoder_depth=1", "model.decoder_num_heads=2", "log.progress=false", "log.tensorboard=false",
        f"out={tmp_path / 'run'}", *settings])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    trainer.fit()
    trainer.finish()
    return json.loads((tmp_path / "run" / "summary.json").read_text())["lost_data"]


def test_training_summary_records_lost_data(tmp_path):
    pattern = _damaged_shards(tmp_path)
    lost = _lost_data_of_a_run(tmp_path, [f"data.path={pattern}", "data.max_corrupt_frac=0.5", "batch_size=8", "steps=1"])
    assert lost["corrupt_samples"] is None and lost["corrupt_samples_at_least"] == 1  # no manifest: unknown, not 1
    assert lost["damaged_shards"] == [str(tmp_path / "s-002.tar.gz")]


def _cut_cifar_shard(tmp_path, keep_frac):
    """Two real CIFAR-10 test shards and their manifest in ``tmp_path``, the second cut to ``keep_frac``
    of its bytes (with the shard check off, as a user who raised the loss limit would run)."""
    manifest = json.loads((CIFAR / "manifest.json").read_text())
    names = [f"cifar10-test-00000{i}.tar.gz" for i in range(2)]
    for n in names:
        (tmp_path / n).write_bytes((CIFAR / n).read_bytes())
    data = (tmp_path / names[1]).read_bytes()
    (tmp_path / names[1]).write_bytes(data[: int(len(data) * keep_frac)])
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {n: manifest["shards"][n] for n in names}}))
    return str(tmp_path / "cifar10-test-{000000..000001}.tar.gz"), [manifest["shards"][n]["samples"] for n in names]


@needs_cifar
@pytest.mark.parametrize("resident", [True, False])
def test_lost_samples_of_a_cut_shard_are_counted_from_its_manifest(tmp_path, resident):
    from dres.data import lost_data_line

    pattern, counts = _cut_cifar_shard(tmp_path, 0.25)
    d = DataConfig(name="wds", path=pattern, img_size=32, gpu_resident=resident, num_workers=0, shuffle_buffer=0,
                   verify_manifest=False, max_corrupt_frac=0.9)
    lines = []
    ld = build_loader(d, "train", 500, log=lines.append)
    if resident:
        read = len(ld.images)
    else:
        read = 0
        for b in ld.eval_batches(1000):
            read += len(b["label"])
    lost = ld.counter.summary()
    assert 0.6 * counts[1] < lost["corrupt_samples"] < 0.8 * counts[1]  # about 3/4 of the cut shard
    assert read + lost["corrupt_samples"] == sum(counts)  # every sample the manifest lists is read or counted lost
    assert "uncounted_shards" not in lost
    assert f"of {counts[1]} samples (manifest.json) are lost" in " ".join(lines)
    assert lost_data_line(lost).startswith(f"[dres] lost {lost['corrupt_samples']} samples and 1 damaged shards")
    # the default limit stops on the counted loss
    with pytest.raises(DataError, match=rf"{lost['corrupt_samples']} of {sum(counts)} samples"):
        d.max_corrupt_frac = 0.001
        strict = build_loader(d, "train", 500)
        if not resident:
            list(strict.eval_batches(1000))


@needs_cifar
def test_lost_samples_of_a_cut_shard_split_over_slots_are_counted_once(tmp_path):
    """One shard read by 3 slots (more slots than shards): each slot counts only its own share of the loss."""
    from dres.data.loaders import _ShardStream

    pattern, counts = _cut_cifar_shard(tmp_path, 0.25)
    shard = pattern.replace("{000000..000001}", "000001")
    lost, read = 0, 0
    for rank in range(3):
        c = CorruptCounter()
        for batch in _ShardStream([shard], rank, 3, 0, 0, SamplePrep(32, aug="none"), False, 0, 16):
            read += len(batch["labels"])
            c.replay(batch["events"])
        lost += c.count
    assert read + lost == counts[1]


def test_streamed_shards_take_their_epoch_length_from_the_manifest(tmp_path):
    """A streamed loader's epoch is the manifest's sample count (so epochs=E and warmup_epochs work);
    without a count for every shard it is unknown (0), and the trainer then logs no epoch."""
    from dres.data import manifest_samples

    for s in range(2):
        _write_shard(tmp_path / f"s-00{s}.tar.gz", [(f"k{i}", _jpeg(i), b"1") for i in range(8)])
    paths = [str(p) for p in sorted(tmp_path.glob("s-*.tar.gz"))]
    d = DataConfig(name="wds", path=str(tmp_path / "s-{000..001}.tar.gz"), img_size=8, normalize=False,
                   gpu_resident=False, num_workers=0)
    assert manifest_samples(paths) is None and len(build_loader(d, "train", 4)) == 0  # no manifest
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {"s-000.tar.gz": {"samples": 8}}}))
    assert manifest_samples(paths) is None and len(build_loader(d, "train", 4)) == 0  # one shard without a count
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {f"s-00{s}.tar.gz": {"samples": 8} for s in range(2)}}))
    assert manifest_samples(paths) == 16 and len(build_loader(d, "train", 4)) == 4
    d.limit = 8  # data.limit still decides where given
    assert len(build_loader(d, "train", 4)) == 2
    (tmp_path / "manifest.json").write_text("{not json")  # with verification off, a broken manifest stops nothing
    d.limit, d.verify_manifest = 0, False
    assert manifest_samples(paths) is None and len(build_loader(d, "train", 4)) == 0


def test_an_empty_shard_in_the_manifest_is_a_count_of_zero(tmp_path):
    """A manifest may list an empty shard (samples 0): the epoch length still sums the counts, and a damaged
    empty shard has lost a known 0 samples."""
    from dres.data import iter_shard, manifest_samples

    _write_shard(tmp_path / "s-000.tar.gz", [(f"k{i}", _jpeg(i), b"1") for i in range(8)])
    _write_shard(tmp_path / "s-001.tar.gz", [])
    (tmp_path / "s-002.tar.gz").write_bytes(b"not a tar")
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {
        "s-000.tar.gz": {"samples": 8}, "s-001.tar.gz": {"samples": 0}, "s-002.tar.gz": {"samples": 0}}}))
    paths = [str(tmp_path / f"s-00{s}.tar.gz") for s in range(3)]
    assert manifest_samples(paths[:2]) == 8 and manifest_samples(paths[1:2]) == 0
    d = DataConfig(name="wds", path=str(tmp_path / "s-{000..001}.tar.gz"), img_size=8, normalize=False,
                   gpu_resident=False, num_workers=0)
    assert len(build_loader(d, "train", 4)) == 2
    counter = CorruptCounter()
    assert list(iter_shard(paths[2], counter)) == []
    assert counter.summary()["corrupt_samples"] == 0 and counter.damaged == [paths[2]] and not counter.uncounted


def test_trainer_logs_epochs_only_for_data_of_known_size(tmp_path):
    from dres.train.cli import get_task
    from dres.train.config import build_config
    from dres.train.loop import Trainer

    for s in range(2):
        _write_shard(tmp_path / f"s-00{s}.tar.gz", [(f"k{i}", _jpeg(i), b"1") for i in range(8)])
    cfg = build_config("classify", None, [
        "data.name=wds", f"data.path={tmp_path}/s-{{000..001}}.tar.gz", "data.gpu_resident=false",
        "data.num_workers=0", "data.normalize=false", "data.img_size=8", "model.img_size=8", "model.patch_size=4",
        "model.embed_dim=16", "model.depth=1", "model.num_heads=2", "model.num_classes=2", "data.num_classes=2",
        "batch_size=4",
        "steps=2", "optim.warmup_steps=0", "log.every=1", "log.progress=false", "log.tensorboard=false",
        "ckpt.every=0", "device=cpu", f"out={tmp_path / 'run'}"])
    trainer = Trainer(cfg, get_task("classify"), log=lambda m: None).setup()
    trainer.fit()
    assert [h["epoch"] for h in trainer.history] == [None, None]  # a stream without counts: no made-up epoch
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {f"s-00{s}.tar.gz": {"samples": 8} for s in range(2)}}))
    cfg.out = str(tmp_path / "run2")
    trainer = Trainer(cfg, get_task("classify"), log=lambda m: None).setup()
    trainer.fit()
    assert [h["epoch"] for h in trainer.history] == [0.25, 0.5]  # 16 samples, 4 steps an epoch


def test_colour_jitter_trains_only_and_eval_crop_pct_reach_the_in_memory_loader():
    """data.color_jitter acts on training batches only; data.eval_crop_pct on the unaugmented passes (the
    file loaders' own: tests/test_decode.py)."""
    digits = dict(name="digits", img_size=8, mean=[0.3, 0.3, 0.3], std=[0.4, 0.4, 0.4])
    d = DataConfig(**digits, color_jitter=0.4, eval_crop_pct=0.875)
    train, val = build_loader(d, "train", 64, train=True), build_loader(d, "val", 64, train=False)
    assert (train.jitter, val.jitter, val.eval_crop_pct) == (0.4, 0.0, 0.875)
    plain, plain_val = build_loader(DataConfig(**digits), "train", 64), build_loader(DataConfig(**digits), "val", 64,
                                                                                      train=False)
    assert not torch.equal(train.next()["image"], plain.next()["image"])  # the same crops, jittered
    assert not torch.equal(next(val.eval_batches(8))["image"], next(plain_val.eval_batches(8))["image"])


def _prepared(tmp_path, n=24, shard_size=12, bad=(5,)):
    """``n`` small JPEGs (those in ``bad`` not images) in 3 class folders, prepared into shards of ``shard_size``."""
    from dres.data.prep import prepare_shards

    src = tmp_path / "src"
    for i in range(n):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"{i:03d}.jpg").write_bytes(b"no image" if i in bad else _jpeg(i * 7))
    out = tmp_path / "shards"
    manifest = prepare_shards(str(src), str(out), short_side=16, shard_size=shard_size, workers=1, log=lambda m: None)
    return src, out, manifest


def _cut(shard, where):
    """``shard`` cut inside a member's data, or between two members (where a tar reader sees a complete archive)."""
    with tarfile.open(shard) as tf:
        members = tf.getmembers()
    size = members[len(members) // 2].offset if where == "between members" else members[len(members) // 2].offset_data + 7
    shard.write_bytes(shard.read_bytes()[:size])


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("where", ["inside a member", "between members"])
def test_every_sample_of_a_cut_prepared_shard_is_counted_and_named_by_its_source_file(tmp_path, resident, where):
    src, out, manifest = _prepared(tmp_path)
    _cut(out / "shard-000001.tar", where)
    d = DataConfig(name="wds", path=str(out), img_size=8, num_classes=3, gpu_resident=resident, num_workers=0,
                   shuffle_buffer=0, normalize=False, verify_manifest=False, max_corrupt_frac=1.0)
    ld = build_loader(d, "train", 2, log=lambda m: None)
    read = len(ld.images) if resident else sum(len(b["label"]) for b in ld.eval_batches(8))
    lost = ld.counter.summary()
    assert read + lost["corrupt_samples"] == 23 and lost["corrupt_samples"] >= 5  # every sample the manifest lists
    sources = json.loads((out / "sources.json").read_text())["shards"]["shard-000001.tar"]
    assert lost["lost_files"] == [str(src / p) for p in list(sources.values())[-lost["corrupt_samples"]:]]
    assert lost["dropped_by_prep"] == manifest["lost"] == [f"{src / 'c2' / '005.jpg'}: UnidentifiedImageError: "
                                                           "cannot identify image file"]


def test_an_undecodable_sample_of_a_prepared_shard_is_named_by_its_source_file(tmp_path):
    src, out, _ = _prepared(tmp_path, n=8, shard_size=8, bad=())
    shard = out / "shard-000000.tar"
    with tarfile.open(shard) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(shard, "w") as tf:
        for i, (m, data) in enumerate(members):
            data = b"damaged" if i == 2 else data  # the second sample's JPEG
            m.size = len(data)
            tf.addfile(m, io.BytesIO(data))
    key = members[2][0].name.split(".")[0]
    source = str(src / json.loads((out / "sources.json").read_text())["shards"]["shard-000000.tar"][key])
    d = DataConfig(name="wds", path=str(out), img_size=8, num_classes=3, gpu_resident=False, num_workers=0,
                   shuffle_buffer=0, normalize=False, verify_manifest=False, max_corrupt_frac=1.0)
    lines = []
    ld = build_loader(d, "train", 2, log=lines.append)
    assert sum(len(b["label"]) for b in ld.eval_batches(8)) == 7
    assert ld.counter.summary()["lost_files"] == [source] and source in " ".join(lines)


@pytest.mark.parametrize("name", ["../elsewhere.tar", "/etc/passwd", "sub/x.tar", ".."])
def test_a_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path, name):
    from dres.data import expand_shards

    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {name: {"samples": 1}}}))
    with pytest.raises(DataError, match=r"manifest.json names the shard .* which is not a file name in its folder"):
        expand_shards(str(tmp_path))


def test_the_training_summary_carries_lost_files_and_the_files_prep_left_out(tmp_path):
    src, out, manifest = _prepared(tmp_path)
    _cut(out / "shard-000001.tar", "between members")
    lost = _lost_data_of_a_run(tmp_path, [
        f"data.path={out}", "data.num_classes=3", "data.gpu_resident=false", "data.num_workers=0",
        "data.verify_manifest=false", "data.max_corrupt_frac=1.0", "data.shuffle_buffer=0", "batch_size=4", "steps=6",
        "eval.probe=false", "eval.knn=false", "eval.effective_rank=false", "eval.recon=false"])
    assert lost["dropped_by_prep"] == manifest["lost"] and len(manifest["lost"]) == 1
    assert lost["corrupt_samples"] >= 5 and len(lost["lost_files"]) == lost["corrupt_samples"]
    assert all(f.startswith(str(src)) for f in lost["lost_files"])


@pytest.mark.parametrize("resident", [True, False])
def test_a_lost_image_of_a_folder_is_named_in_the_summary(tmp_path, resident):
    for i in range(8):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        (tmp_path / f"c{i % 2}" / f"{i}.jpg").write_bytes(b"damaged" if i == 3 else _jpeg(i * 9))
    d = DataConfig(name="imagefolder", path=str(tmp_path), img_size=8, num_classes=2, gpu_resident=resident,
                   num_workers=0, normalize=False, aug="none", max_corrupt_frac=1.0)
    ld = build_loader(d, "train", 4 if resident else 8, log=lambda m: None)
    if not resident:
        # the epoch's one batch holds every file; the one lost is made up by the batch's first sample, so every
        # step takes one shape
        batch = ld.next()
        assert len(batch["label"]) == 8 and ld.state_dict()["read"] == 7
        assert torch.equal(batch["image"][7], batch["image"][0]) and batch["label"][7] == batch["label"][0]
        assert len({tuple(im.flatten().tolist()) for im in batch["image"][:7]}) == 7
    assert ld.counter.summary()["lost_files"] == [str(tmp_path / "c1" / "3.jpg")]


class _Cycle:
    """A reference cycle whose collection leaves a file named by the process that collected it."""
    def __init__(self, folder):
        self.folder, self.itself = folder, self

    def __del__(self):
        (self.folder / f"collected-in-{os.getpid()}").touch()


class _CollectsGarbage(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        gc.collect()
        return i


def test_workers_never_collect_the_training_processs_garbage(tmp_path):
    """A reference cycle of the training process (a captured step's CUDA graph, whose destructor calls CUDA) is not
    collected in the forked workers, which would abort there; the training process still collects it."""
    from dres.data.loaders import start_workers
    gc.disable()  # the cycle must still be garbage when the workers start
    try:
        _Cycle(tmp_path)
        batches = start_workers(torch.utils.data.DataLoader(_CollectsGarbage(), num_workers=2,
                                                            multiprocessing_context="fork"))
        assert sorted(int(b) for b in batches) == [0, 1, 2, 3]
        del batches
    finally:
        gc.enable()
    gc.collect()
    assert [p.name for p in tmp_path.iterdir()] == [f"collected-in-{os.getpid()}"]
