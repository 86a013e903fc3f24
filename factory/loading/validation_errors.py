"""Turn pydantic's ValidationError into located, friendly diagnostics.

The one validation step of every YAML document (blueprints and data recipes):
:func:`validate_document` gives the typed document or a ``BlueprintError`` with
one ``file:line: path: message`` per error. A path is the one the YAML writes:
pydantic puts the tag of a discriminated union's member into an error's
location (``sources[0].steps[1].heuristics.min_words``), which no document has,
so it is taken out, and an unknown key in such a member gets a did-you-mean
from that member's own fields.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from factory.dotted_paths import path_from_loc
from factory.errors import BlueprintError, Diagnostic, SourceMap, did_you_mean

__all__ = ["diagnostics_from_validation_error", "fields_at", "validate_document"]

M = TypeVar("M", bound=BaseModel)

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


def _tagged_members(annotation: Any) -> dict[Any, type[BaseModel]]:
    """A discriminated union's members by tag (``Annotated[A | B, Field(discriminator=k)]``);
    empty for any other annotation."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return {}
    union, *metadata = typing.get_args(annotation)
    key = next((m.discriminator for m in metadata if isinstance(m, FieldInfo)), None)
    if not isinstance(key, str):
        return {}
    return {member.model_fields[key].default: member for member in typing.get_args(union)}


def _inner(annotation: Any, key: str | int) -> Any:
    """The annotation of ``key`` inside ``annotation`` (None when it is not a section or a
    container)."""
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(str(key))
        return None if field is None else field.annotation
    if typing.get_origin(annotation) in (dict, list, tuple):
        return typing.get_args(annotation)[-1]
    return None


def _resolve(root: type[BaseModel], loc: Sequence[str | int]) -> tuple[list[str | int], Any]:
    """``loc`` without discriminated-union tags, and the annotation it ends at (None once it
    leaves the sections)."""
    annotation: Any = root
    plain: list[str | int] = []
    for key in loc:
        members = _tagged_members(annotation)
        if key in members:  # the tag pydantic adds: the member it names is the annotation
            annotation = members[key]  # type: ignore[index]
            continue
        plain.append(key)
        annotation = None if annotation is None else _inner(annotation, key)
    return plain, annotation


def fields_at(root: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """Field names of the section at ``loc`` (empty when ``loc`` is not a section)."""
    annotation = _unwrap(_resolve(root, loc)[1])
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
    exc: ValidationError,
    root: type[BaseModel],
    source_map: SourceMap,
    document_path: Callable[[str], str] = str,
) -> list[Diagnostic]:
    """One diagnostic per error; ``document_path`` maps an error's path to where the document
    writes it (a program stage's blueprint is merged from several places)."""
    out: list[Diagnostic] = []
    for error in exc.errors():
        path = document_path(path_from_loc(_resolve(root, error["loc"])[0]))
        message = _message(error, root)
        if error["type"] == "missing":
            file, line = source_map.locate_missing(path)
            out.append(Diagnostic(path=path, message=message, file=file, line=line))
        else:
            out.append(source_map.diagnostic(path, message))
    return out


def validate_document(model: type[M], data: Any, source_map: SourceMap) -> M:
    """``model`` from a document's parsed YAML; on any error, BlueprintError with every error
    located by ``source_map``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BlueprintError(diagnostics_from_validation_error(exc, model, source_map)) from None
