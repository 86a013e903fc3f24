"""Telling a blueprint from a data recipe by its top-level keys."""

from __future__ import annotations

import pytest

from factory.errors import BlueprintError
from factory.loading import documents
from factory.loading.documents import BLUEPRINT, RECIPE, kind_of
from factory.schemas.blueprint import Blueprint


def test_blueprint_fast_path_matches_the_schema() -> None:
    assert {"extends", *Blueprint.model_fields} == documents._BLUEPRINT_ONLY


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"extends": "base/x.yaml"}, BLUEPRINT),
        ({"meta": {}, "model": {}}, BLUEPRINT),
        ({"name": "x", "sources": []}, RECIPE),
        ({"name": "x", "sources": [], "model": {}}, RECIPE),  # 'model' is then an unknown key
        ({"modle": {}, "paralelism": {}}, BLUEPRINT),  # misspelt: the closest schema wins
        ({"sorces": []}, RECIPE),
    ],
)
def test_kind_of(data: dict, kind: str) -> None:
    assert kind_of(data, "f.yaml") == kind


@pytest.mark.parametrize(
    "data", [{}, {"foo": 1}, {"meta": {}, "sources": []}, [1, 2], "text", None]
)
def test_unrecognisable_documents_are_refused(data: object) -> None:
    with pytest.raises(BlueprintError) as info:
        kind_of(data, "f.yaml")
    (diagnostic,) = info.value.diagnostics
    assert diagnostic.file == "f.yaml" and diagnostic.line == 1
    assert "blueprint" in diagnostic.message and "recipe" in diagnostic.message
