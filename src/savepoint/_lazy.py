"""Lazy public names for a package: each imported from its module the first time it is used, so
importing the package (or one of its modules) loads nothing else. Used by the namespaces of
:mod:`savepoint.runs` and :mod:`savepoint.storage` (see docs/api.md)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(
    namespace: dict[str, Any], lazy: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of the package whose globals are
    ``namespace``: ``lazy`` maps each public name to the module that defines it; a name, once
    imported, is kept in ``namespace`` (the next access is a plain lookup)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(lazy))

    return __getattr__, __dir__
