"""Package attributes that import their module on first use (PEP 562 ``__getattr__``).

``import factory`` and ``import factory.data`` must stay light: their public
names live in modules that import pydantic, numpy or torch, so each package
maps names to modules and resolves a name only when it is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_dir", "lazy_getattr"]


def lazy_getattr(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable:
    """A module ``__getattr__`` for ``package``: ``table`` maps a public name to the module
    defining it (the package's own name for a subpackage of that name); the value is cached
    in ``namespace`` (the package's ``globals()``) once read."""

    def __getattr__(name: str) -> Any:
        module_name = table.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module_name == package:
            value = importlib.import_module(f"{package}.{name}")
        else:
            value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(table: dict[str, str], namespace: dict[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__`` listing the package's public API (``table``'s names and
    ``__all__``, before any is first read) and its dunders, without the helpers it imports,
    so that ``dir(package)``, completion and ``help(package)`` show what users may call."""

    def __dir__() -> list[str]:
        public = set(table) | set(namespace.get("__all__", ()))
        return sorted(public | {name for name in namespace if name.startswith("__")})

    return __dir__
