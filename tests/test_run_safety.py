"""Never lose a run: run-directory ownership, checkpoint rotation, safe loading, unreadable vs
incompatible checkpoints, what the run folder records and how progress is shown (CPU, a tiny MAE on
8x8 digits)."""

import json

import pytest
import torch
import yaml

from dres.train import checkpoint
from dres.train import cli
from dres.train.config import build_config, to_dict
from dres.train.loop import Trainer
from dres.train.mae import TASK

TINY = ["data.img_size=8", "model.img_size=8", "model.patch_size=4", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2",
        "batch_size=32", "optim.warmup_steps=1", "ckpt.every=2", "ckpt.keep=2", "log.every=1", "log.progress=false",
        "log.tensorboard=false", "eval.probe=false", "eval.knn=false", "eval.effective_rank=false",
        "eval.recon=false"]


def _train(out, *extra, steps=4):
    args = ["mae", "--preset", "quickstart", "--out", str(out), "--set", f"steps={steps}"]
    return cli.main(args + sum([["--set", o] for o in TINY], []) + list(extra))


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _snapshot(ckpt_dir):
    return {p.name: p.read_bytes() for p in sorted(ckpt_dir.iterdir())}


def test_resume_with_another_config_refuses_and_keeps_the_checkpoints(tmp_path, capsys):
    """Item 1: a mismatched --resume auto used to report 'unreadable', start from scratch and let
    rotation delete the trained checkpoints."""
    out = tmp_path / "run"
    assert _train(out) == 0
    before = _snapshot(out / "checkpoints")
    assert list(before) == ["step_00000002.pt", "step_00000004.pt"]
    assert _train(out, "--set", "model.embed_dim=16", "--resume", "auto", steps=6) == 2
    err = _one_line_error(capsys)
    assert "another config" in err and "model.embed_dim 32 (saved) vs 16 (now)" in err, err
    assert "scratch" not in err
    assert _snapshot(out / "checkpoints") == before
    # the checkpoint itself also says "incompatible", not "unreadable" (e.g. a run folder without its record)
    (out / "fingerprint.json").unlink()
    (out / "config.yaml").unlink()
    cfg = build_config("mae", "quickstart", TINY + ["model.embed_dim=16", f"out={out}", "steps=6"])
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"step_00000004.pt was saved with another config: "
                                                       r"model.embed_dim 32 \(saved\) vs 16 \(now\)"):
        Trainer(cfg, TASK, log=lambda m: None).setup().resume("auto")
    assert _snapshot(out / "checkpoints") == before


def test_checkpoint_that_reads_but_does_not_fit_is_incompatible(tmp_path):
    cfg = build_config("mae", "quickstart", TINY + [f"out={tmp_path}", "steps=2"])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    trainer.fit()
    small = build_config("mae", "quickstart", TINY + [f"out={tmp_path}", "model.embed_dim=16"])
    other = Trainer(small, TASK, log=lambda m: None).setup()
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match="does not fit this model/optimizer .*size mismatch"):
        checkpoint.load(trainer.last_good, other.model, other.optimizer)  # no fingerprint given: the tensors decide


def test_fresh_run_into_a_run_directory_refuses_and_overwrite_moves_it_aside(tmp_path, capsys):
    """Item 2: a second run into a finished run's folder used to lose its own checkpoints to rotation
    and mix metrics.jsonl."""
    out = tmp_path / "run"
    assert _train(out, steps=6) == 0
    before = _snapshot(out / "checkpoints")
    assert _train(out, steps=2) == 2
    err = _one_line_error(capsys)
    assert f"run directory {out} is not empty" in err and "--resume auto" in err and "--overwrite" in err
    assert _snapshot(out / "checkpoints") == before
    assert _train(out, "--overwrite", steps=2) == 0
    aside = list(tmp_path.glob("run.old-*"))
    assert len(aside) == 1 and _snapshot(aside[0] / "checkpoints") == before
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000002.pt"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert _train(out, "--overwrite", "--resume", "auto", steps=2) == 2
    assert "exclude each other" in _one_line_error(capsys)


