"""JSON Schema for blueprints and data recipes, so editors can complete and check YAML as it is typed.

Two files: ``blueprint.schema.json`` for complete blueprints, and
``fragment.schema.json`` for the shared fragments under ``blueprints/base``,
which set only some fields and so must not demand the required ones.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from factory.io import atomic_write_text
from factory.schemas.blueprint import Blueprint
from factory.schemas.data_recipe import DataRecipe

__all__ = ["render_schemas", "write_schemas"]

_EXTENDS = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    "description": "Fragments this file builds on, relative to it; merged left to right.",
}


_INTERPOLATION = {"type": "string", "pattern": r"^\$\{[^}]+\}$"}


def _or_interpolation(prop: dict[str, Any]) -> dict[str, Any]:
    wrapped: dict[str, Any] = {"anyOf": [prop, _INTERPOLATION]}
    if "description" in prop:  # keep the hover text where editors look first
        wrapped["description"] = prop["description"]
    return wrapped


def _allow_interpolation(node: Any) -> Any:
    """Let every property also hold an OmegaConf interpolation such as ``${data.tokens}``."""
    if isinstance(node, dict):
        out = {k: _allow_interpolation(v) for k, v in node.items()}
        if isinstance(out.get("properties"), dict):
            out["properties"] = {
                name: _or_interpolation(prop) if name != "extends" else prop
                for name, prop in out["properties"].items()
            }
        return out
    if isinstance(node, list):
        return [_allow_interpolation(v) for v in node]
    return node


def _without_required(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_required(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_without_required(v) for v in node]
    return node


def render_schemas() -> dict[str, str]:
    """File name -> JSON text, deterministic (sorted keys, trailing newline)."""
    schema = Blueprint.model_json_schema()
    schema["properties"]["extends"] = _EXTENDS
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "factory blueprint"
    schema = _allow_interpolation(schema)
    fragment = _without_required(copy.deepcopy(schema))
    fragment["title"] = "factory blueprint fragment"
    recipe = DataRecipe.model_json_schema()
    recipe["$schema"] = schema["$schema"]
    recipe["title"] = "factory data recipe"
    docs = (
        ("blueprint.schema.json", schema),
        ("fragment.schema.json", fragment),
        ("data_recipe.schema.json", recipe),
    )
    return {name: json.dumps(doc, indent=2, sort_keys=True) + "\n" for name, doc in docs}


def write_schemas(out: Path) -> list[Path]:
    written = []
    for name, text in render_schemas().items():
        atomic_write_text(out / name, text)
        written.append(out / name)
    return written
