"""The trainer's tasks, each declared once in its own module (``mae.py``, ``uvit.py``, ``classify.py``) as
``TASK``, and registered here; the command line, ``dres-export`` and the trainer read them from here.

A task declares what differs between runs of the one training loop (:mod:`dres.train.loop`)::

    task.name                                                    # what `dres-train NAME` and config.yaml's task say
    task.eval_keys                                               # the eval.* config keys it reads
    task.model_classes() -> [nn.Module subclasses]               # what build_model may build (its model.* keys)
    task.validate(cfg)                                           # its checks of a config (ConfigError, one line)
    task.plots(cfg) -> [(what, the setting that turns it off)]   # the plots of its own the run draws (matplotlib)
    task.build_model(cfg) -> nn.Module
    task.loss(model, batch, cfg) -> (loss, {name: tensor})      # one micro-batch, under autocast
    task.evaluate(trainer) -> {name: value}                      # probes, samples, ...
    task.curve(trainer) -> {name: value}                         # the cheap one, every eval.every steps

``python -m dres.train.NAME`` is ``dres-train NAME`` (:func:`dres.train.common.run_as_command`).
"""

from __future__ import annotations

import inspect

from dres.train import config


def all_tasks() -> dict:
    """``{name: task}`` of every task, in the order ``dres-train --help`` lists them."""
    from dres.train import classify, mae, uvit

    return {task.name: task for task in (classify.TASK, mae.TASK, uvit.TASK)}


def get_task(name: str):
    """The task registered as ``name``."""
    return all_tasks()[name]


def model_keys(task) -> set:
    """The model.* keys (without the prefix) that the task's model classes take; ModelConfig serves every task."""
    return {name for cls in task.model_classes() for name in inspect.signature(cls.__init__).parameters}


def check(cfg: config.Config, task) -> None:
    """The checks of ``cfg`` that depend on its ``task``, after :func:`dres.train.config.validate`'s of every run: the
    plots the run draws need matplotlib, and the task's own (``task.validate``)."""
    config.need_plots(cfg, task.plots(cfg))
    task.validate(cfg)


def config_for(task: str | None = None, preset: str | None = None, overrides=(), base: dict | None = None):
    """:func:`dres.train.config.build_config` (``task`` None: the preset's or ``base``'s), checked for its task
    (:func:`check`): the config of a run that the trainer takes."""
    cfg = config.build_config(task, preset, overrides, base)
    check(cfg, get_task(cfg.task))
    return cfg
