"""The outputs of a log step (dres.train.runlog.RunLog): metrics.jsonl's line, TensorBoard scalars and the
progress bar, written on the main rank only."""

import json

from dres.train.runlog import RunLog

REC = {"step": 5, "loss": 0.25, "lr": 1e-3, "img_per_s": 640.0, "model_tflops": 0.5, "mfu": 0.125, "epoch": None}


class _Scalars:
    """What a SummaryWriter was given."""

    def __init__(self):
        self.added = []

    def add_scalar(self, tag, value, step):
        self.added.append((tag, value, step))


def _one_log_step(tmp_path, main):
    """What a RunLog of a rank (``main`` or not) gives a SummaryWriter for the step of :data:`REC`."""
    tb = _Scalars()
    runlog = RunLog(tmp_path / "metrics.jsonl", main=main, tb=tb, show_progress=True, total=10, initial=4,
                    kept=lambda: "no checkpoint was written")
    runlog.advance()
    runlog.step(REC)
    runlog.close()
    return tb.added


def test_a_log_step_writes_its_line_its_scalars_and_the_bar(tmp_path, capsys):
    scalars = _one_log_step(tmp_path, True)
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps(REC) + "\n"
    # every value but the step and the unknown epoch, at the record's step
    assert scalars == [("train/loss", 0.25, 5), ("train/lr", 1e-3, 5), ("train/img_per_s", 640.0, 5),
                       ("train/model_tflops", 0.5, 5), ("train/mfu", 0.125, 5)]
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert "5/10" in bar and "img_s=640, loss=0.2500, lr=1.00e-03, mfu=12.5%" in bar, bar  # tqdm sorts them


def test_other_ranks_write_nothing(tmp_path, capsys):
    assert _one_log_step(tmp_path, False) == []
    assert not (tmp_path / "metrics.jsonl").exists() and capsys.readouterr().err == ""