def test_rotation_never_deletes_the_checkpoint_just_written_nor_later_ones(tmp_path):
    cfg = build_config("mae", "quickstart", TINY + [f"out={tmp_path}", "steps=6"])
    first = Trainer(cfg, TASK, log=lambda m: None).setup()
    first.fit()
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(first.ckpt_dir)] == [4, 6]
    again = Trainer(build_config("mae", "quickstart", TINY + [f"out={tmp_path}", "steps=4"]), TASK,
                    log=lambda m: None).setup()
    again.fit()  # a second lineage in the same folder (library use, no claim): saves 2 and 4
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(first.ckpt_dir)] == [2, 4, 6]


class _WritesMarker:
    """A pickle payload: unpickling it calls open(marker, 'w'), creating the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_crafted_checkpoint_is_refused_and_its_payload_does_not_run(tmp_path, capsys):
    """Item 3: torch.load(weights_only=False) used to run a crafted .pt's payload."""
    marker = tmp_path / "payload_ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": _WritesMarker(marker), "step": 1}, evil)
    args = ["--eval-only", "--ckpt", str(evil)]
    assert _train(tmp_path / "run", *args) == 2
    err = _one_line_error(capsys)
    assert f"checkpoint {evil} is unreadable (refused to unpickle it" in err, err
    assert not marker.exists()
    cfg = build_config("mae", "quickstart", TINY + [f"out={tmp_path / 'run'}"])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    with pytest.raises(checkpoint.UnreadableCheckpoint, match=r"GLOBAL _?io.open was not an allowed global"):
        checkpoint.load(evil, trainer.model, trainer.optimizer)
    assert not marker.exists()


def test_checkpoints_hold_only_plain_state(tmp_path):
    cfg = build_config("mae", "quickstart", TINY + [f"out={tmp_path}", "steps=2"])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    trainer.fit()
    payload = torch.load(trainer.last_good, weights_only=True)  # raises if anything but plain state was saved
    assert payload["fingerprint"]["model.embed_dim"] == 32 and payload["step"] == 2


@pytest.mark.parametrize("section,key,value", [("model", "attn_impl", "sdpa"), (None, "fp8", False),
                                               ("data", "decode_sms", 0)])
def test_a_run_whose_config_names_a_retired_key_still_evaluates_and_resumes(tmp_path, capsys, section, key, value):
    """Configs saved while attention had other backends hold model.attn_impl: sdpa, the only one left, those
    saved while float8 matmuls were a switch hold fp8: false, and those saved while the matmuls could leave
    multiprocessors to the GPU decode data.decode_sms: 0; here without fingerprint.json or a checkpoint
    fingerprint, so both fingerprints come from such a config."""
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    (config[section] if section else config)[key] = value
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (out / "fingerprint.json").unlink()
    ckpt = out / "checkpoints" / "step_00000002.pt"
    payload = torch.load(ckpt, weights_only=True)
    del payload["fingerprint"]
    torch.save({**payload, "config": config}, ckpt)
    assert cli.eval_main([str(out), "--set", "eval.effective_rank=true"]) == 0
    assert json.loads((out / "eval.json").read_text())["step"] == 2
    assert _train(out, "--resume", "auto", steps=4) == 0
    assert f"resumed from {ckpt} at step 2" in capsys.readouterr().out
    assert f"{key}:" not in (out / "config.yaml").read_text()


def test_all_checkpoints_unreadable_is_an_error_not_a_fresh_start(tmp_path, capsys):
    """Item 4: all-corrupt checkpoints used to give 'starting from scratch', exit 0; --resume PATH to a
    corrupt file was a traceback."""
    out = tmp_path / "run"
    assert _train(out) == 0
    for p in checkpoint.list_checkpoints(out / "checkpoints"):
        p.write_bytes(p.read_bytes()[:100])
    assert _train(out, "--resume", "auto", steps=6) == 2
    err = _one_line_error(capsys)
    assert f"no readable checkpoint in {out / 'checkpoints'}: step_00000004.pt (" in err and "step_00000002.pt (" in err
    assert _train(out, "--resume", str(out / "checkpoints" / "step_00000004.pt"), steps=6) == 2
    assert f"checkpoint {out / 'checkpoints' / 'step_00000004.pt'} is unreadable" in _one_line_error(capsys)
    assert len(checkpoint.list_checkpoints(out / "checkpoints")) == 2  # nothing was rotated away


