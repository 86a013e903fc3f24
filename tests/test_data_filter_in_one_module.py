"""A new data filter is one module: this one.

It declares a filter step ``max_chars`` as a maintainer would: its recipe section
(what ``schemas/data_recipe.py`` would gain: the section, and its entry in the
recipe's step union, here by extending the union of ``FORMAT_STEPS`` and
``FILTER_STEPS`` in subclasses of ``SourceConfig`` and ``DataRecipe``) and its
check, registered with the decorator every module in
``factory/data/steps/filters/`` uses. Editing nothing in factory, a recipe that
names the step builds, on two worker processes, and the manifest counts what it
dropped. ``docs/architecture.md`` ("A new data filter step") points here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal, Union

import pytest
from pydantic import Field

import factory.data
from factory.data.loaded_recipe import LoadedRecipe, load_recipe
from factory.data.steps.filter_registry import register_filter
from factory.data.steps.filters import FILTERS
from factory.data.steps.records import Document, RawRecord
from factory.errors import BlueprintError
from factory.loading.yaml_source import read_yaml
from factory.schemas.base import Section
from factory.schemas.data_recipe import FILTER_STEPS, FORMAT_STEPS, DataRecipe, SourceConfig

REPO = Path(__file__).resolve().parent.parent
WEB = REPO / "data_recipes" / "samples" / "pretrain_text.jsonl"
MAX_CHARS = 3000


class MaxCharsFilter(Section):
    """Documents of at most ``max_chars`` characters."""

    kind: Literal["max_chars"] = "max_chars"
    max_chars: Annotated[int, Field(ge=1, le=10**9)] = 100_000
    """Longest document kept, in characters (1..1e9)."""


def too_long_reason(record: RawRecord, doc: Document, params: MaxCharsFilter) -> str | None:
    return "too_long" if len(doc.text) > params.max_chars else None


# The schema entry: the step union with one more section, as FILTER_STEPS would gain it.
Step = Annotated[
    Union[(*FORMAT_STEPS, *FILTER_STEPS, MaxCharsFilter)],
    Field(discriminator="kind"),
]


class MaxCharsSource(SourceConfig):
    steps: list[Step] = Field(min_length=1, max_length=64)  # type: ignore[assignment]


class MaxCharsRecipe(DataRecipe):
    sources: list[MaxCharsSource] = Field(min_length=1, max_length=10_000)  # type: ignore[assignment]


@pytest.fixture
def max_chars() -> Iterator[None]:
    """The filter registered as its module would register it at import, for this test only
    (the shipped registry must hold exactly the shipped steps elsewhere)."""
    register_filter(MaxCharsFilter)(too_long_reason)
    yield
    del FILTERS["max_chars"]


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: max_chars\n"
        "sources:\n"
        "  - name: web\n"
        f"    path: {WEB}\n"
        "    category: pretrain_text\n"
        "    weight: 1\n"
        f"    steps: [{{kind: text}}, {{kind: max_chars, max_chars: {MAX_CHARS}}}]\n"
        "packing: {seq_len: 256, window: 64}\n"
        "output: {samples_per_shard: 64}\n"
    )
    return path


def test_a_filter_declared_in_one_module_runs_in_a_build(max_chars: None, tmp_path: Path) -> None:
    path = _recipe(tmp_path)
    data, source_map = read_yaml(path)
    loaded = LoadedRecipe(MaxCharsRecipe.model_validate(data), path, source_map)
    manifest = factory.data.build(loaded, tmp_path / "out", workers=2)

    texts = [json.loads(line)["text"] for line in WEB.read_text().splitlines() if line.strip()]
    too_long = sum(len(text) > MAX_CHARS for text in texts)
    assert 0 < too_long < len(texts)  # the sample corpus has documents on both sides
    web = manifest["sources"]["web"]
    assert web["steps"]["max_chars"] == {
        "documents_in": len(texts),
        "documents_out": len(texts) - too_long,
        "tokens_in": None,
        "tokens_out": None,
    }
    assert web["dropped"]["max_chars:too_long"] == too_long
    assert web["steps"]["tokenize"]["documents_in"] == len(texts) - too_long


def test_without_its_schema_entry_the_kind_is_refused(max_chars: None, tmp_path: Path) -> None:
    with pytest.raises(BlueprintError) as info:
        load_recipe(_recipe(tmp_path))
    [problem] = info.value.diagnostics
    assert problem.path == "sources[0].steps[1]"
    assert "'max_chars'" in problem.message
