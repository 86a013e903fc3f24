"""Compose a blueprint from fragments, then apply ``key=value`` overrides.

A file may name the fragments it builds on::

    extends: [base/nemotron_h.yaml, base/nemotron3_moe.yaml]

Paths are relative to the file. Fragments merge left to right, the file
itself last (OmegaConf semantics: mappings merge deeply, lists are replaced),
then the command line's ``--set a.b=v`` overrides. OmegaConf interpolation
(``${model.hidden_size}``) resolves after everything is merged, so a
fragment may refer to values that only a preset sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.paths import join_path
from factory.loading.yaml_source import read_yaml

__all__ = ["OVERRIDE_FILE", "compose"]

EXTENDS = "extends"
OVERRIDE_FILE = "--set"


def _display(path: Path) -> str:
    """Paths relative to the working directory when possible: shorter, and clickable."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _load_tree(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], SourceMap]:
    """One file merged over everything it extends (depth first)."""
    display = _display(path)
    data, source_map = read_yaml(path, display)
    if not isinstance(data, dict):
        raise BlueprintError(
            [Diagnostic("", "a blueprint must be a mapping of sections", display, 1)]
        )
    parents = data.pop(EXTENDS, [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise BlueprintError([source_map.diagnostic(EXTENDS, "must be a path or a list of paths")])
    merged: dict[str, Any] = {}
    merged_map = SourceMap(display)
    for index, parent in enumerate(parents):
        parent_path = (path.parent / parent).resolve()
        if parent_path.suffix not in (".yaml", ".yml"):
            parent_path = parent_path.with_suffix(".yaml")
        where = join_path(EXTENDS, index) if len(parents) > 1 else EXTENDS
        if parent_path in chain:
            raise BlueprintError([source_map.diagnostic(where, f"circular extends: {parent!r}")])
        if not parent_path.is_file():
            raise BlueprintError([source_map.diagnostic(where, f"fragment not found: {parent!r}")])
        parent_data, parent_map = _load_tree(parent_path, (*chain, parent_path))
        merged = _merge(merged, parent_data)
        merged_map.update(parent_map)
    merged_map.update(source_map)
    return _merge(merged, data), merged_map


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """OmegaConf's merge semantics on plain data: mappings merge deeply, anything else replaces.

    Done by hand because OmegaConf.merge builds and copies node trees, which
    made merging most of ``factory validate``'s run time; OmegaConf still
    parses overrides and resolves interpolation.
    """
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _apply_overrides(data: dict[str, Any], source_map: SourceMap, overrides: Sequence[str]) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.create(data)
    for index, item in enumerate(overrides, start=1):
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise BlueprintError(
                [Diagnostic("", f"override {item!r} is not key=value", OVERRIDE_FILE, index)]
            )
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise BlueprintError(
                [Diagnostic(key, f"bad override: {exc}", OVERRIDE_FILE, index)]
            ) from None
        source_map.record(key.strip(), OVERRIDE_FILE, index)
    return cfg  # type: ignore[return-value]


def _has_interpolation(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def compose(path: Path, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], SourceMap]:
    """Load ``path`` with its fragments and overrides; resolve interpolations."""
    path = path.resolve()
    data, source_map = _load_tree(path, (path,))
    if not overrides and not _has_interpolation(data):
        return data, source_map  # nothing for OmegaConf to do: skip importing it
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = _apply_overrides(data, source_map, overrides)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        message = str(exc).splitlines()[0]
        raise BlueprintError(
            [source_map.diagnostic(key, f"interpolation failed: {message}")]
        ) from None
    return resolved, source_map  # type: ignore[return-value]