def test_resume_auto_on_an_empty_directory_starts_fresh(tmp_path, capsys):
    assert _train(tmp_path / "new", "--resume", "auto", steps=2) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert _train(tmp_path / "new", "--resume", "auto", steps=4) == 0  # continues its own run
    assert "resumed from" in capsys.readouterr().out


def test_run_folder_records_what_made_it_and_what_was_printed(tmp_path, capsys):
    """config.yaml names the resolved folder; starts.jsonl the versions, commit, device and command of each
    start; log.txt holds what the run printed, the resume's lines appended."""
    import dres
    from dres.train import rundir

    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["out"] == str(out)
    (first,) = [json.loads(line) for line in (out / rundir.START_FILE).read_text().splitlines()]
    assert first["dres"] == dres.__version__ and first["torch"] == torch.__version__ and first["from_step"] == 0
    assert first["out"] == str(out.resolve()) and first["world"] == 1
    assert first["device"].startswith("cuda" if torch.cuda.is_available() else "cpu")  # device=auto
    assert "git_commit" in first  # None when dres runs from no git checkout
    printed = capsys.readouterr().out
    log = (out / "log.txt").read_text()
    assert log.strip() == printed.strip() and "[dres] done: 2 steps" in log and "[dres] evaluating step 2" in log
    assert _train(out, "--resume", "auto", steps=4) == 0
    starts = [json.loads(line) for line in (out / rundir.START_FILE).read_text().splitlines()]
    assert [s["from_step"] for s in starts] == [0, 2]
    assert (out / "log.txt").read_text().startswith(log) and "resumed from" in (out / "log.txt").read_text()
    before = (out / "log.txt").read_text()
    assert _train(out, "--resume", "auto", "--set", "seed=3", steps=6) == 2
    assert "seed cannot change on resume" in capsys.readouterr().err
    assert (out / "log.txt").read_text() == before  # a refused resume writes nothing, its log included


def test_progress_off_a_terminal_is_a_plain_line_per_log_step(tmp_path, capsys):
    """stderr captured (not a terminal): no step bar redrawn with \\r, one plain line per log step on stdout
    (log.every=10: 4 of 40 steps); the evaluation says when it starts and ends, and its feature extraction
    shows progress."""
    assert _train(tmp_path / "run", "--set", "log.progress=true", "--set", "log.every=10", "--set", "eval.knn=true",
                  steps=40) == 0
    captured = capsys.readouterr()
    assert not [w for w in captured.err.replace("\r", "\n").splitlines() if "step" in w and "/40" in w]
    plain = [line for line in captured.out.splitlines() if line.startswith("[dres] step ")]
    assert [line.split()[2] for line in plain] == ["10/40", "20/40", "30/40", "40/40"], plain
    assert "features" in captured.err
    assert "[dres] evaluating step 40 (mae)" in captured.out and "[dres] evaluation done in" in captured.out


# ------------------------------------------------------------------------------ folders that are not runs
def _tree(d):
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.fixture
def users_folder(tmp_path, monkeypatch):
    """A folder of someone's files, the current directory."""
    home = tmp_path / "project"
    (home / "src").mkdir(parents=True)
    (home / "notes.txt").write_text("my notes")
    (home / "src" / "main.py").write_text("print('hi')")
    (home / "config.yaml").write_text("name: my project\n")  # a config.yaml, but of no dres run
    monkeypatch.chdir(home)
    return home


@pytest.mark.parametrize("out", [".", "..", "./", "src/..", "/"])
@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume", "auto"]])
def test_the_current_directory_and_those_above_it_are_never_run_directories(users_folder, capsys, out, flag):
    """--out . --overwrite was a traceback that moved the user's files into a hidden ..old-<time>/."""
    before, around = _tree(users_folder), sorted(p.name for p in users_folder.parent.iterdir())
    assert _train(out, *flag) == 2
    err = _one_line_error(capsys)
    assert "is the current directory or holds it; a run needs a folder of its own" in err, err
    assert _tree(users_folder) == before and sorted(p.name for p in users_folder.parent.iterdir()) == around


