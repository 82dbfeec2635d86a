"""The CUDA extension (csrc/) compiles on a machine without a GPU: CI builds it for sm_80 and sm_90
into a temporary folder (the checkout is not touched; about 25-45 s of nvcc on two cores) and loads
it in a fresh process to check what can be checked without a device: the four ops are registered
with the Triton ops' schemas, and their argument checks raise errors that name the argument.

Skipped where there is no nvcc, torch is a CPU-only build, or nvcc's CUDA major version differs
from torch's (the extension cannot be built there; ``DRES_BUILD_CUDA=1`` would say so)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

def _why_not_buildable() -> str | None:
    """Why this machine cannot build the extension, or None. torch refuses an nvcc whose major
    version differs from the CUDA torch was built with: that is the machine's setup, not a bug."""
    nvcc = shutil.which("nvcc")
    if torch.version.cuda is None or nvcc is None:
        return "needs nvcc and a CUDA build of torch"
    found = re.search(r"release (\d+)\.", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    if found and found.group(1) != torch.version.cuda.split(".")[0]:
        return f"nvcc is CUDA {found.group(1)}.x but torch was built with CUDA {torch.version.cuda}"
    return None


WHY_NOT_BUILDABLE = _why_not_buildable()  # once: it runs nvcc
pytestmark = pytest.mark.skipif(WHY_NOT_BUILDABLE is not None, reason=str(WHY_NOT_BUILDABLE))

CHECK_LOADED = textwrap.dedent("""
    import sys, torch
    sys.modules["dres._C"] = None  # an installed or in-tree build would register dres_cuda a second time (abort)
    torch.ops.load_library(sys.argv[1])
    import dres.ops.residual_norm  # registers the dres:: Triton ops
    for name in ("residual_layer_norm", "residual_add", "layer_norm", "residual_norm_backward"):
        ours = str(getattr(torch.ops.dres_cuda, name).default._schema).split("::", 1)[1]
        theirs = str(getattr(torch.ops.dres, name).default._schema).split("::", 1)[1]
        assert ours == theirs, (name, ours, theirs)
    x = torch.randn(2, 3, 64)
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.CUDA):
        try:
            torch.ops.dres_cuda.layer_norm.default(x, None, None, 1e-6, None)
        except RuntimeError as e:
            assert "x must be a CUDA tensor" in str(e), str(e)
        else:
            raise AssertionError("a CPU tensor reached the CUDA kernel without an error")
        for eps in (0.0, -1e-6, float("nan")):
            try:
                torch.ops.dres_cuda.layer_norm.default(x, None, None, eps, None)
            except RuntimeError as e:
                assert "eps must be a positive finite float" in str(e), str(e)
            else:
                raise AssertionError(f"eps={eps} reached the CUDA kernel without an error")
    print("extension ok")
""")


def test_extension_builds_for_sm80_and_sm90_and_registers_the_ops(tmp_path):
    env = {**os.environ, "DRES_BUILD_CUDA": "1", "DRES_CUDA_ARCHS": "80;90", "MAX_JOBS": "2"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    libs = list((tmp_path / "lib" / "dres").glob("_C*.so"))
    assert len(libs) == 1, list((tmp_path / "lib").rglob("*"))
    objdump = shutil.which("cuobjdump")
    if objdump:  # both targets are in the fat binary
        archs = subprocess.run([objdump, "--list-elf", str(libs[0])], capture_output=True, text=True).stdout
        assert "sm_80" in archs and "sm_90" in archs, archs
    check = subprocess.run([sys.executable, "-c", CHECK_LOADED, str(libs[0])], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0 and "extension ok" in check.stdout, check.stdout + check.stderr[-3000:]
