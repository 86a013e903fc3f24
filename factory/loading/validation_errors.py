"""Turn pydantic's ValidationError into located, friendly diagnostics."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from factory.dotted_paths import path_from_loc
from factory.errors import Diagnostic, SourceMap, did_you_mean

__all__ = ["diagnostics_from_validation_error", "fields_at"]

_SHOWN_CHARS = 80


def _unwrap(annotation: Any) -> Any:
    """Strip Optional/Annotated layers down to the type that carries the fields."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            models = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = models[0] if len(models) == 1 else annotation
            if len(models) != 1:
                return annotation
        else:
            return annotation


def fields_at(root: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """Field names of the section at ``loc`` (empty when ``loc`` is not a section)."""
    annotation: Any = root
    for key in loc:
        annotation = _unwrap(annotation)
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(key))
            if field is None:
                return []
            annotation = field.annotation
        elif origin in (dict, list, tuple):
            annotation = typing.get_args(annotation)[-1]
        else:
            return []
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _message(error: Any, root: type[BaseModel]) -> str:
    kind = error["type"]
    loc = error["loc"]
    if kind == "extra_forbidden":
        return "unknown key" + did_you_mean(str(loc[-1]), fields_at(root, loc[:-1]))
    if kind == "missing":
        return "required field is missing"
    message = error["msg"]
    if kind == "value_error":
        return message.removeprefix("Value error, ")
    value = error.get("input")
    if isinstance(value, (str, int, float, bool)) or value is None:
        message += f" (got {_shown(value)})"
    return message


def _shown(value: str | int | float | bool | None) -> str:
    """A value as the user wrote it, cut short: a 400-digit width is not worth printing."""
    if isinstance(value, int) and value.bit_length() > 100:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"an integer of about {digits} digits"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def diagnostics_from_validation_error(
    exc: ValidationError, root: type[BaseModel], source_map: SourceMap
) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    for error in exc.errors():
        path = path_from_loc(error["loc"])
        message = _message(error, root)
        if error["type"] == "missing":
            file, line = source_map.locate_missing(path)
            out.append(Diagnostic(path=path, message=message, file=file, line=line))
        else:
            out.append(source_map.diagnostic(path, message))
    return out
