"""Decay schedules for decayed identity shortcuts: ``x_{l+1} = alpha_l * x_l + f_l(x_l)``.

Two schedules (docs/design.md, "What the project computes"), both falling linearly with depth from 1:

* ``"linspace"`` (default; the authors' code, xiao7199/decayed_Identity_shortcuts):
  ``alpha_i = 1 - linspace(0, 1, n)[i] * (1 - alpha_min)``, so the last residual is exactly alpha_min.
* ``"paper"`` (the paper's text): ``alpha_l = 1 - l * (1 - alpha_min) / n`` for ``l = 0 .. n-1``;
  the last residual is ``1 - (n-1)(1-alpha_min)/n``, slightly above alpha_min.

Each attention and each MLP sub-layer is one residual (``per_block=False``, the authors' choice). With
``per_block=True`` the schedule runs over blocks and both residuals of a block share the block's alpha.
"""

from __future__ import annotations

SCHEDULES = ("linspace", "paper")


def _schedule(n: int, alpha_min: float, schedule: str) -> list[float]:
    if schedule == "linspace":
        if n == 1:
            return [1.0]  # numpy's linspace(0, 1, 1) is [0.]: a single residual keeps alpha = 1
        return [1.0 - (i / (n - 1)) * (1.0 - alpha_min) for i in range(n)]
    return [1.0 - i * (1.0 - alpha_min) / n for i in range(n)]


def decay_schedule(num_residuals: int, alpha_min: float, schedule: str = "linspace", per_block: bool = False,
                   residuals_per_block: int = 2) -> list[float]:
    """The alpha of each of ``num_residuals`` residuals, shallowest first. alpha_min = 1 gives all ones.

    ``per_block=True``: one alpha per block of ``residuals_per_block`` consecutive residuals.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if num_residuals < 1:
        raise ValueError(f"num_residuals must be >= 1, got {num_residuals}")
    if not 0.0 <= alpha_min <= 1.0:
        raise ValueError(f"alpha_min must lie in [0, 1], got {alpha_min}")
    if not per_block:
        return _schedule(num_residuals, alpha_min, schedule)
    if num_residuals % residuals_per_block:
        raise ValueError(f"per_block=True needs num_residuals ({num_residuals}) divisible by "
                         f"residuals_per_block ({residuals_per_block})")
    per_block_alphas = _schedule(num_residuals // residuals_per_block, alpha_min, schedule)
    return [a for a in per_block_alphas for _ in range(residuals_per_block)]


def describe_schedule(alphas: list[float], schedule: str, alpha_min: float, per_block: bool, where: str) -> str:
    """One log line saying which schedule a model uses (a run's log states its shortcuts)."""
    unit = "block" if per_block else "sub-layer"
    return (f"decayed shortcuts ({where}): schedule={schedule} alpha_min={alpha_min} per {unit}, "
            f"{len(alphas)} residuals, alpha {alphas[0]:.4f} -> {alphas[-1]:.4f}")
