"""The task registry: each task declared once in its module, read by the config, the command line and export."""

import ast
import dataclasses
from pathlib import Path

from dres.train.config import TASKS, EvalConfig, ModelConfig
from dres.train.tasks import all_tasks, get_task, model_keys

TRAIN = Path(__file__).resolve().parent.parent / "train"


def test_every_config_task_is_registered_under_its_own_module():
    tasks = all_tasks()
    assert sorted(tasks) == sorted(TASKS)
    for name, task in tasks.items():
        assert task.name == name and type(task).__module__ == f"dres.train.{name}"
        assert get_task(name) is task


def test_a_task_declares_config_keys_that_exist():
    eval_fields = {f.name for f in dataclasses.fields(EvalConfig)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for task in all_tasks().values():
        assert set(task.eval_keys) <= eval_fields, task.name
        assert set(task.model_choice_keys) <= model_fields, task.name
        assert {"embed_dim", "depth"} <= model_keys(task) or "arch" in task.model_choice_keys, task.name


def test_no_task_module_has_a_main_or_imports_the_command_line():
    for name in TASKS:
        tree = ast.parse((TRAIN / f"{name}.py").read_text())
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "dres.train.cli" not in imported, name


def test_a_tasks_own_checks_are_its_spec_and_the_trainer_makes_them(tmp_path):
    """config.build_config checks what every run shares; the task's own checks (its spec's validate, the plots it
    draws) come with tasks.config_for, which the command line takes, and the trainer makes them whatever built
    the config. The config imports nothing of the tasks (test_import_graph.py)."""
    import pytest

    from dres.train.config import ConfigError, build_config
    from dres.train.loop import Trainer
    from dres.train.tasks import config_for

    unmasked = ["model.mask_ratio=0", f"out={tmp_path / 'run'}"]
    cfg = build_config("mae", "quickstart", unmasked)
    message = "config key 'model.mask_ratio' must mask at least one of the model's"
    with pytest.raises(ConfigError, match=message):
        config_for("mae", "quickstart", unmasked)
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg, get_task("mae"))
    assert not (tmp_path / "run").exists()
    smoothed = ["optim.label_smoothing=0.1"]
    assert config_for("classify", "classify_cifar10", smoothed).optim.label_smoothing == 0.1
    for name, preset in (("mae", "quickstart"), ("uvit", "uvit_cifar10")):
        assert build_config(name, preset, smoothed).optim.label_smoothing == 0.1
        smoothing = rf"'optim.label_smoothing' applies to task classify only \(this is {name}\)"
        with pytest.raises(ConfigError, match=smoothing):
            config_for(name, preset, smoothed)
    for task in all_tasks().values():
        assert task.plots(build_config(task.name)) == []  # the defaults draw no plot of a task's own
    grid = build_config("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[1]", "eval.probe_grid_ts=[0.5]"])
    assert get_task("uvit").plots(grid) == [("eval.probe_grid_blocks (probe_grid.png)", "eval.probe_grid_blocks=[]")]
