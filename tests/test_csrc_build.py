"""The CUDA extension (csrc/) compiles on a machine without a GPU: CI builds it for sm_80 and sm_90
into a temporary folder (the checkout is not touched; about 25-45 s of nvcc on two cores) and loads
it in a fresh process as ``dres._C`` to run test_csrc.py's CPU tests there, what can be checked without
a device: the four ops are registered with the Triton ops' schemas, their fake kernels and C++ autograd
give the reference's shapes, dtypes and gradients (meta tensors), and their argument checks raise
errors that name the argument.

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

# The built library as dres._C (what `import dres._C` would load from an install), then the CPU tests of
# test_csrc.py that need it: schemas, fake kernels, the C++ autograd on meta tensors, argument checks.
RUN_CPU_TESTS_WITH = textwrap.dedent("""
    import importlib.util, sys
    import torch  # loads libc10 and libtorch, which the library links against
    import dres
    spec = importlib.util.spec_from_file_location("dres._C", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["dres._C"] = dres._C = module
    import pytest
    sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "-m", "not gpu", "tests/test_csrc.py"]))
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
    check = subprocess.run([sys.executable, "-c", RUN_CPU_TESTS_WITH, str(libs[0])], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "not built" not in check.stdout, check.stdout[-3000:]  # the tests that need the library ran
