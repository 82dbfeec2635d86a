"""Reproduce the papers' claims at CIFAR scale, the command line over the plan (``experiments.arms``: the
arm matrix), the runner (``experiments.runner``: trains a chosen subset of arms in parallel, one per GPU,
writes one JSON record per finished arm, rescores kept features, plans a budget of GPU minutes) and the
report (``experiments.report``: RESULTS.md and curve figures built from the records alone: an arm without a
record is "not run yet", never a number).

    python -m experiments.repro --list
    python -m experiments.repro --plan --epochs 50 --gpus 2 --budget-min 9 --img-per-s mae=40000,classify=20000,uvit=8000
    python -m experiments.repro --run A.2x2 --epochs 50 --gpus 2 --root /tmp/dres-repro --records "$OUT/repro" \
        --commit <sha>
    python -m experiments.repro --run C.resnet50d.s1@100,A.sweep@50 --gpus 4 ...  # one queue, a length per word
    python -m experiments.repro --run decisive --dry-run --gpus 4 --img-per-s mae=31000,classify=43000,uvit=3600
    python -m experiments.repro --report    # records/experiments/*/*.json -> RESULTS.md + experiments/figures/
    python -m experiments.repro --rescore records/experiments/CARD-DATE-WHAT   # kept features, both probes

Records are kept under ``records/experiments/<card>-<YYYY-MM-DD>-<what>/`` (records/README.md);
the report reads the arm records of every such folder (the latest record of an arm wins).

Two stages per claim: the short runs (one seed, lengths that fitted the first GPU budgets) and the
decisive runs (the papers' recipes at full length, with seeds; experiments/README.md, "The decisive
runs"); the report never mixes them. An arm trains for its word's ``@EPOCHS``, else its own length (the
decisive arms'), else ``--epochs`` (a claim's arms must share it: the report shows the epochs of every
row); nothing is tuned per arm. Runs go to ``--root/<arm>`` with
``--resume auto``, so an arm cut short continues from its last checkpoint when run again on the same host;
an arm with a record is skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.arms import MATRIX, select_epochs
from experiments.report import FIGURES_DIR, NOTES_MD, RESULTS_MD, report
from experiments.runner import RECORDS_ROOT, dry_run, git_commit, parse_task_map, plan, rescore, run_arms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.repro", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print the arm matrix")
    mode.add_argument("--plan", action="store_true", help="which arms fit --budget-min on --gpus")
    mode.add_argument("--run", metavar="ARMS", help="arm names, groups, tags (A.2x2, A.sweep, A.seeds, B, "
                      "C.resnet50d.s0, C.vit, ...), claims or 'all', comma-separated, each optionally @EPOCHS")
    mode.add_argument("--report", action="store_true", help="write RESULTS.md and the curve figures from the records")
    mode.add_argument("--rescore", metavar="FOLDER", type=Path, help="score the features kept in FOLDER (a records "
                      "folder's features/<arm>.pt or a run root's <arm>/features.pt) with both probes and kNN "
                      "raw and standardised; JSON per arm to --records (default FOLDER/rescored)")
    p.add_argument("--epochs", type=float, default=0, help="training length of every arm (--plan; --run: of the "
                   "words without @EPOCHS)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (0: the CPU)")
    p.add_argument("--jobs", type=int, default=1, help="arms at a time on each GPU (or on the CPU); processes sharing a GPU "
                   "take turns unless NVIDIA's MPS daemon runs (queue.sh's MPS=1), through which small graphed arms "
                   "overlap (experiments/README.md)")
    p.add_argument("--root", type=Path, default=Path("/tmp/dres-repro"), help="run directories (local disk)")
    p.add_argument("--records", type=Path, help="--run: the folder the JSON records go to (required); --report: "
                   "the folder read, with its subfolders (default records/experiments)")
    p.add_argument("--figures", type=Path, default=FIGURES_DIR, help="--report: where the curve figures go")
    p.add_argument("--notes", type=Path, default=NOTES_MD, help="--report: the verdicts (## A, ## B, ## C)")
    p.add_argument("--out", type=Path, default=RESULTS_MD, help="--report: the Markdown file")
    p.add_argument("--preset", default="", help="task=preset replacements, e.g. mae=quickstart (smoke tests)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every arm (data paths, smoke-test sizes); recorded in each command")
    p.add_argument("--curve-every", type=int, default=0, help="eval.every in steps (default: ~10%% of the run)")
    p.add_argument("--commit", default="", help="the commit the tree was copied from (default: git rev-parse HEAD)")
    p.add_argument("--force", action="store_true", help="rerun the named arms that already have a record (not "
                   "the arms they need)")
    p.add_argument("--deadline-min", type=float, default=0, help="start no arm after this many minutes")
    p.add_argument("--no-probe-sweep", action="store_true", help="--run: leave out the probe sweep each finished "
                   "claim-A arm's slot runs on its full features (experiments/README.md)")
    p.add_argument("--dry-run", action="store_true", help="--run: print each arm's exact command (or why it is "
                   "skipped) and, with --img-per-s, its estimated minutes; run nothing")
    p.add_argument("--budget-min", type=float, default=9.0, help="--plan: wall minutes")
    p.add_argument("--img-per-s", default="", help="--plan, --dry-run: task=rate or preset=rate list "
                   "(or one rate for all)")
    p.add_argument("--overhead-s", type=float, default=120.0, help="--plan: start, compile and evaluation per arm")
    a = p.parse_args(argv)
    try:
        if a.list:
            for arm in MATRIX:
                print(f"{arm.name:28s} {','.join(arm.tags):22s} {arm.preset:28s} {' '.join(arm.overrides)}"
                      + (f"  needs {','.join(arm.needs)}" if arm.needs else ""))
            return 0
        if a.report:
            report(a.records or RECORDS_ROOT, a.out, figures=a.figures, notes=a.notes)
            print(f"[repro] wrote {a.out}")
            return 0
        if a.rescore:
            rescore(a.rescore, a.records or a.rescore / "rescored", force=a.force)
            return 0
        if a.plan:
            if a.epochs <= 0:
                raise ValueError("--epochs must be positive (the same for every arm)")
            chosen, left = plan(MATRIX, epochs=a.epochs, gpus=a.gpus, budget_min=a.budget_min,
                                img_per_s=parse_task_map(a.img_per_s, "--img-per-s", float), overhead_s=a.overhead_s)
            for arm, g, est in chosen:
                print(f"fits  {arm.name:28s} gpu {g}  ~{est / 60:.1f} min")
            for arm in left:
                print(f"left  {arm.name}")
            if chosen:
                print(f"\npython -m experiments.repro --run {','.join(x[0].name for x in chosen)} --epochs {a.epochs:g} "
                      f"--gpus {a.gpus} --root /tmp/dres-repro --records records/experiments/CARD-DATE-WHAT")
            return 0
        if a.dry_run:
            dry_run(select_epochs(a.run, a.epochs), gpus=a.gpus, jobs=a.jobs, root=a.root,
                    records=a.records or Path("records/experiments/CARD-DATE-WHAT"),
                    presets=parse_task_map(a.preset, "--preset"), extra=a.extra, every=a.curve_every, force=a.force,
                    img_per_s=parse_task_map(a.img_per_s, "--img-per-s", float), overhead_s=a.overhead_s)
            return 0
        if a.records is None:
            raise ValueError("--run needs --records FOLDER (a new records/experiments/<card>-<YYYY-MM-DD>-<what>, "
                             "or a scratch folder on the GPU host)")
        status = run_arms(select_epochs(a.run, a.epochs), gpus=a.gpus, jobs=a.jobs, root=a.root, records=a.records,
                          presets=parse_task_map(a.preset, "--preset"), extra=a.extra, every=a.curve_every,
                          commit=a.commit or git_commit(), force=a.force, deadline_min=a.deadline_min,
                          probe_sweep=not a.no_probe_sweep)
    except ValueError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        return 2
    for name, s in status.items():
        print(f"[repro] {name}: {s}")
    return 0 if all(s in ("done", "skipped") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
