"""docs/own_model.md runs as written: its Python blocks, in order, in one namespace (each recipe ends
with the check that the fused model computes the original's outputs and gradients)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("timm")
pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own_model.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_page_runs_and_every_recipe_checks(capsys):
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 6
    namespace: dict = {"__name__": "own_model_docs"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE.name}, python block {i + 1}", "exec"), namespace)
    checks = capsys.readouterr().out.count("same outputs and gradients")
    assert checks == 11  # plain pre-LN and post-LN; timm ViT, ResNet, DINOv2 and Eva; HF ViT, BERT, DeiT, DINOv2, GPT-2
