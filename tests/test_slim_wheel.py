"""benchmarks.slim_wheel: nvImageCodec's wheel cut to one interpreter's binding and the JPEG extensions, its RECORD
matching what it holds, written over the wheel when asked to."""

import subprocess
import sys
import zipfile

import pytest

from benchmarks.slim_wheel import slim

NAME = "nvidia_nvimgcodec_cu13-0.9.0.20-py3-none-manylinux_2_28_x86_64.whl"
FILES = [
    "nvidia/nvimgcodec/__init__.py",
    "nvidia/nvimgcodec/libnvimgcodec.so.0",
    "nvidia/nvimgcodec/nvimgcodec_impl.cpython-311-x86_64-linux-gnu.so",
    "nvidia/nvimgcodec/nvimgcodec_impl.cpython-312-x86_64-linux-gnu.so",
    "nvidia/nvimgcodec/nvimgcodec_impl.cpython-313t-x86_64-linux-gnu.so",
    "nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.0.9.0",
    "nvidia/nvimgcodec/extensions/libjpeg_turbo_ext.so.0.9.0",
    "nvidia/nvimgcodec/extensions/libnvjpeg2k_ext.so.0.9.0",
    "nvidia/nvimgcodec/extensions/libopencv_ext.so.0.9.0",
    "nvidia/nvimgcodec/extensions/libtiff_ext.so.0.9.0",
    "nvidia/nvimgcodec/include/nvimgcodec.h",
    "nvidia_nvimgcodec_cu13-0.9.0.20.dist-info/METADATA",
]
RECORD = "nvidia_nvimgcodec_cu13-0.9.0.20.dist-info/RECORD"


def make_wheel(folder):
    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / NAME, "w") as z:
        for i, name in enumerate(FILES):
            z.writestr(name, f"contents {i}")
        z.writestr(RECORD, "".join(f"{n},sha256=x{i},10\n" for i, n in enumerate(FILES)) + f"{RECORD},,\n")
    return folder / NAME


@pytest.mark.parametrize("python, binding", [("312", "cpython-312"), ("313t", "cpython-313t")])
def test_keeps_one_binding_and_the_jpeg_extensions_with_a_record_of_them(tmp_path, python, binding):
    out = slim(make_wheel(tmp_path / "in"), tmp_path / "out", python)
    assert out == tmp_path / "out" / NAME
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = [line.split(",")[0] for line in z.read(RECORD).decode().splitlines()]
        assert z.read("nvidia/nvimgcodec/libnvimgcodec.so.0") == b"contents 1"
    bindings = {n for n in names if ".cpython-" in n}
    assert bindings == {f"nvidia/nvimgcodec/nvimgcodec_impl.{binding}-x86_64-linux-gnu.so"}
    extensions = {n.rsplit("/", 1)[1] for n in names if "/extensions/" in n}
    assert extensions == {"libnvjpeg_ext.so.0.9.0", "libjpeg_turbo_ext.so.0.9.0"}
    assert {"nvidia/nvimgcodec/__init__.py", "nvidia/nvimgcodec/include/nvimgcodec.h", RECORD} <= names
    assert sorted(record) == sorted(names)


def test_written_over_the_wheel_in_its_own_folder(tmp_path):
    wheel = make_wheel(tmp_path)
    before = wheel.stat().st_size
    assert slim(wheel, tmp_path, "312") == wheel
    assert wheel.stat().st_size < before and [p.name for p in tmp_path.iterdir()] == [NAME]
    assert wheel.stat().st_mode & 0o777 == 0o644


def test_a_python_without_a_binding_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no binding for Python 3.9"):
        slim(make_wheel(tmp_path / "in"), tmp_path / "out", "39")
    assert not (tmp_path / "out" / NAME).exists()


@pytest.mark.parametrize("args, message", [
    (["--python", "312"], "--python must look like 3.12"),
    (["--python", "3.12"], "wheel: no such file"),
])
def test_the_command_names_a_bad_argument_in_one_line(tmp_path, args, message):
    wheel = str(tmp_path / NAME) if "3.12" in args else str(make_wheel(tmp_path))
    run = subprocess.run([sys.executable, "-m", "benchmarks.slim_wheel", wheel, *args, "--out", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr.strip().splitlines()[-1]
