"""The wheel: built from the package's sources without a setuptools warning, it carries the license,
the authors, classifiers and every training preset; it requires torch and triton alone (the trainers' packages
are the ``[train]`` extra, which ``[dev]`` holds) and installs the ``dres-export`` command."""

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
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    presets = {f"dres/train/presets/{p.name}" for p in (ROOT / "train" / "presets").glob("*.yaml")}
    assert presets and presets <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata and "Author: dres developers" in metadata
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert sorted(r for r in required if "extra ==" not in r) == ["torch>=2.6", "triton>=3.2; platform_system == \"Linux\""]
    assert any(r.startswith("pyyaml") and 'extra == "train"' in r for r in required)
    assert any(r.startswith("dres[all]") and 'extra == "dev"' in r for r in required)
    assert any(r.startswith("dres[") and "train" in r.split("]")[0] and 'extra == "all"' in r for r in required)
    assert "Classifier: Intended Audience :: Science/Research" in metadata
    assert "dres-export = dres.train.export:main" in entry_points
