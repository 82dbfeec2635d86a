"""The probe sweep of claim A, one of its secondary readouts (experiments/notes.md; never its verdict): for an arm's
kept features (``features.pt``: the last block's class token and stream mean of every train and test image), the
project's linear probe over a grid of learning rate x weight decay x epochs, on raw and on standardised features,
each trained on the train split less a held-out part (10%, a fixed draw) and scored on that part; the setting with
the best held-out accuracy (the first in grid order on a tie) is then trained on the whole train split and scored
on the test split. One JSON per arm.

    python -m experiments.probe_sweep RUN_OR_FEATURES --out FOLDER

RUN_OR_FEATURES: a features file, a run folder holding one, or a run root whose claim-A arm folders hold them (the
queue's ``runs/`` on the GPU host that trained them, where the full files stay; ``--arms`` picks some). A run folder
is swept once its run has finished (its ``summary.json``), whose fixed-recipe probes the JSON keeps, so that the
report pairs the sweep with the record of the same run. The grid's probes train together, as the heads of one model
that see the same batches, each with its own learning rate, weight decay and schedule length; each ends where a
lone :func:`dres.eval.linear_probe` of its setting would (up to rounding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dres.eval.probe import LinearHeads, _classes, _fit_head, linear_probe, standardize
from experiments.arms import BY_NAME, select

SWEEP_FOLDER = "probe_sweep"  # a records folder's sweep JSONs: <records folder>/probe_sweep/<arm>.json
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
WEIGHT_DECAYS = (0.0, 1e-3, 1e-2, 1e-1)
EPOCHS = (50, 100, 200)  # the fixed recipes' 200 and shorter schedules
BATCH_SIZE = 1024  # the fixed recipes' batch
HELD_OUT_FRAC = 0.1
SPLIT_SEED = 0  # the held-out draw, the probes' initial weights and batches: the same for every arm
SWEPT_METRIC = "swept_probe_acc"  # the primary feature kind's; another kind's is prefixed <kind>_
RUN_EVAL_KEYS = ("probe_acc",)  # summary.json's fixed-recipe probes the JSON keeps: keys ending so


@dataclass(frozen=True)
class Setting:
    lr: float
    weight_decay: float
    epochs: int
    standardized: bool


def grid_settings(lrs, weight_decays, epochs) -> list[Setting]:
    """Every setting of the grid, those on raw features first, then the same on standardised ones (the heads'
    order in :class:`SlotHeads`)."""
    return [Setting(lr, wd, e, std) for std in (False, True) for lr in lrs for wd in weight_decays for e in epochs]


class SlotHeads(LinearHeads):
    """:class:`dres.eval.probe.LinearHeads` whose heads read S feature slots in equal runs: (B, S, D) -> (B, H, C),
    heads ``[s H/S, (s+1) H/S)`` on slot s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.view(x.shape[1], -1, *self.weight.shape[1:])
        return torch.einsum("bsd,skcd->bskc", x, weight).flatten(1, 2) + self.bias


class HeadwiseAdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled weight decay, bias-corrected moments) with a learning rate and a weight
    decay per head: the parameters' first dimension indexes the heads, ``lr`` and ``weight_decay`` are (heads,)
    tensors, and ``lr_scale`` (heads,) scales the learning rate of the next steps (the schedule)."""

    def __init__(self, params, lr: torch.Tensor, weight_decay: torch.Tensor, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"betas": betas, "eps": eps})
        self.lr, self.weight_decay, self.lr_scale = lr, weight_decay, torch.ones_like(lr)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                per_head = (-1,) + (1,) * (p.dim() - 1)
                lr = (self.lr * self.lr_scale).view(per_head)
                p.mul_(1 - lr * self.weight_decay.view(per_head))
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** state["step"])).add_(group["eps"])
                p.sub_(lr / (1 - beta1 ** state["step"]) * state["exp_avg"] / denom)


def held_out_split(n: int, frac: float = HELD_OUT_FRAC, seed: int = SPLIT_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(fit, held_out)`` of a split of ``n`` samples, ``round(frac n)`` (at least one) held out, drawn
    from ``seed``; each in split order."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, round(frac * n))
    return perm[k:].sort().values, perm[:k].sort().values


def sweep_accuracies(train_x, train_y, eval_x, eval_y, settings: list[Setting], *, batch_size=BATCH_SIZE,
                     num_classes=None, seed=SPLIT_SEED, device="cpu") -> list[float]:
    """The top-1 accuracy on ``eval_x`` of the linear probe of every setting of :func:`grid_settings` (in its
    order), trained on ``train_x``: the heads of one :class:`SlotHeads` on the raw and the standardised features,
    each starting from the draw a lone :func:`dres.eval.linear_probe` makes (seed ``seed``), on its batches, with
    its cosine schedule per iteration over its own epochs (a shorter one then holds: no update at learning rate 0)."""
    kinds = [standardize(train_x, eval_x) if std else (train_x.float(), eval_x.float()) for std in (False, True)]
    slots_train, slots_eval = torch.stack([t for t, _ in kinds], 1), torch.stack([e for _, e in kinds], 1)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(_classes(train_y, eval_y, num_classes), train_x.shape[1], generator=g) * 0.01
    heads = len(settings)
    head = SlotHeads(weight.expand(heads, -1, -1).clone(), torch.zeros(heads, weight.shape[0])).to(device)

    def per_head(field):
        return torch.tensor([getattr(s, field) for s in settings], dtype=torch.float32, device=device)
    opt = HeadwiseAdamW(head.parameters(), lr=per_head("lr"), weight_decay=per_head("weight_decay"))
    total_steps = per_head("epochs") * math.ceil(len(train_x) / batch_size)
    done = 0

    def after_step():  # linear_probes' LambdaLR: step s at 0.5 (1 + cos(pi s / total)), here 0 past the total
        nonlocal done
        done += 1
        opt.lr_scale = torch.where(done < total_steps, 0.5 * (1 + torch.cos(math.pi * done / total_steps)), 0.0)
    acc, _ = _fit_head(head, opt, slots_train, train_y, slots_eval, eval_y, epochs=max(s.epochs for s in settings),
                       batch_size=batch_size, g=g, device=device, bar_name="probe sweep", progress=None,
                       after_step=after_step)
    return acc


def sweep_kind(train_x, train_y, test_x, test_y, settings: list[Setting], *, held_out_frac=HELD_OUT_FRAC,
               seed=SPLIT_SEED, batch_size=BATCH_SIZE, num_classes=None, device="cpu") -> dict:
    """The sweep of one feature kind: every setting's held-out accuracy (:func:`sweep_accuracies` on the split of
    :func:`held_out_split`), the chosen one (the best, the first on a tie) and its probe trained on the whole train
    split, scored on the test split."""
    fit, held = held_out_split(len(train_x), held_out_frac, seed)
    accs = sweep_accuracies(train_x[fit], train_y[fit], train_x[held], train_y[held], settings,
                            batch_size=batch_size, num_classes=num_classes, seed=seed, device=device)
    best = max(range(len(settings)), key=lambda i: (accs[i], -i))
    chosen = settings[best]
    final = linear_probe(train_x, train_y, test_x, test_y, epochs=chosen.epochs, lr=chosen.lr,
                         weight_decay=chosen.weight_decay, standardized=chosen.standardized, batch_size=batch_size,
                         num_classes=num_classes, seed=seed, device=device)
    return {"chosen": asdict(chosen), "held_out_acc": accs[best], "test_acc": final["linear_probe_acc"],
            "train_acc": final["linear_probe_train_acc"], "n_fit": len(fit), "n_held_out": len(held),
            "held_out": [{**asdict(s), "acc": a} for s, a in zip(settings, accs)]}


def sweep_features(state: dict, settings: list[Setting], *, held_out_frac=HELD_OUT_FRAC, seed=SPLIT_SEED,
                   device="cpu") -> dict:
    """:func:`sweep_kind` of every feature kind of a features file's ``state``: ``{"primary": its primary kind,
    "metrics": {swept_probe_acc of the primary kind, <kind>_swept_probe_acc of the others}, "kinds": {kind: its
    sweep}}``."""
    primary = state.get("meta", {}).get("primary", "cls")
    kinds = {}
    for kind in state["train"]:
        kinds[kind] = sweep_kind(state["train"][kind].to(device), state["train_labels"].to(device),
                                 state["test"][kind].to(device), state["test_labels"].to(device), settings,
                                 held_out_frac=held_out_frac, seed=seed, device=device)
    metrics = {(SWEPT_METRIC if kind == primary else f"{kind}_{SWEPT_METRIC}"): k["test_acc"]
               for kind, k in kinds.items()}
    return {"primary": primary, "metrics": metrics, "kinds": kinds}


def find_features(source: Path, arms: str | None) -> tuple[dict[str, Path], list[str]]:
    """``({name: features file}, [why a run folder was passed over])`` of ``source``: a features file (named after
    its run folder, or its stem where that is not ``features``), a run folder holding one, or a run root whose
    claim-A arm folders (those of ``arms``, words of ``experiments.repro --run``, when given) hold one; a run folder
    without its ``summary.json`` (a run not finished) is passed over."""
    from dres.eval.features import FEATURES_FILE

    source = Path(source)
    if source.is_file():
        return {source.parent.name if source.stem == "features" else source.stem: source}, []
    if (source / FEATURES_FILE).is_file():
        return {source.name: source / FEATURES_FILE}, []
    try:
        wanted = {a.name for a in select(arms)} if arms else {n for n, a in BY_NAME.items() if a.claim == "A"}
    except ValueError as e:  # select speaks of --run, whose words --arms takes
        raise ValueError(f"--arms: {str(e).removeprefix('--run: ')}") from None
    found, passed = {}, []
    for path in sorted(source.glob(f"*/{FEATURES_FILE}")):
        if path.parent.name not in wanted:
            continue
        if (path.parent / "summary.json").is_file():
            found[path.parent.name] = path
        else:
            passed.append(f"{path.parent.name}: its run has not finished (no summary.json); passed over")
    if not found and not passed:
        raise ValueError(f"RUN_OR_FEATURES: {source} is no features file, no run folder holding {FEATURES_FILE} and "
                         f"no run root with a claim-A arm's <arm>/{FEATURES_FILE}"
                         + (f" of --arms {arms}" if arms else ""))
    return found, passed


def run_eval(features: Path) -> dict | None:
    """The fixed-recipe probes of the run that kept ``features`` (its ``summary.json`` beside it), None without."""
    summary = features.parent / "summary.json"
    if not summary.is_file():
        return None
    return {k: v for k, v in json.loads(summary.read_text()).get("eval", {}).items() if k.endswith(RUN_EVAL_KEYS)}


def sweep(source: Path, out: Path, settings: list[Setting], *, arms: str | None = None, held_out_frac=HELD_OUT_FRAC,
          force=False, device="cpu", log=print) -> dict[str, str]:
    """Sweep every features file of ``source`` (:func:`find_features`) into ``out/<name>.json`` (an existing one
    is kept unless ``force``). Returns ``{name: "swept" | "kept"}``."""
    from dres.eval.features import load_features
    from dres.records import write_json_atomic
    from experiments.runner import git_commit, not_written

    found, passed = find_features(source, arms)
    for line in passed:
        log(f"[probe_sweep] {line}")
    status = {}
    for name, path, dest in not_written(found, out, force=force, status=status, log=log, who="probe_sweep",
                                        again="sweeps again"):
        t0 = time.time()
        state = load_features(path)
        result = sweep_features(state, settings, held_out_frac=held_out_frac, device=device)
        write_json_atomic(dest, {
            "arm": name, "features": str(path), "n_train": len(state["train_labels"]),
            "n_test": len(state["test_labels"]), "held_out_frac": held_out_frac, "seed": SPLIT_SEED,
            "batch_size": BATCH_SIZE, "grid": {"lr": sorted({s.lr for s in settings}),
                                               "weight_decay": sorted({s.weight_decay for s in settings}),
                                               "epochs": sorted({s.epochs for s in settings})},
            **result, "run_eval": run_eval(path), "device": str(device), "wall_s": time.time() - t0,
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        chosen = "; ".join(f"{kind} {k['test_acc']:.4f} ({k['chosen']})" for kind, k in result["kinds"].items())
        log(f"[probe_sweep] {name}: {chosen}; {time.time() - t0:.0f} s")
        status[name] = "swept"
    return status


def load_sweeps(records: Path) -> dict[str, dict]:
    """The sweep JSONs of arms in ``records``' folders (``<folder>/probe_sweep/<arm>.json``, or ``records`` itself
    being one such folder), the latest by date where an arm has several."""
    found = {}
    for path in sorted(Path(records).glob(f"{SWEEP_FOLDER}/*.json")) + sorted(Path(records).glob(
            f"*/{SWEEP_FOLDER}/*.json")):
        if path.stem not in BY_NAME:
            continue
        rec = json.loads(path.read_text())
        if path.stem not in found or rec["date"] >= found[path.stem]["date"]:
            found[path.stem] = rec
    return found


def _values(text: str, what: str, cast, ok, rule: str) -> tuple:
    try:
        values = tuple(cast(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma list of numbers") from None
    if not values or not all(ok(v) for v in values):
        raise ValueError(f"{what}: {text!r} must be {rule}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.probe_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="RUN_OR_FEATURES", type=Path, help="a features file, a run folder holding one, "
                   "or a run root of claim-A arm folders")
    p.add_argument("--out", type=Path, required=True, help="the folder of the JSONs, one per arm (<arm>.json); "
                   f"committed as <records folder>/{SWEEP_FOLDER}/")
    p.add_argument("--arms", help="a run root's arms: words of experiments.repro --run (default every claim-A arm)")
    p.add_argument("--lrs", default=",".join(map(str, LRS)), help="learning rates, comma-separated")
    p.add_argument("--wds", default=",".join(map(str, WEIGHT_DECAYS)), help="weight decays, comma-separated")
    p.add_argument("--epochs", default=",".join(map(str, EPOCHS)), help="probe epochs, comma-separated")
    p.add_argument("--held-out", type=float, default=HELD_OUT_FRAC, help="the train split's held-out fraction")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--force", action="store_true", help="sweep again an arm whose JSON exists")
    a = p.parse_args(argv)
    try:
        settings = grid_settings(_values(a.lrs, "--lrs", float, lambda v: v > 0, "positive"),
                                 _values(a.wds, "--wds", float, lambda v: v >= 0, "at least 0"),
                                 _values(a.epochs, "--epochs", int, lambda v: v > 0, "positive whole numbers"))
        if not 0 < a.held_out < 1:
            raise ValueError(f"--held-out: {a.held_out:g} must be between 0 and 1")
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device: {a.device} without a GPU")
        sweep(a.source, a.out, settings, arms=a.arms, held_out_frac=a.held_out, force=a.force, device=a.device)
    except ValueError as e:
        print(f"probe_sweep: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
