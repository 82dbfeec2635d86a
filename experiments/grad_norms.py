"""Where ResidualDroppath's gradient goes: the gradient norm of every block of a classifier, on even and on odd
iterations, measured in the trainer's own steps.

    python -m experiments.grad_norms --preset classify_resnet50d_cifar10_timm --steps 2000 \\
        --set model.droppath_mode=residual_droppath --out grad_norms.json

Trains the preset's model for ``--steps`` steps exactly as ``dres-train classify`` would (its data,
augmentation, optimizer and schedule), eagerly and without a captured step, so that each parameter's gradient
can be read as the backward leaves it (before clipping). Parameters are grouped by block (``layer<i>.<j>`` of a
ResNet, its projection shortcut apart; ``blocks.<i>`` of a ViT; stem and head by their module) and each group's
gradient norm is recorded at every step, by the parity of the model's ResidualDroppath controller (a model without one counts every step even). The
JSON holds, per group in model order, the mean norm over even and over odd steps and their ratio: with the paper's
method, an odd iteration trains only the dropped samples' branches, so a block's odd/even ratio near its drop rate
says its branch weights got that share of the gradient, and the stem's and head's ratios say how the kept
branches' detach reaches what lies below and above them.
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import sys
import tempfile
from pathlib import Path

BLOCK = re.compile(r"^(.*?(?:layer\d+\.\d+(?:\.downsample)?|blocks\.\d+))\.")


def group_of(param_name: str) -> str:
    """The block a parameter belongs to (``net.layer2.3``, ``encoder.transformer.blocks.4``; a ResNet block's
    projection shortcut apart, ``net.layer2.0.downsample``: it is no branch), else its module."""
    m = BLOCK.match(param_name)
    return m.group(1) if m else param_name.rpartition(".")[0] or param_name


class GradNormRecorder:
    """Per-group gradient norms of ``model`` at every optimizer step, keyed by the ResidualDroppath parity.

    Each parameter's squared gradient norm is added to its group's sum as the backward accumulates it
    (``register_post_accumulate_grad_hook``); a process-wide optimizer pre-step hook closes the step: the groups'
    norms are kept under the controller's parity (read before the step advances it) and the sums reset."""

    def __init__(self, model):
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from dres.nn import ResidualDroppath

        self.controller = next((m for m in model.modules() if isinstance(m, ResidualDroppath)), None)
        self.groups = list(dict.fromkeys(group_of(n) for n, p in model.named_parameters() if p.requires_grad))
        self.sums: dict[str, "torch.Tensor"] = {}
        self.steps: dict[str, list[dict[str, float]]] = {"even": [], "odd": []}
        self.handles = [p.register_post_accumulate_grad_hook(self._adder(group_of(n)))
                        for n, p in model.named_parameters() if p.requires_grad]
        self.handles.append(register_optimizer_step_pre_hook(self._close_step))

    def _adder(self, group):
        def add(p):
            sq = p.grad.detach().float().pow(2).sum()
            self.sums[group] = self.sums[group] + sq if group in self.sums else sq
        return add

    def _close_step(self, optimizer, args, kwargs):
        if not self.sums:
            return
        odd = self.controller is not None and self.controller.active and self.controller.iteration % 2 == 1
        self.steps["odd" if odd else "even"].append({g: v.sqrt().item() for g, v in self.sums.items()})
        self.sums = {}

    def remove(self):
        for h in self.handles:
            h.remove()

    def summary(self) -> list[dict]:
        """Per group: the mean norm over even steps and over odd steps, and odd / even."""
        rows = []
        for g in self.groups:
            mean = {k: statistics.fmean(s[g] for s in steps if g in s) if any(g in s for s in steps) else None
                    for k, steps in self.steps.items()}
            ratio = mean["odd"] / mean["even"] if mean["odd"] is not None and mean["even"] else None
            rows.append({"group": g, "even_mean": mean["even"], "odd_mean": mean["odd"], "odd_over_even": ratio})
        return rows


def measure(preset: str, steps: int, sets: list[str], out_dir: Path, log=print) -> dict:
    """Train ``preset`` (with ``sets``) for ``steps`` eager steps in ``out_dir`` and return the recorder's
    summary with what was run."""
    from dres.train.cli import get_task
    from dres.train.config import build_config
    from dres.train.loop import Trainer

    task = "classify"
    cfg = build_config(task, preset, list(sets) + ["compile=false", "cuda_graphs=false", f"steps={steps}",
                                                  "eval.every=0", "ckpt.every=0", f"out={out_dir}"])
    trainer = Trainer(cfg, get_task(task), log=log)
    trainer.setup()
    recorder = GradNormRecorder(trainer.raw_model)
    try:
        trainer.fit()
    finally:
        recorder.remove()
    return {"preset": preset, "overrides": list(sets), "steps": steps,
            "rates": None if recorder.controller is None else list(recorder.controller.rates),
            "even_steps": len(recorder.steps["even"]), "odd_steps": len(recorder.steps["odd"]),
            "groups": recorder.summary(), "device": str(trainer.device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.grad_norms", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="a classify preset, e.g. classify_resnet50d_cifar10_timm")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (half of them odd iterations)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--out", type=Path, required=True, help="the JSON written (refused if it exists)")
    a = p.parse_args(argv)
    try:
        if a.steps < 2:
            raise ValueError(f"--steps must be at least 2 (an even and an odd iteration), got {a.steps}")
        if a.out.exists():
            raise ValueError(f"--out {a.out} exists; name a new file")
        from dres.records import write_json_atomic

        with tempfile.TemporaryDirectory(prefix="dres-grad-norms-") as run:
            result = measure(a.preset, a.steps, a.sets, Path(run) / "run")
        write_json_atomic(a.out, result)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"grad_norms: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for row in result["groups"]:
        print(f"{row['group']:40s} even {row['even_mean'] or 0:.4g}  odd {row['odd_mean'] or 0:.4g}  "
              f"odd/even {row['odd_over_even'] if row['odd_over_even'] is not None else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
