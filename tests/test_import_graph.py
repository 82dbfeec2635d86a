"""The import graph of the installed package (dres, with kernels/ as dres.kernels and train/ as
dres.train) has no circle, counting the imports inside functions too: a module imports only modules
that do not import it back, directly or through others."""

import ast
from pathlib import Path

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
