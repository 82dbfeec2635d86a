"""ResidualDroppath (Park) and timm drop path as one controller of per-sample residual scales.

The controller owns the iteration count (its parity picks the kind of iteration) and the
per-(residual, sample-slot) masks. For residual ``i`` and a batch of ``B`` samples it hands out the
``(row_scale, grad_scale)`` pair that :func:`dres.ops.residual_layer_norm` takes (DESIGN.md table):

=======================================  ==============  ===============
iteration                                row_scale       grad_scale
=======================================  ==============  ===============
residual_droppath, even iteration        m               m
residual_droppath, odd iteration         None (= 1)      1 - m
drop_path (timm, scale by keep)          m / keep        m / keep
eval (``not self.training``) or p = 0    None            None
=======================================  ==============  ===============

``m`` is a per-sample Bernoulli(keep) mask. Even iterations draw fresh masks; the odd iteration that
follows reuses them, slot by slot, so the samples whose branch was dropped are the ones whose branch
alone is trained (``X + f(X).detach() * m + f(X) * (1 - m)``: the value of a plain residual).

Contract with the trainer:

* call :meth:`next_iteration` once per optimizer step, after it;
* all micro-batches (gradient accumulation) of one iteration share the iteration's masks slot by slot,
  so they must all have the batch size the masks were drawn for. A batch of another size (a last,
  partial batch; an odd iteration after an even one of another size) raises ``ValueError`` rather
  than reuse masks that belong to other slots: use ``drop_last=True`` and equal micro-batches;
* drop_path mode also draws once per iteration (fresh every iteration, shared by micro-batches),
  which has the same distribution as timm's per-forward draw.

The state (iteration, masks, the iteration they were drawn in, the generator's state) is this
module's extra state, so it is part of the owning model's ``state_dict`` and a resumed run continues
the alternation, and the mask sequence, exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

MODES = ("residual_droppath", "drop_path")

Scales = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


def depth_linear_rates(drop_prob: float, num_residuals: int, residuals_per_block: int = 2) -> list[float]:
    """timm's rule, ``linspace(0, drop_prob, depth)`` over blocks; both residuals of a block share it."""
    num_blocks = max(1, -(-num_residuals // residuals_per_block))
    block_rates = [drop_prob * b / (num_blocks - 1) if num_blocks > 1 else drop_prob for b in range(num_blocks)]
    return [block_rates[i // residuals_per_block] for i in range(num_residuals)]


class ResidualDroppath(nn.Module):
    """Per-residual, per-sample scales for ResidualDroppath or timm drop path (see the module doc).

    drop_prob: the drop rate (of the deepest residual when ``depth_linear``).
    num_residuals: how many residuals the controlled stack has (2 per transformer block).
    mode: ``"residual_droppath"`` (alternate even/odd iterations) or ``"drop_path"`` (timm).
    depth_linear: timm's linear-in-depth rate over blocks of ``residuals_per_block`` residuals;
        False gives every residual ``drop_prob``.
    seed: seeds the controller's own CPU generator (masks do not consume the global RNG).
    """

    def __init__(self, drop_prob: float, num_residuals: int, mode: str = "residual_droppath",
                 depth_linear: bool = True, residuals_per_block: int = 2, seed: int = 0):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"drop_prob must lie in [0, 1), got {drop_prob}")
        if num_residuals < 1:
            raise ValueError(f"num_residuals must be >= 1, got {num_residuals}")
        self.drop_prob = float(drop_prob)
        self.num_residuals = int(num_residuals)
        self.mode = mode
        self.rates = (depth_linear_rates(drop_prob, num_residuals, residuals_per_block) if depth_linear
                      else [float(drop_prob)] * num_residuals)
        self.generator = torch.Generator().manual_seed(seed)
        self.iteration = 0
        self.masks: Optional[torch.Tensor] = None  # (num_residuals, B) float32 on CPU, 1 = keep
        self.mask_iteration = -1  # the iteration the masks were drawn in
        self._device_scales: Optional[tuple[torch.device, list[Scales]]] = None

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}, num_residuals={self.num_residuals}, mode={self.mode}"

    @property
    def active(self) -> bool:
        """Whether scales are non-trivial: training mode and a positive drop rate."""
        return self.training and self.drop_prob > 0

    @property
    def odd(self) -> bool:
        return self.iteration % 2 == 1

    def next_iteration(self) -> None:
        """Advance to the next optimizer step (call once per step, after it)."""
        self.iteration += 1
        self._device_scales = None

    def _draw(self, batch_size: int) -> None:
        keep = torch.tensor([1.0 - r for r in self.rates], dtype=torch.float32).unsqueeze(1)
        uniform = torch.rand((self.num_residuals, batch_size), generator=self.generator)
        self.masks = (uniform < keep).to(torch.float32)
        self.mask_iteration = self.iteration
        self._device_scales = None

    def _check_batch(self, batch_size: int, what: str) -> None:
        if self.masks.shape[1] != batch_size:
            raise ValueError(
                f"ResidualDroppath: batch size {batch_size} differs from the {self.masks.shape[1]} sample slots "
                f"of the masks {what}; masks are per sample slot and never reused for another batch size. "
                "Use equal-sized batches and micro-batches (drop_last=True)."
            )

    def _prepare(self, batch_size: int) -> None:
        if self.mode == "drop_path" or not self.odd:
            if self.mask_iteration != self.iteration:
                self._draw(batch_size)
            else:
                self._check_batch(batch_size, f"drawn earlier in iteration {self.iteration}")
            return
        if self.masks is None or self.mask_iteration != self.iteration - 1:
            raise RuntimeError(
                f"ResidualDroppath: odd iteration {self.iteration} needs the masks of even iteration "
                f"{self.iteration - 1}, but the last masks were drawn in iteration {self.mask_iteration} "
                "(was there a training forward in the even iteration, and next_iteration() once per step?)"
            )
        self._check_batch(batch_size, f"of even iteration {self.mask_iteration}")

    def _scales_on(self, device: torch.device) -> list[Scales]:
        if self._device_scales is not None and self._device_scales[0] == device:
            return self._device_scales[1]
        masks = self.masks.to(device)
        scales: list[Scales] = []
        for i, rate in enumerate(self.rates):
            m = masks[i]
            if rate == 0.0:
                scales.append((None, None))
            elif self.mode == "drop_path":
                s = m / (1.0 - rate)
                scales.append((s, s))
            elif self.odd:
                scales.append((None, 1.0 - m))
            else:
                scales.append((m, m))
        self._device_scales = (device, scales)
        return scales

    @torch.compiler.disable
    def scales(self, batch_size: int, device) -> list[Scales]:
        """``(row_scale, grad_scale)`` for every residual, for a batch of ``batch_size`` on ``device``."""
        if not self.active:
            return [(None, None)] * self.num_residuals
        self._prepare(int(batch_size))
        return self._scales_on(torch.device(device))

    def residual_scales(self, index: int, batch_size: int, device) -> Scales:
        """``(row_scale, grad_scale)`` of residual ``index`` (see :meth:`scales`)."""
        if not 0 <= index < self.num_residuals:
            raise IndexError(f"residual index {index} out of range for {self.num_residuals} residuals")
        return self.scales(batch_size, device)[index]

    # state_dict: parity, masks and RNG travel with the model's checkpoint
    def get_extra_state(self) -> dict:
        return {"iteration": self.iteration, "mask_iteration": self.mask_iteration,
                "masks": None if self.masks is None else self.masks.clone(),
                "generator": self.generator.get_state(), "mode": self.mode, "rates": list(self.rates)}

    def set_extra_state(self, state: dict) -> None:
        if state["mode"] != self.mode or len(state["rates"]) != self.num_residuals:
            raise ValueError(f"ResidualDroppath state is for mode={state['mode']!r} with {len(state['rates'])} "
                             f"residuals; this controller has mode={self.mode!r} with {self.num_residuals}")
        self.iteration = int(state["iteration"])
        self.mask_iteration = int(state["mask_iteration"])
        self.masks = None if state["masks"] is None else state["masks"].to("cpu", torch.float32).clone()
        self.generator.set_state(state["generator"].to("cpu"))
        self._device_scales = None


def build_droppath(droppath: Optional[ResidualDroppath], drop_path: float, droppath_mode: str,
                   num_residuals: int, seed: int = 0) -> Optional[ResidualDroppath]:
    """The controller a model uses: the one given, else one built from ``drop_path`` (None if 0)."""
    if droppath is not None:
        if droppath.num_residuals != num_residuals:
            raise ValueError(f"droppath controls {droppath.num_residuals} residuals but the stack has {num_residuals}")
        return droppath
    if drop_path > 0:
        return ResidualDroppath(drop_path, num_residuals, mode=droppath_mode, seed=seed)
    return None
