"""The presets' per-stage recipes: every shipped recipe validates, and each stage's recipe builds
at a proxy sequence length with the mixture it declares (SFT ones all chat, with loss masks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.data.loaded_recipe import load_recipe
from factory.loading.recipe import recipe_names
from factory.schemas.data_recipe import DataRecipe

PRESETS = ("nano", "super", "ultra")
STAGE_KINDS = ("phase1", "phase2", "long_context", "sft")
"""The recipes each preset's program names (issue 37): pretraining phase 1 and 2, long-context
extension, SFT; super also ships super_sft_budget, its budget-control SFT."""
STAGE_RECIPES = sorted(
    name for name in recipe_names() if name.startswith(tuple(f"{p}_" for p in PRESETS))
)
PROXY_SEQ_LEN = 256


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates(name: str) -> None:
    assert isinstance(load_recipe(name).recipe, DataRecipe)


def test_every_preset_has_a_recipe_per_stage() -> None:
    missing = [
        f"{preset}_{kind}"
        for preset in PRESETS
        for kind in STAGE_KINDS
        if f"{preset}_{kind}" not in STAGE_RECIPES
    ]
    assert not missing


def _is_sft(name: str) -> bool:
    return "_sft" in name


def _weighted_shares(recipe: DataRecipe) -> dict[str, float]:
    total = sum(s.weight or 0.0 for s in recipe.sources)
    return {s.name: s.weight / total for s in recipe.sources if s.weight is not None}


@pytest.mark.parametrize("name", STAGE_RECIPES)
def test_stage_recipe_builds_at_a_proxy_sequence_length(name: str, tmp_path: Path, cli) -> None:
    recipe = load_recipe(name).recipe
    out = tmp_path / "data"
    status, _, err = cli("data", "build", name, "--out", str(out), "--seq-len", str(PROXY_SEQ_LEN))
    assert status == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    packing = manifest["packing"]
    assert packing["seq_len"] == PROXY_SEQ_LEN and packing["samples"] > 0
    sources = manifest["sources"]
    assert set(sources) == {s.name for s in recipe.sources}
    empty = [n for n, s in sources.items() if s["after"]["tokens"] == 0]
    assert not empty, f"sources curated to nothing: {empty}"
    if _is_sft(name):
        # only chat sources: the loss follows the roles, so part of every sample is masked
        assert {s.steps[0].kind for s in recipe.sources} == {"chat"}
        assert 0 < packing["loss_tokens"] < packing["tokens"]
    # the weighted sources land near their declared shares of the weighted tokens (whole
    # documents are kept or dropped, so a source of a few long documents is off by a few points)
    shares = _weighted_shares(recipe)
    weighted_tokens = sum(sources[n]["after"]["tokens"] for n in shares)
    for source_name, share in shares.items():
        realised = sources[source_name]["after"]["tokens"] / weighted_tokens
        assert abs(realised - share) < 0.05, (source_name, realised, share)
    for source in recipe.sources:
        if source.epochs is not None:
            mix = sources[source.name]["mix"]
            assert mix["declared"] == {"epochs": source.epochs}
            assert mix["target_tokens"] == round(source.epochs * mix["available_tokens"])
