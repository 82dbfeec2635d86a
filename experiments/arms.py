"""The plan of the reproduction: every arm of the papers' claims (preset, overrides, seed, length, tags),
the papers' numbers beside them, and the selection of arms by name, group, tag or claim.

An arm is one training run of one setting and seed; its group is the setting (seeds averaged in the report);
its tags are the words ``--run`` takes (``A.decisive.s2``, ``C.d0``, ...). The matrix is in priority order:
what a budget should buy first comes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRAIN_SIZES = {"cifar10_wds": 50000, "cifar_tv": 50000}  # images an epoch, to turn epochs into steps


@dataclass(frozen=True)
class Arm:
    name: str
    claim: str                      # A | B | C
    group: str                      # one setting; its seeds are averaged in the report
    task: str
    preset: str
    overrides: tuple[str, ...]
    seed: int
    tags: tuple[str, ...]           # selectors for --run, e.g. "A.2x2"
    needs: tuple[str, ...] = ()     # arms whose run directory this one reads (B: the FD classifier)
    paper: tuple[tuple[str, float], ...] = ()  # (what, value) from the papers, for the report
    labels: dict = field(default_factory=dict, compare=False, hash=False)  # table columns of the setting
    stage: str = "short"            # short (the first runs, at lengths that fit) | decisive (the papers' recipes)
    epochs: float = 0               # the arm's length when neither --epochs nor @EPOCHS gives one (0: none)


# ------------------------------------------------------------------------------------------------
# The matrix. Papers' numbers: the decayed-shortcut, U-ViT and ResidualDroppath papers.

MAE_PAPER = {
    ("official", 1.0): (("IN-100 ViT-B/16 probe", 76.5), ("IN-100 ViT-S/16 probe", 69.2)),
    ("baseline", 1.0): (("IN-1K ViT-B/16 probe, vanilla MAE", 67.8), ("IN-1K ViT-B/16 kNN, vanilla MAE", 27.4)),
    ("official", 0.8): (("IN-100 ViT-B/16 probe", 79.8),),
    ("official", 0.7): (("IN-100 ViT-B/16 probe", 81.8),),
    ("official", 0.6): (("IN-100 ViT-B/16 probe", 83.6), ("IN-100 ViT-S/16 probe", 78.5),
                        ("IN-1K ViT-B/16 probe", 72.7), ("IN-1K ViT-B/16 kNN", 63.9)),
    ("official", 0.5): (("IN-100 ViT-B/16 probe", 82.3),),
    ("baseline", 0.6): (("IN-100 ViT-B/16 probe, decayed without encoder-decoder skips", 61.5),),
}
UVIT_PAPER = {1.0: (("CIFAR-100 probe", 62.5), ("CIFAR-100 FID (Inception)", 14.3)),
              0.7: (("CIFAR-100 probe", 66.9), ("CIFAR-100 FID (Inception)", 9.0))}
RDP_PAPER = {("resnet50d", "none"): 89.55, ("resnet50d", "drop_path"): 89.84,
             ("resnet50d", "residual_droppath"): 90.84, ("resnet50", "none"): 88.07}
CLASSIFY_PRESETS = {"resnet50d": "classify_resnet50d_cifar10", "resnet50": "classify_resnet50_cifar10",
                    "vit": "classify_cifar10"}
MODES = ("none", "drop_path", "residual_droppath")
# the other readings of Park's Algorithm 1, each with its queue word: as written (block 0 detached too), and the
# abstract's (kept branches' weights frozen, their gradient passed on)
READINGS = {"residual_droppath_literal": "C.literal", "residual_droppath_frozen": "C.frozen"}
FD_CLASSIFIER_ARM = "C-vit-none-s0"


def _mae_arm(variant, alpha, seed, tag):
    # the authors' code zero-initialises every branch end even at alpha_min 1 with skips
    zero_init = "true" if (variant, alpha) == ("official", 1.0) else "auto"
    group = f"A-{variant}-a{alpha}"
    return Arm(f"{group}-s{seed}", "A", group, "mae", "mae_cifar10",
               (f"model.variant={variant}", f"model.alpha_min={alpha}", f"model.zero_init={zero_init}"), seed,
               (tag,), paper=MAE_PAPER.get((variant, alpha), ()),
               labels={"variant": variant, "alpha_min": alpha, "zero_init": zero_init})


def _classify_arm(arch, mode, seed):
    group = f"C-{arch}-{mode}"
    paper = ((f"CIFAR-10 {arch} top-1", RDP_PAPER[(arch, mode)]),) if (arch, mode) in RDP_PAPER else ()
    return Arm(f"{group}-s{seed}", "C", group, "classify", CLASSIFY_PRESETS[arch], (f"model.droppath_mode={mode}",),
               seed, (f"C.{arch}.s{seed}", f"C.{arch}"), paper=paper, labels={"arch": arch, "mode": mode})


def _uvit_arm(alpha, seed):
    # the records of these arms were made with the preset's EMA 0.9999 (override-free), at 10 epochs
    group = f"B-uvit-a{alpha}"
    return Arm(f"{group}-s{seed}", "B", group, "uvit", "uvit_cifar10", (f"model.alpha_min={alpha}",), seed,
               ("B.short",), needs=(FD_CLASSIFIER_ARM,), paper=UVIT_PAPER[alpha], labels={"alpha_min": alpha})


# The decisive runs: the papers' recipes at full length, with seeds.
MAE_DECISIVE_EPOCHS = 400     # mae_cifar10's own length
# claim A's pair at full schedules of other lengths (the papers train 800-1600): the preset's recipe at each, its
# fixed 20 warm-up epochs included (MAE's rule: one warm-up length, 40 epochs, at 800 and at 1600)
MAE_LENGTHS = (100, 200, 800)
MAE_LENGTH_SEEDS = (0, 1, 2)
MAE_DECISIVE_BATCH = 1024     # every A arm the same; lr = blr x 1024 / 256
PROBE_EPOCHS_PAPER = 200      # the decayed-shortcut paper's linear probe: 200 epochs, lr 1e-2, batch 1024
# 64 x 390 = 24,960 steps of 128: ~15 minutes of training at 3.6k img/s on an H100
UVIT_DECISIVE_EPOCHS = 64
# the final evaluation's probe grid (the paper picks the best block and noise level): 13 blocks in uvit_cifar10;
# seed 0 probed 3 / 6 / 9 x 0.05 / 0.1 / 0.3, the later seeds every block at the low noise levels the paper favours
UVIT_PROBE_GRID = ("eval.probe_grid_blocks=[3, 6, 9]", "eval.probe_grid_ts=[0.05, 0.1, 0.3]")
UVIT_PROBE_GRID_FULL = ("eval.probe_grid_blocks=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]",
                        "eval.probe_grid_ts=[0.01, 0.02, 0.05, 0.1]")
# the later seeds' generation measure: three sample draws, the real-vs-real floor (train against test images) and a
# 2,000-sample classifier FD at every curve point (does it rank the model along training?)
UVIT_FD = ("eval.fd_draws=3", "eval.fd_real_floor=true", "eval.curve_fd_samples=2000")
UVIT_EMA_DECAY = 0.9998       # 0.9998 ** 24,960 = 0.68% of the initial weights left (the paper's 0.9999: 8.2%)
EMA_INITIAL_WEIGHT_MAX = 0.01
RDP_DECISIVE_EPOCHS = 300     # timm's train.py default
RDP_PILOT_EPOCHS = 30         # the 224 px pilot: ~9 minutes an arm at the 5.0k img/s an H200 measured
RDP_LONG_EPOCHS = 600         # twice timm's length: does ResidualDroppath's underfit close with more steps?
RDP_SEEDS = (0, 1, 2)
TIMM_PRESET = "classify_resnet50d_cifar10_timm"
TIMM_PRESET_224 = "classify_resnet50d_cifar10_timm224"


def ema_initial_weight(decay: float, steps: int) -> float:
    """The weight of the initial parameters in an EMA of decay ``decay`` after ``steps`` updates."""
    return decay ** steps


def _mae_decisive_arm(variant, alpha, seed, tag, zero_init, epochs=MAE_DECISIVE_EPOCHS):
    """A claim-A arm of the preset's recipe at batch 1024; ``epochs`` other than 400: the official pair at another
    length (group ``A<epochs>-...``, queue words ``A.length.e<epochs>[.s<seed>]`` and ``A.length``)."""
    group = f"A{epochs}-{variant}-a{alpha}" + ("-zi" if (variant, zero_init) == ("baseline", "true") else "")
    if epochs == MAE_DECISIVE_EPOCHS:
        # the seed pairs of official 0.6 vs 1.0 that decide the claim, every seed (A.pairs: retrain and rescore them)
        pair = ("A.pairs",) if variant == "official" and alpha in (0.6, 1.0) else ()
        tags = (tag, *pair, "A.decisive", "decisive")
    else:
        tags = (f"{tag}.s{seed}", tag, "A.length", "decisive")
    return Arm(f"{group}-s{seed}", "A", group, "mae", "mae_cifar10",
               (f"model.variant={variant}", f"model.alpha_min={alpha}", f"model.zero_init={zero_init}",
                f"batch_size={MAE_DECISIVE_BATCH}", f"eval.probe_epochs={PROBE_EPOCHS_PAPER}"), seed,
               tags, paper=() if group.endswith("-zi") else MAE_PAPER.get((variant, alpha), ()),
               labels={"variant": variant, "alpha_min": alpha, "zero_init": zero_init}, stage="decisive",
               epochs=epochs)


def _uvit_decisive_arm(alpha, seed):
    group = f"B64-uvit-a{alpha}"
    evaluation = UVIT_PROBE_GRID if seed == 0 else UVIT_PROBE_GRID_FULL + UVIT_FD  # seed 0's record keeps its recipe
    return Arm(f"{group}-s{seed}", "B", group, "uvit", "uvit_cifar10",
               (f"model.alpha_min={alpha}", "model.zero_init=true", f"optim.ema_decay={UVIT_EMA_DECAY}",
                *evaluation), seed,
               (f"B.decisive.s{seed}", "B.decisive", "decisive"), needs=(FD_CLASSIFIER_ARM,),
               paper=UVIT_PAPER[alpha], labels={"alpha_min": alpha}, stage="decisive", epochs=UVIT_DECISIVE_EPOCHS)


def _classify_decisive_arm(arch, mode, seed, pilot=False, head_dropout=True, long=False):
    """A C arm of timm's recipe; ``head_dropout=False``: without the preset's dropout 0.1 before the classifier
    (timm's ``--drop`` default is 0); ``long``: twice timm's length."""
    prefix = "C224" if pilot else "C600" if long else "C300" if head_dropout else "C300d0"
    group = f"{prefix}-{arch}-{mode}"
    paper = ((f"CIFAR-10 {arch} top-1", RDP_PAPER[(arch, mode)]),) if (arch, mode) in RDP_PAPER else ()
    if pilot:
        tags = ("C.pilot224", "decisive")
    elif long:
        tags = (f"C.long.s{seed}", "C.long", "decisive")
    elif not head_dropout:
        tags = (f"C.d0.s{seed}", "C.d0", "decisive")
    elif mode in READINGS:
        tags = (f"{READINGS[mode]}.s{seed}", READINGS[mode], "decisive")
    else:
        tags = (f"C.timm.{arch}.s{seed}", f"C.timm.{arch}", "C.timm", "decisive")
    overrides = ((f"model.droppath_mode={mode}",) + (() if arch == "resnet50d" else (f"model.arch={arch}",))
                 + (() if head_dropout else ("model.drop_rate=0",)))
    return Arm(f"{group}-s{seed}", "C", group, "classify", TIMM_PRESET_224 if pilot else TIMM_PRESET, overrides,
               seed, tags, paper=paper, labels={"arch": arch, "mode": mode, "px": 224 if pilot else 32,
                                                "drop_rate": 0.1 if head_dropout else 0.0},
               stage="decisive",
               epochs=RDP_PILOT_EPOCHS if pilot else RDP_LONG_EPOCHS if long else RDP_DECISIVE_EPOCHS)


def build_matrix() -> list[Arm]:
    """Every arm, in priority order (what a budget should buy first comes first)."""
    arms = [_mae_arm(v, a, 0, "A.2x2") for v in ("baseline", "official") for a in (1.0, 0.6)]
    arms += [_classify_arm("resnet50d", m, 0) for m in MODES]
    arms += [_mae_arm("official", a, 0, "A.sweep") for a in (0.5, 0.7, 0.8)]
    arms += [_mae_arm("baseline", 1.0, 1, "A.seeds"), _mae_arm("official", 0.6, 1, "A.seeds")]
    arms += [_classify_arm("vit", m, 0) for m in MODES]
    arms += [_uvit_arm(a, 0) for a in (1.0, 0.7)]
    arms += [_classify_arm("resnet50d", m, 1) for m in MODES]
    arms += [_classify_arm("resnet50", m, 0) for m in MODES]
    # the decisive runs, in the order a budget should buy them (an arm with a record is skipped): what decides
    # claim A first (its seed pairs, then the alpha sweep), then B's seeds, then C's open questions
    arms += [_mae_decisive_arm("official", a, 0, "A.decisive.s0", "true") for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("baseline", a, 0, "A.decisive.s0", "auto") for a in (1.0, 0.6)]
    arms += [_mae_decisive_arm("official", a, 1, "A.decisive.s1", "true") for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("official", a, s, f"A.decisive.s{s}", "true") for s in (2, 3) for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("official", a, 0, "A.decisive.sweep", "true") for a in (0.5, 0.7, 0.8)]
    arms += [_mae_decisive_arm("baseline", 1.0, 0, "A.decisive.zi", "true")]  # the skips without the init change
    arms += [_classify_decisive_arm("resnet50d", m, s) for s in RDP_SEEDS for m in MODES]
    arms += [_classify_decisive_arm("resnet50d", m, 0, pilot=True) for m in MODES]
    arms += [_uvit_decisive_arm(a, s) for s in (0, 1, 2) for a in (1.0, 0.7)]
    arms += [_classify_decisive_arm("resnet50d", m, s, head_dropout=False) for s in RDP_SEEDS for m in MODES]
    arms += [_classify_decisive_arm("resnet50d", reading, s) for reading in READINGS for s in RDP_SEEDS]
    # the test of the underfit's reading: both the standard arm and ResidualDroppath at twice the length
    arms += [_classify_decisive_arm("resnet50d", m, s, long=True)
             for s in RDP_SEEDS for m in ("none", "residual_droppath")]
    # claim A at other lengths, the cheapest first: does the gap grow, hold or reverse with the schedule?
    arms += [_mae_decisive_arm("official", a, s, f"A.length.e{e}", "true", epochs=e)
             for e in MAE_LENGTHS for s in MAE_LENGTH_SEEDS for a in (0.6, 1.0)]
    arms += [_classify_decisive_arm("resnet50", m, 0) for m in MODES]
    return arms


MATRIX = build_matrix()
BY_NAME = {a.name: a for a in MATRIX}


def _named(word: str, arm: Arm) -> bool:
    return word in ("all", arm.name, arm.group, arm.claim) or word in arm.tags


def select(spec: str, matrix=MATRIX) -> list[Arm]:
    """Arms named by a comma list of arm names, group names, tags (``A.2x2``, ``C.resnet50d.s0``),
    claims (``A``) or ``all``, in matrix order; the arms they need are added before them."""
    want: set[str] = set()
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        hits = [a.name for a in matrix if _named(word, a)]
        if not hits:
            raise ValueError(f"--run: no arm, group, tag or claim named {word!r} (see --list)")
        want.update(hits)
    by_name = {a.name: a for a in matrix}
    for name in list(want):
        want.update(by_name[name].needs)
    return [a for a in matrix if a.name in want]


def select_epochs(spec: str, default: float, matrix=MATRIX) -> list[tuple[Arm, float, bool]]:
    """``select`` with a length per word: ``"C.resnet50d.s1@100,A.sweep@50,B.short"`` trains the ResNet arms
    for 100 epochs, the sweep for 50 and B's short arms for ``default``, as ``(arm, epochs, named)``. A word
    without ``@EPOCHS`` gives an arm its own length (``Arm.epochs``, the decisive runs' recipe) or else
    ``default``; an arm another needs (``named`` False) gets that one's length unless it is named itself.
    One queue, so several GPUs stay busy however the lengths differ."""
    named: dict[str, float] = {}
    implied: dict[str, float] = {}
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        word, _, length = word.partition("@")
        given = parse_epochs(length, f"--run {word}@") if length else None
        for arm in select(word, matrix):
            epochs = given if given is not None else (arm.epochs or default)
            if _named(word, arm):
                if epochs <= 0:
                    raise ValueError(f"--epochs: give a positive --epochs or {word}@EPOCHS (every arm of a claim "
                                     "the same)")
                if named.get(arm.name, epochs) != epochs:
                    raise ValueError(f"--run: {arm.name} is given {named[arm.name]:g} and {epochs:g} epochs")
                named[arm.name] = epochs
            else:  # 0: only its record's length can rebuild it (run_arms)
                implied.setdefault(arm.name, epochs)
    lengths = {**implied, **named}
    return [(a, lengths[a.name], a.name in named) for a in matrix if a.name in lengths]


def parse_epochs(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number of epochs") from None
