"""nvImageCodec's wheel cut to what the GPU decode loads, for a GPU host without network.

    python -m benchmarks.slim_wheel .whl/nvidia_nvimgcodec_cu13-*.whl --python 3.12 --out .whl

The wheel from PyPI carries the Python binding of nine interpreters and the codec extensions of JPEG 2000, TIFF,
BMP, PNM and OpenCV beside the JPEG ones (25 MB). A decode of JPEGs needs one binding and the nvJPEG and
libjpeg-turbo extensions: the slim wheel keeps the library, that binding, those extensions and the rest of the
package's small files (about 5 MB), with its RECORD rewritten to match. It replaces the wheel in place when --out
is the wheel's own folder (the same file name, so pip installs it as the package it is).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import zipfile
from pathlib import Path

JPEG_EXTENSIONS = ("nvjpeg", "jpeg_turbo")


def kept(name: str, python: str, extensions=JPEG_EXTENSIONS) -> bool:
    """Whether a file of the wheel stays: any but another interpreter's binding or a codec extension other than
    ``extensions``. python: the interpreter's tag without the dot (``312``)."""
    binding = re.search(r"\.cpython-(\d+t?)-", name)
    if binding:
        return binding.group(1) == python
    extension = re.search(r"/extensions/lib(\w+?)_ext\.so", name)
    return extension is None or extension.group(1) in extensions


def slim(wheel: Path, out_dir: Path, python: str) -> Path:
    """Write ``out_dir/<wheel's name>`` with the kept files and a RECORD that lists only them; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as source:
        names = [n for n in source.namelist() if kept(n, python)]
        keep = set(names)
        if not any(re.search(rf"\.cpython-{python}-", n) for n in names):
            raise SystemExit(f"{wheel.name} has no binding for Python {python[0]}.{python[1:]}")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed = source.read(record).decode().splitlines()
        # written beside the target first, then moved over it: --out may be the wheel's own folder
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".part", delete=False) as part:
            with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as target:
                for name in names:
                    if name == record:
                        data = "\n".join(line for line in listed if line.split(",")[0] in keep) + "\n"
                        target.writestr(source.getinfo(name), data.encode())
                    else:
                        target.writestr(source.getinfo(name), source.read(name))
    path = out_dir / wheel.name
    Path(part.name).chmod(0o644)  # a temporary file is the owner's alone; a wheel is anyone's to read
    Path(part.name).replace(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the GPU host's interpreter, e.g. 3.12 (default: this one)")
    parser.add_argument("--out", type=Path, required=True, help="the folder the slim wheel goes to")
    a = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+t?", a.python):
        parser.error(f"--python must look like 3.12, got {a.python!r}")
    if not a.wheel.is_file():
        parser.error(f"wheel: no such file {a.wheel}")
    before = a.wheel.stat().st_size
    path = slim(a.wheel, a.out, a.python.replace(".", ""))
    print(f"{path}: {before / 2**20:.1f} -> {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
