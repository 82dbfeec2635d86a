"""Optional dependencies, the extras of pyproject.toml: a missing one is a one-line error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the ``pip install 'dres[...]'`` that adds it."""


def import_optional(module: str, extra: str, needed_by: str) -> ModuleType:
    """``import module``, or :class:`MissingExtra` saying that ``needed_by`` needs the package of the
    extra ``extra``. A package that is installed but fails to import raises its own error."""
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != package:  # installed, but something it imports is missing
            raise
        raise MissingExtra(f"{needed_by} needs {package}, which is not installed: pip install 'dres[{extra}]'",
                           name=package) from None


def require_extra(modules: tuple[str, ...], extra: str, needed_by: str) -> None:
    """:class:`MissingExtra` for the first of ``modules`` (top-level packages) that is not installed, found without
    importing any of them (their import is left to the code that uses them)."""
    import importlib.util

    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise MissingExtra(f"{needed_by} needs {module}, which is not installed: pip install 'dres[{extra}]'",
                               name=module)
