"""What a run writes to TensorBoard besides the training scalars: evaluation results (numbers as
scalars, the PNGs they name as images) and the run's hyper-parameters beside its final metrics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def log_results(writer, step: int, results: dict, prefix: str) -> None:
    """``results``' numbers as scalars ``prefix/name`` and its ``*_png`` files as images ``prefix/name``."""
    from PIL import Image

    for key, value in results.items():
        if _number(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)
        elif key.endswith("_png") and isinstance(value, str) and Path(value).is_file():
            with Image.open(value) as im:
                writer.add_image(f"{prefix}/{key[:-4]}", np.asarray(im.convert("RGB")), step, dataformats="HWC")


def flat_hparams(config: dict, prefix: str = "") -> dict:
    """A nested config as TensorBoard hyper-parameters: dotted keys; numbers, booleans and text as
    they are, anything else (lists, None) as its text."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def log_hparams(writer, config: dict, metrics: dict) -> None:
    """The run's config beside its final numbers (``hparams/<name>``) in TensorBoard's HPARAMS tab."""
    numbers = {f"hparams/{k}": v for k, v in metrics.items() if _number(v)}
    writer.add_hparams(flat_hparams(config), numbers, run_name=".")