@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume", "auto"], ["--resume", "/missing.pt"]])
def test_a_folder_of_files_that_holds_no_run_is_refused_and_left_as_it_was(users_folder, tmp_path, capsys, flag):
    """--overwrite used to move any folder aside whole, --resume auto to train among its files."""
    before = _tree(users_folder)
    assert _train(users_folder / "src", *flag) == 2
    err = _one_line_error(capsys)
    assert f"run directory {users_folder / 'src'} holds files but no dres run" in err, err
    assert "nothing was moved" in err
    assert _tree(users_folder) == before and not list(users_folder.glob("src.old-*"))
    other = tmp_path / "other"  # out of the current directory, a folder whose config.yaml is not a dres run's
    other.mkdir()
    (other / "config.yaml").write_text("task: build\n")
    assert _train(other, *flag) == 2 and "holds files but no dres run" in _one_line_error(capsys)
    assert [p.name for p in other.iterdir()] == ["config.yaml"]


def test_what_marks_a_folder_as_a_run(tmp_path):
    from dres.train import rundir

    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("")
    assert not rundir.holds_a_run(d)
    (d / "config.yaml").write_text("task: mae\nmodel: {depth: 2}\n")  # a run from before fingerprint.json
    assert rundir.holds_a_run(d)
    (d / "config.yaml").write_text(": not yaml :\n  - [")
    assert not rundir.holds_a_run(d)
    (d / "fingerprint.json").write_text(json.dumps({"task": "classify", "batch_size": 8}))
    assert rundir.holds_a_run(d)
    (d / "fingerprint.json").unlink()
    (d / "run.lock").write_text(json.dumps({"host": "h", "pid": 1}))  # a start under way, or killed
    assert rundir.holds_a_run(d)


def test_overwrite_and_resume_of_a_run_from_before_fingerprint_json_still_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    (out / "fingerprint.json").unlink()
    assert _train(out, "--resume", "auto", steps=4) == 0 and "resumed from" in capsys.readouterr().out
    (out / "fingerprint.json").unlink()
    assert _train(out, "--overwrite", steps=2) == 0
    assert len(list(tmp_path.glob("run.old-*"))) == 1


