"""The wheel: built from the package's sources without a setuptools warning, it carries the license,
the authors and every training preset."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (ROOT / "dres").is_dir(), reason="needs the package's sources (this tree tests an installed copy)")
def test_wheel_carries_license_authors_and_presets(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    for folder in ("dres", "kernels", "train"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path / "out"), str(src)],
                           capture_output=True, text=True, timeout=600)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-3000:]
    assert "Warning:" not in log and "SetuptoolsDeprecationWarning" not in log, log[-3000:]
    (wheel,) = (tmp_path / "out").glob("dres-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    presets = {f"dres/train/presets/{p.name}" for p in (ROOT / "train" / "presets").glob("*.yaml")}
    assert presets and presets <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata and "Author: dres developers" in metadata
