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

import yaml

from factory.deep_merge import deep_merge
from factory.dotted_paths import join_path, path_from_loc
from factory.errors import BlueprintError, Diagnostic, SourceMap
from factory.loading.yaml_source import (
    MERGE_KEYS_IN_A_BLUEPRINT,
    display_path,
    first_line,
    read_yaml,
)

__all__ = ["OVERRIDE_FILE", "compose"]

EXTENDS = "extends"
OVERRIDE_FILE = "--set"
MAX_EXTENDS_DEPTH = 16
"""Longest chain of fragments extending fragments; presets use 2."""


def _load_tree(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], SourceMap]:
    """One file merged over everything it extends (depth first)."""
    display = display_path(path)
    data, source_map = read_yaml(path, display, MERGE_KEYS_IN_A_BLUEPRINT)
    if not isinstance(data, dict):
        raise BlueprintError(
            [Diagnostic("", "a blueprint must be a mapping of sections", display, 1)]
        )
    parents = data.pop(EXTENDS, None)
    if parents is None:  # absent, or an empty 'extends:' line
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise BlueprintError([source_map.diagnostic(EXTENDS, "must be a path or a list of paths")])
    merged: dict[str, Any] = {}
    merged_map = SourceMap(display)
    for index, parent in enumerate(parents):
        where = join_path(EXTENDS, index) if len(parents) > 1 else EXTENDS
        parent_path = _fragment_path(path, parent)
        if parent_path is None:
            raise BlueprintError([source_map.diagnostic(where, f"not a file path: {parent!r}")])
        if len(chain) > MAX_EXTENDS_DEPTH:
            message = f"extends chain longer than {MAX_EXTENDS_DEPTH} files"
            raise BlueprintError([source_map.diagnostic(where, message)])
        if parent_path in chain:
            raise BlueprintError([source_map.diagnostic(where, f"circular extends: {parent!r}")])
        if not parent_path.is_file():
            raise BlueprintError([source_map.diagnostic(where, f"fragment not found: {parent!r}")])
        parent_data, parent_map = _load_tree(parent_path, (*chain, parent_path))
        merged = deep_merge(merged, parent_data)
        merged_map.update(parent_map)
    merged_map.update(source_map)
    return deep_merge(merged, data), merged_map


def _fragment_path(path: Path, parent: str) -> Path | None:
    """The fragment ``parent`` names, relative to ``path``; None when it cannot be a file."""
    try:
        parent_path = (path.parent / parent).resolve()
        if parent_path.suffix not in (".yaml", ".yml"):
            parent_path = parent_path.with_suffix(".yaml")  # ValueError for '/' and '..'
        return parent_path
    except (OSError, ValueError, RuntimeError):  # NUL bytes, symlink loops
        return None


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
        return data, source_map  # nothing for OmegaConf to do
    return _override_and_resolve(data, source_map, overrides), source_map


def _dotted_parts(key: str) -> list[str | int]:
    """``stages.2.data.seq_len`` or ``stages[2].data.seq_len`` as keys and list indices."""
    parts: list[str | int] = []
    for part in key.strip().replace("[", ".").replace("]", "").split("."):
        parts.append(int(part) if part.isdigit() else part)
    return parts


def _apply_override(cfg: Any, item: str) -> Any:
    """``cfg`` with ``key=value`` applied. A key through a list (``stages.2.data.seq_len``)
    cannot be merged as a dotlist (OmegaConf would merge a mapping into the list), so it is
    set in place, its value parsed as a dotlist value is."""
    from omegaconf import OmegaConf

    key, _, value = item.partition("=")
    if not any(isinstance(part, int) for part in _dotted_parts(key)):
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    parsed = OmegaConf.from_dotlist([f"value={value}"])["value"]
    OmegaConf.update(cfg, key.strip(), parsed, merge=True)
    return cfg


def _override_and_resolve(
    data: dict[str, Any], source_map: SourceMap, overrides: Sequence[str]
) -> dict[str, Any]:
    """``overrides`` applied, then every interpolation resolved, by OmegaConf.

    Imported here: no preset interpolates, and importing OmegaConf (with attrs and its ANTLR
    parser) was a sixth of ``factory validate``'s time.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    # OmegaConf parses override values with PyYAML ('a==' is a YAMLError); ValueError: an
    # integer too long to convert; RecursionError: '[[[...]]]' 3000 deep in an override.
    errors = (OmegaConfBaseException, yaml.YAMLError, ValueError, RecursionError)
    cfg = OmegaConf.create(data)
    for index, item in enumerate(overrides, start=1):
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise BlueprintError(
                [Diagnostic("", f"override {item!r} is not key=value", OVERRIDE_FILE, index)]
            )
        try:
            cfg = _apply_override(cfg, item)
        except errors as exc:
            message = f"bad override: {first_line(exc)}"
            where = path_from_loc(_dotted_parts(key))
            raise BlueprintError([Diagnostic(where, message, OVERRIDE_FILE, index)]) from None
        # Sections the override creates are its too: a finding on them points here.
        parts = _dotted_parts(key)
        for end in range(1, len(parts)):
            if path_from_loc(parts[:end]) not in source_map:
                source_map.record(path_from_loc(parts[:end]), OVERRIDE_FILE, index)
        source_map.record(path_from_loc(parts), OVERRIDE_FILE, index)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except errors as exc:
        key = str(getattr(exc, "full_key", "") or "")
        message = first_line(exc)
        raise BlueprintError(
            [source_map.diagnostic(key, f"interpolation failed: {message}")]
        ) from None
    return resolved  # type: ignore[return-value]