def test_out_is_normalised_before_anything_is_created(tmp_path, monkeypatch):
    """--out a/../b left an empty a/ behind; '..' after a symbolic link goes up from the link's target."""
    monkeypatch.chdir(tmp_path)
    assert _train("a/../b", steps=2) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["out"] == "b"
    from dres.train.rundir import normal_path

    (tmp_path / "data" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data" / "deep")
    assert normal_path("link/../runs/x") == "data/runs/x"  # where the kernel would put it
    assert normal_path("./runs//x/") == "runs/x"
    assert normal_path(str(tmp_path / "a" / ".." / "c")) == str(tmp_path / "c")
    assert normal_path("../up") == "../up"


# --------------------------------------------------------------------------------- MAE mask ratio
@pytest.mark.parametrize("ratio", ["0", "1e-17", "0.76", "1"])
def test_a_mask_ratio_that_masks_no_patch_or_hides_every_one_is_refused(tmp_path, capsys, ratio):
    """model.mask_ratio=0 trained nothing: MAE's loss is over the masked patches, so with none it is 0. A ratio
    so small that 1 - ratio rounds to 1 masks none as well; one above 1 - 1/patches leaves the encoder nothing."""
    assert _train(tmp_path / "run", "--set", f"model.mask_ratio={ratio}", "--print-config") == 2
    err = _one_line_error(capsys)
    assert ("config key 'model.mask_ratio' must mask at least one of the model's 4 patches and leave one visible"
            in err), err
    assert not (tmp_path / "run").exists()


def test_the_smallest_and_largest_mask_ratios_that_train(tmp_path):
    from dres.models import MAE

    for ratio, masked in (("0.01", 1), ("0.75", 3)):  # 4 patches: int(4 * (1 - ratio)) visible
        cfg = build_config("mae", "quickstart", TINY + [f"model.mask_ratio={ratio}"])
        m = cfg.model
        model = MAE(img_size=8, patch_size=4, in_chans=3, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32,
                    decoder_depth=1, decoder_num_heads=2, mask_ratio=m.mask_ratio)
        loss, _, mask = model(torch.randn(2, 3, 8, 8))
        assert mask.sum(1).tolist() == [masked, masked] and loss.item() > 0


# ------------------------------------------------------------------------ commands from data and bad inputs
def _shard_of_8px_images(path, n=32):
    """A WebDataset shard of ``n`` 8x8 JPEGs with labels."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(np.full((8, 8, 3), i * 7, np.uint8)).save(buf, "JPEG")
            for ext, payload in (("jpg", buf.getvalue()), ("cls", str(i % 10).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return path


def _piped(tmp_path):
    """A ``pipe:`` source whose command leaves a marker file when it runs, and the marker."""
    shard, marker = _shard_of_8px_images(tmp_path / "s.tar"), tmp_path / "the-command-ran"
    return f"pipe:touch {marker} && cat {shard}", marker


@pytest.mark.parametrize("where", ["preset file", "run config data.path", "run config data.val_path"])
def test_a_pipe_source_from_a_file_does_not_run_without_allow_pipe(tmp_path, capsys, where):
    command, marker = _piped(tmp_path)
    key = "val_path" if where.endswith("val_path") else "path"
    if where == "preset file":
        preset = tmp_path / "preset.yaml"
        preset.write_text(yaml.safe_dump({"task": "mae", "data": {"name": "wds", key: command}}))
        out = tmp_path / "new" / "run"
        rc = cli.main(["mae", "--preset", str(preset), "--out", str(out), "--set", "steps=1"])
        assert not (tmp_path / "new").exists()
    else:  # a run folder someone sent: its config.yaml names the command
        run = tmp_path / "run"
        run.mkdir()
        saved = to_dict(build_config("mae", "quickstart", TINY))
        saved["data"].update({"name": "wds", key: command})
        (run / "config.yaml").write_text(yaml.safe_dump(saved))
        rc = cli.eval_main([str(run), "--set", "data.gpu_resident=true"])
    assert rc == 2
    err = _one_line_error(capsys)
    assert f"config key 'data.{key}' runs a shell command" in err and "--allow-pipe" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("how", ["typed with --set", "--allow-pipe"])
def test_a_pipe_source_typed_on_the_command_line_or_allowed_runs(tmp_path, how):
    command, marker = _piped(tmp_path)
    data = ["data.name=wds", "data.in_chans=3", "model.in_chans=3", "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.2, 0.2, 0.2]"]
    if how == "--allow-pipe":
        preset = tmp_path / "preset.yaml"
        preset.write_text(yaml.safe_dump({"task": "mae", "data": {"path": command}}))
        args = ["mae", "--preset", str(preset), "--allow-pipe"]
    else:
        args = ["mae", "--preset", "quickstart", "--set", f"data.path={command}"]
    args += ["--out", str(tmp_path / "run"), "--set", "steps=1"] + sum([["--set", o] for o in TINY + data], [])
    assert cli.main(args) == 0
    assert marker.exists()


def _imagefolder_file(tmp_path):
    (tmp_path / "file.jpg").write_bytes(b"a file")
    return ["data.name=imagefolder", "data.gpu_resident=false", f"data.path={tmp_path / 'file.jpg'}"]


@pytest.mark.parametrize("case, message", [
    ("data.path a file", "is a file, not a folder"),
    ("data.val_path missing", "config key 'data.val_path' names"),
    ("data.mean of 3 values with one channel", "config key 'data.mean' needs one value per channel (data.in_chans=1)"),
    ("data.num_classes=0", "config key 'data.num_classes' must be a positive integer; got 0"),
    ("device=cuda without a GPU", "config key 'device' asks for a CUDA GPU, but this process sees none"),
])
def test_bad_data_inputs_are_one_line_naming_the_key_and_leave_nothing(tmp_path, capsys, case, message):
    if case.startswith("device") and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    extra = {"data.path a file": _imagefolder_file(tmp_path),
             "data.val_path missing": [f"data.val_path={tmp_path / 'no' / 'val'}"],
             "data.mean of 3 values with one channel": ["data.mean=[0.3, 0.3, 0.3]"],
             "data.num_classes=0": ["data.num_classes=0"],
             "device=cuda without a GPU": ["device=cuda"]}[case]
    out = tmp_path / "new" / "run"
    assert _train(out, *sum([["--set", o] for o in extra], []), steps=2) == 2
    err = _one_line_error(capsys)
    assert err.startswith("dres-train: error: ") and message in err, err
    assert not (tmp_path / "new").exists()
