"""Dotted paths into nested blueprint data: ``parallelism.tp``, ``meta.sources[0]``,
``precision.overrides['*.mixer.out_proj']``."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["join_path", "parent_path", "path_from_loc"]

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not _PLAIN_KEY.match(key):
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def path_from_loc(loc: Iterable[str | int]) -> str:
    path = ""
    for key in loc:
        path = join_path(path, key)
    return path


def parent_path(path: str) -> str:
    """The enclosing path: 'a.b[0]' -> 'a.b', "a['x.y']" -> 'a', 'a.b' -> 'a', 'a' -> ''."""
    if path.endswith("]"):
        return path[: path.rfind("[")]
    return path.rpartition(".")[0]
