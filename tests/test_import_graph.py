"""The import graph of the installed package (dres, with kernels/ as dres.kernels and train/ as
dres.train) has no circle, counting the imports inside functions too: a module imports only modules
that do not import it back, directly or through others."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dres

ROOT = Path(__file__).resolve().parent.parent
# the source tree; a tree without dres/ tests an installed copy, which holds kernels/ and train/ inside the package
PACKAGE_DIRS = ({"dres": ROOT / "dres", "dres.kernels": ROOT / "kernels", "dres.train": ROOT / "train"}
                if (ROOT / "dres").is_dir() else {"dres": Path(dres.__file__).resolve().parent})


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package,) + parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that a module imports anywhere in its body: ``from a import b`` imports
    the module ``a.b`` where there is one, else ``a`` (relative imports resolved; ``kernels`` is
    ``dres.kernels``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] == "kernels":
                base = "dres." + base
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {("dres." + n if n.split(".")[0] == "kernels" else n) for n in found} & modules - {name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "dres.models.classifier" in graph["dres.convert"]  # imported inside a function
    assert "dres.kernels.utils" in graph["dres.kernels.residual_norm"]  # from .utils import ...
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_imports_have_no_circle():
    assert circles(import_graph()) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_config_sits_below_the_tasks():
    """The tasks read the config (their checks of it among them); the config reads no task, nor the registry."""
    graph = import_graph()
    tasks = {"dres.train.tasks", "dres.train.mae", "dres.train.uvit", "dres.train.classify"}
    assert not reachable(graph, "dres.train.config") & tasks
    assert "dres.train.config" in reachable(graph, "dres.train.mae")


def _fresh_python(code: str, tmp_path, missing=()) -> str:
    """``code``'s stdout in a fresh interpreter where each package of ``missing`` fails to import as if it were
    not installed (a stub that raises, found before the real one)."""
    for package in missing:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('{package} is not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_a_converter_imports_neither_torch_compile_nor_triton(tmp_path):
    out = _fresh_python(
        "import sys\n"
        "from dres import convert_timm_vit, convert_timm_resnet, convert_hf_vit, convert_hf_bert\n"
        "import dres.nn, dres.models, dres.export\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'"
        " or m.startswith(('torch._dynamo', 'torch._inductor'))))\n", tmp_path)
    assert out.strip() == "[]"


def test_the_models_and_converters_need_none_of_the_train_extra(tmp_path):
    """What ``pip install dres`` installs (torch, triton) runs the converters and the models; the trainers'
    packages (the ``[train]`` extra) are imported by none of them."""
    train_extra = ("yaml", "tqdm", "PIL", "sklearn", "scipy")
    out = _fresh_python(
        "import sys, torch\n"
        "import dres.models, dres.export\n"
        "from dres import convert_timm_vit\n"
        "model = dres.models.ViTClassifier(img_size=8, patch_size=4, embed_dim=32, depth=2, num_heads=2, drop_path=0.1, "
        "num_classes=3)\n"
        "print(tuple(model(torch.randn(2, 3, 8, 8)).shape))\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {train_extra!r}))\n", tmp_path, train_extra)
    assert out.split("\n")[:2] == ["(2, 3)", "[]"]


def test_dir_and_all_list_the_public_names_each_of_which_resolves():
    public = {"convert_timm_vit", "convert_timm_resnet", "convert_hf_vit", "convert_hf_bert", "compile_step",
              "export_model"}
    assert public <= set(dres.__all__) and public <= set(dir(dres))
    assert all(callable(getattr(dres, name)) for name in public)
    with pytest.raises(AttributeError, match=r"^module 'dres' has no attribute 'convert_nothing'$"):
        dres.convert_nothing
