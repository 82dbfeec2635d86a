"""What pyproject.toml cannot express: the top-level ``kernels/`` installs as ``dres.kernels`` and
``train/`` as ``dres.train`` (the project's layout: kernels and trainer apart from the package code), and the optional CUDA
extension. The package's metadata, dependencies and extras are in pyproject.toml.

The optional CUDA C++ extension ``dres._C`` (``csrc/``, the ``backend="cuda"`` ops) is built only
when asked for:

    DRES_BUILD_CUDA=1     build it; fail, saying why, when it cannot be built
    DRES_BUILD_CUDA=auto  build it when torch is a CUDA build and nvcc is found, else skip (saying why)
    unset / 0             pure-Python install (the default)

It is off by default because the default ``pip install -e ".[dev]"`` runs in an isolated build
environment without torch (so nothing could be detected there anyway), and because one build of
the kernels for sm_80 + sm_90 takes minutes of nvcc time, which would otherwise be paid on every
reinstall on machines that happen to have a toolkit (CI, the GPU machines). See csrc/README.md.

DRES_CUDA_ARCHS (default "80;90") picks the targets, e.g. "90" alone while iterating.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

packages = ["dres"] + [f"dres.{p}" for p in find_packages("dres")]
packages += ["dres.kernels"] + [f"dres.kernels.{p}" for p in find_packages("kernels")]
packages += ["dres.train"] + [f"dres.train.{p}" for p in find_packages("train")]
packages += ["dres.train.presets"]  # the YAML presets: a data folder, which setuptools asks to list as a package


def _build_mode() -> str:
    mode = os.environ.get("DRES_BUILD_CUDA", "0").strip().lower()
    if mode in ("", "0", "false", "no", "off"):
        return "off"
    if mode in ("1", "true", "yes", "on"):
        return "on"
    if mode == "auto":
        return "auto"
    raise SystemExit(f"DRES_BUILD_CUDA={mode!r}: expected 1, 0 or auto")


def _find_cuda_home() -> None:
    """Point CUDA_HOME at a real toolkit before torch.utils.cpp_extension reads it.

    torch derives CUDA_HOME from ``which nvcc``; where nvcc on PATH is a wrapper script (as
    /usr/local/bin/nvcc on the CI machine) that gives /usr/local, which has no CUDA headers, and
    the C++ compile then fails on cuda_runtime_api.h. Prefer a directory that has both.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
                os.path.join(home, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = home
            return


def _why_not_buildable():
    """None when the extension can be built here, else the reason."""
    _find_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        return (f"torch is not importable in the build environment ({e}); install torch first and build "
                "with --no-build-isolation")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    for rel in ("bin/nvcc", "include/cuda_runtime_api.h"):
        if not os.path.exists(os.path.join(cpp_extension.CUDA_HOME, rel)):
            return f"CUDA_HOME={cpp_extension.CUDA_HOME} has no {rel} (set CUDA_HOME to the toolkit)"
    return None


def _gencode_flags() -> list:
    archs = os.environ.get("DRES_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
    flags = []
    for arch in filter(None, (a.strip() for a in archs)):
        if not arch.isdigit():
            raise SystemExit(f"DRES_CUDA_ARCHS: {arch!r} is not a compute capability like 80 or 90")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def cuda_extension_kwargs() -> dict:
    """ext_modules/cmdclass for setup(): empty unless DRES_BUILD_CUDA asks for the extension."""
    mode = _build_mode()
    if mode == "off":
        return {}
    reason = _why_not_buildable()
    if reason is not None:
        if mode == "on":
            raise SystemExit(f"DRES_BUILD_CUDA=1 but the CUDA extension dres._C cannot be built: {reason}")
        print(f"dres: DRES_BUILD_CUDA=auto: not building the CUDA extension ({reason})", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu")))
    if not sources:
        raise SystemExit(f"DRES_BUILD_CUDA: no csrc/*.cpp or csrc/*.cu under {ROOT}")
    ext = CUDAExtension(
        name="dres._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={
            # No -std flag: torch's build adds the standard its headers need (C++17 for older
            # torch, C++20 for newer).
            "cxx": ["-O3"],
            # Explicit -gencode flags: torch then adds no arch flags of its own.
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + _gencode_flags(),
        },
    )
    # ninja (when installed) compiles the .cpp and the .cu in parallel, up to MAX_JOBS.
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


# Everything else (name, version, dependencies, extras, scripts) is in pyproject.toml's [project].
setup(
    packages=packages,
    package_dir={"dres": "dres", "dres.kernels": "kernels", "dres.train": "train"},
    package_data={"dres": ["py.typed"], "dres.train.presets": ["*.yaml"]},
    **cuda_extension_kwargs(),
)
