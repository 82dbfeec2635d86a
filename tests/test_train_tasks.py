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
