"""How one YAML document is laid over another: fragments under a blueprint, a stage over the
stage before it."""

from __future__ import annotations

from typing import Any

__all__ = ["deep_merge"]


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """OmegaConf's merge semantics on plain data: mappings merge deeply, anything else replaces.

    Done by hand because OmegaConf.merge builds and copies node trees, which
    made merging most of ``factory validate``'s run time; OmegaConf still
    parses overrides and resolves interpolation.
    """
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
