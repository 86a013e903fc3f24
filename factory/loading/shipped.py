"""Shipped YAML by name: presets (``blueprints/``) and data recipes (``data_recipes/``).

A bare name ('nano') means the shipped file unless a file of that name exists
in the working directory; anything with a YAML suffix or a path separator is a
path. A folder that happens to share the name (say build output in ./ultra)
does not shadow the shipped file.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from factory.errors import BlueprintError, Diagnostic, did_you_mean

__all__ = ["resolve_named_yaml", "shipped_dir", "shipped_names"]


def shipped_dir(package: str) -> Path:
    return Path(importlib.import_module(package).__file__).parent  # type: ignore[arg-type]


def shipped_names(package: str) -> list[str]:
    return sorted(p.stem for p in shipped_dir(package).glob("*.yaml"))


def resolve_named_yaml(name_or_path: str | Path, package: str, kind: str) -> Path:
    """The shipped ``package/NAME.yaml`` for a bare name, else the path as given."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file() or len(candidate.parts) > 1:
        return candidate
    shipped = shipped_dir(package) / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = shipped_names(package)
    hint = did_you_mean(str(name_or_path), names)
    message = f"no {kind} or file named {str(name_or_path)!r}{hint}; {kind}s: {', '.join(names)}"
    raise BlueprintError([Diagnostic("", message, str(name_or_path), 0)])
