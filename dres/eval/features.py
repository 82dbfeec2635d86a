"""Frozen features kept for rescoring, and the scoring of several feature kinds at once.

A run's final evaluation can keep the features it scored (``eval.save_features``): float16, every kind
(``cls``, ``mean``, ``stream_mean``), both splits, with their labels, in ``<run>/features.pt``. A copy
of a class-balanced part of them (:func:`balanced_subset`) is small enough to travel with a record, so
another protocol can score the same encoder later without retraining it (``experiments.repro --rescore``).
Files are read with ``weights_only=True``: tensors and plain values only.
"""

from __future__ import annotations

import torch

from dres.eval.curves import representation_metrics

FEATURES_FILE = "features.pt"


def features_state(train: dict, train_labels, test: dict, test_labels, **meta) -> dict:
    """What a features file holds: ``{"train": {kind: (N, D) float16}, "train_labels", "test": ...,
    "test_labels", "meta"}`` (``torch.save`` it; the trainer writes it atomically)."""
    return {"train": {k: v.detach().to("cpu", torch.float16) for k, v in train.items()},
            "train_labels": train_labels.detach().cpu().long(),
            "test": {k: v.detach().to("cpu", torch.float16) for k, v in test.items()},
            "test_labels": test_labels.detach().cpu().long(), "meta": dict(meta)}


def load_features(path) -> dict:
    """A features file of :func:`save_features`; a file of another shape is a one-line ValueError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or one holding more than tensors and plain values
        raise ValueError(f"{path}: not a features file ({type(e).__name__})") from None
    if not (isinstance(state, dict) and {"train", "train_labels", "test", "test_labels"} <= set(state)
            and set(state["train"]) == set(state["test"]) and state["train"]):
        raise ValueError(f"{path}: not a features file (train / test features of the same kinds, with labels)")
    return state


def balanced_subset(labels: torch.Tensor, per_class: int) -> torch.Tensor:
    """Indices of the first ``per_class`` samples of every class, in split order."""
    keep = torch.zeros(len(labels), dtype=torch.bool)
    for c in labels.unique():
        keep[(labels == c).nonzero().flatten()[:per_class]] = True
    return keep.nonzero().flatten()


def subset_features(state: dict, per_class: int) -> dict:
    """``state`` with ``per_class`` samples of every class in each split (:func:`balanced_subset`)."""
    out = {"meta": {**state.get("meta", {}), "per_class": per_class}}
    for split in ("train", "test"):
        idx = balanced_subset(state[f"{split}_labels"], per_class)
        out[split] = {k: v[idx] for k, v in state[split].items()}
        out[f"{split}_labels"] = state[f"{split}_labels"][idx]
    return out


def score_feature_kinds(train: dict, train_y, test: dict, test_y, *, primary: str, rank_features=None,
                        rank: bool = True, **protocol) -> dict:
    """:func:`dres.eval.representation_metrics` of every feature kind in ``train`` / ``test``: the
    ``primary`` kind's metrics unprefixed, the others' prefixed ``<kind>_``; the effective rank (eq. 6) once,
    of ``rank_features`` (the class tokens; default ``train["cls"]``, else the primary kind). ``protocol``:
    representation_metrics' probe and kNN settings."""
    if rank_features is None:
        rank_features = train.get("cls", train[primary])
    res = {}
    for kind in [primary] + [k for k in train if k != primary]:
        metrics = representation_metrics(train[kind], train_y, test[kind], test_y, rank_features=rank_features,
                                          rank=rank and kind == primary, **protocol)
        res.update({(k if kind == primary else f"{kind}_{k}"): v for k, v in metrics.items()})
    return res
