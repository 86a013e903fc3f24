"""JSON Schema for blueprints and data recipes, so editors can complete and check YAML as it is typed.

Two files: ``blueprint.schema.json`` for complete blueprints, and
``fragment.schema.json`` for the shared fragments under ``blueprints/base``,
which set only some fields and so must not demand the required ones.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from factory.io import atomic_write_text
from factory.schemas.blueprint import Blueprint
from factory.schemas.data_recipe import DataRecipe

__all__ = ["described_schema", "render_schemas", "write_schemas"]

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


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """``field: docstring`` for the string literal right under each annotated field of ``cls``.

    Read here, when a schema is written, rather than by pydantic's
    ``use_attribute_docstrings`` when every model class is defined: parsing the
    source of each class costs ``factory validate`` an eighth of its time.
    """
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    out = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = inspect.cleandoc(after.value.value)
    return out


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model class reachable from ``root``'s fields, by name (as in ``$defs``)."""
    found: dict[str, type[BaseModel]] = {}
    stack: list[Any] = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if found.setdefault(item.__name__, item) is not item:
                continue
            for klass in item.__mro__:
                if klass is not item and issubclass(klass, BaseModel) and klass is not BaseModel:
                    stack.append(klass)
            stack.extend(f.annotation for f in item.model_fields.values())
        else:
            stack.extend(getattr(item, "__args__", ()))
            stack.extend(getattr(item, "__metadata__", ()))
    return found


def _described(schema: dict[str, Any], root: type[BaseModel]) -> dict[str, Any]:
    """``schema`` with each property's attribute docstring as its description."""
    models = _models(root)

    def docs(name: str) -> dict[str, str]:
        merged: dict[str, str] = {}
        for klass in reversed(models[name].__mro__):  # a subclass's docstring wins
            if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
                merged.update(_attribute_docstrings(klass))
        return merged

    for name, node in [(root.__name__, schema), *schema.get("$defs", {}).items()]:
        if name in models:
            for field, doc in docs(name).items():
                prop = node.get("properties", {}).get(field)
                if prop is not None:
                    prop.setdefault("description", doc)
    return schema


def described_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON Schema with every field's attribute docstring as its description."""
    return _described(model.model_json_schema(), model)


def render_schemas() -> dict[str, str]:
    """File name -> JSON text, deterministic (sorted keys, trailing newline)."""
    schema = described_schema(Blueprint)
    schema["properties"]["extends"] = _EXTENDS
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "factory blueprint"
    schema = _allow_interpolation(schema)
    fragment = _without_required(copy.deepcopy(schema))
    fragment["title"] = "factory blueprint fragment"
    recipe = described_schema(DataRecipe)
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
