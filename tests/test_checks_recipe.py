"""Rules between a blueprint (or a program's stage) and the recipe it names: the recipe
type-checks, its tokenizer fits ``model.vocab_size``, it packs to the stage's sequence
length, and what the stage trains on it in epochs; and the memory rule's hint for a long
sequence without context parallelism. Bad input is refused at validate with
``file:line: dotted.path: message``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from blueprint_factory import assert_fires, findings, make
from test_program import THREE_STAGES, line_of, program_document, write

from factory.checks import PROGRAM_RULES
from factory.checks.data_rules import stated_tokens
from factory.checks.validate import load
from factory.errors import BlueprintError
from factory.loading.recipe import DEFAULT_TOKENIZER, tokenizer_vocab_size
from factory.schemas.data_recipe import DataRecipe
from factory.schemas.program import resolve_program

REPO = Path(__file__).resolve().parents[1]


def _tokenizer(path: Path, ids: int, unigram: bool = False) -> Path:
    """A tokenizer.json whose largest id is ``ids - 1`` (one added token holds it)."""
    if unigram:
        model: dict[str, Any] = {"type": "Unigram", "vocab": [[f"t{i}", -1.0] for i in range(ids)]}
        added = []
    else:
        model = {"type": "BPE", "vocab": {f"t{i}": i for i in range(ids - 1)}, "merges": []}
        added = [{"id": ids - 1, "content": "<|endoftext|>", "special": True}]
    path.write_text(json.dumps({"version": "1.0", "added_tokens": added, "model": model}))
    return path


def _recipe(folder: Path, name: str = "tiny", **fields: Any) -> Path:
    """A recipe file (its source need not exist: validate reads no data)."""
    source = {"name": "web", "path": "web.jsonl", "category": "pretrain_text", "weight": 1.0}
    document = {"name": name, "sources": [{**source, "steps": [{"kind": "text"}]}], **fields}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _errors(path: Path) -> list[str]:
    with pytest.raises(BlueprintError) as caught:
        load(path)
    return [d.format() for d in caught.value.errors]


def _warnings(path: Path, rule: str, about: str = "") -> list[str]:
    """``rule``'s warnings, those whose message holds ``about``."""
    return [d.format() for d in load(path).warnings if d.rule == rule and about in d.message]


# -- the tokenizer fits model.vocab_size ------------------------------------------------------


def test_the_tokenizer_size_is_read_as_json_like_tokenizers_reads_it(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    shipped = tokenizers.Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    assert tokenizer_vocab_size(DEFAULT_TOKENIZER) == shipped.get_vocab_size() == 4096
    assert tokenizer_vocab_size(_tokenizer(tmp_path / "u.json", 300, unigram=True)) == 300
    assert tokenizer_vocab_size(_tokenizer(tmp_path / "b.json", 300)) == 300


def test_the_shipped_tokenizer_fits_the_base_and_not_a_smaller_vocab() -> None:
    assert findings("data.tokenizer_vocab", make()) == []
    assert_fires(
        "data.tokenizer_vocab", make(**{"model.vocab_size": 1024}), "model.vocab_size",
        "1,024", "4,096", "'nano'",
    )  # fmt: skip


def test_the_recipe_tokenizer_is_found_beside_the_recipe(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tok.json", 5000)
    recipe = _recipe(tmp_path, tokenizer={"path": "tok.json"})
    bp = make(**{"data.recipe": str(recipe)})
    assert_fires("data.tokenizer_vocab", bp, "model.vocab_size", "5,000", "tok.json")
    assert findings("data.tokenizer_vocab", make(**{"data.recipe": str(recipe),
                                                    "model.vocab_size": 5000})) == []  # fmt: skip


def test_a_tokenizer_too_large_is_refused_at_validate_with_its_line(tmp_path: Path) -> None:
    document = program_document(None)
    document["model"]["vocab_size"] = 2048
    path = write(tmp_path, document)
    (error,) = [e for e in _errors(path) if "[data.tokenizer_vocab]" in e]
    assert error.startswith(f"{path}:{line_of(path, 'vocab_size: 2048')}: model.vocab_size: ")
    assert "vocab_size (2,048) is smaller than the 4,096 ids" in error


def test_a_stage_whose_recipe_has_a_larger_tokenizer_is_refused_naming_it(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tok.json", 8000)
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["data"]["recipe"] = str(_recipe(tmp_path, "chat", tokenizer={"path": "tok.json"}))
    path = write(tmp_path, program_document(stages))
    (error,) = [e for e in _errors(path) if "[data.tokenizer_vocab]" in e]
    assert ": model.vocab_size: stage 'sft': vocab_size (4,096) is smaller than the 8,000" in error


# -- the recipe loads -------------------------------------------------------------------------


def test_a_recipe_that_does_not_type_check_is_refused_where_the_blueprint_names_it(
    tmp_path: Path,
) -> None:
    recipe = _recipe(tmp_path, packing={"seq_lenght": 1024})
    document = program_document(None)
    document["data"]["recipe"] = str(recipe)
    path = write(tmp_path, document)
    (error,) = [e for e in _errors(path) if "[data.recipe_valid]" in e]
    assert error.startswith(f"{path}:{line_of(path, 'tiny.yaml')}: data.recipe: ")
    assert "tiny.yaml:" in error and "packing.seq_lenght" in error


# -- the recipe packs to the stage's sequence length -----------------------------------------


def test_a_stage_recipe_packing_to_another_length_is_a_warning_at_the_stage(
    tmp_path: Path,
) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    recipe = _recipe(tmp_path, "chat", packing={"seq_len": 4096})
    stages[2]["data"]["recipe"] = str(recipe)
    path = write(tmp_path, program_document(stages))
    # the first two stages train at 1024 on shipped recipes, which pack to 4096: warned too
    (warning,) = _warnings(path, "stages.recipe_seq_len", "stage 'sft'")
    where = f"{path}:{line_of(path, 'chat.yaml')}: stages[2].data.recipe: warning: stage 'sft': "
    assert warning.startswith(where)
    assert f"packs to 4,096 tokens ({recipe}:" in warning
    assert "the build packs the stage's data at 2,048" in warning


def test_a_stage_recipe_at_the_stage_length_or_silent_on_it_passes(tmp_path: Path) -> None:
    for packing in ({"seq_len": 2048}, {"window": 64}):
        stages = copy.deepcopy(THREE_STAGES)
        stages[2]["data"]["recipe"] = str(_recipe(tmp_path, "chat", packing=packing))
        path = write(tmp_path, program_document(stages))
        assert _warnings(path, "stages.recipe_seq_len", "stage 'sft'") == []


def test_a_blueprint_without_stages_packs_at_its_own_length_as_before(tmp_path: Path) -> None:
    """The shipped recipes pack to 4096 and the presets train at 8192: the blueprint decides."""
    document = program_document(None)
    document["data"]["recipe"] = str(_recipe(tmp_path, packing={"seq_len": 4096}))
    assert _warnings(write(tmp_path, document), "stages.recipe_seq_len") == []


# -- epochs over the curated mixture ---------------------------------------------------------


def test_the_tokens_a_recipe_states() -> None:
    source = {"path": "x.jsonl", "category": "pretrain_text", "steps": [{"kind": "text"}]}

    def recipe(total: int | None, *shares: dict[str, Any]) -> DataRecipe:
        sources = [{**source, "name": f"s{i}", **share} for i, share in enumerate(shares)]
        return DataRecipe.model_validate({"name": "r", "total_tokens": total, "sources": sources})

    assert stated_tokens(recipe(1000, {"weight": 1}, {"weight": 3})) == 1000
    assert stated_tokens(recipe(1000, {"weight": 1}, {"tokens": 500})) == 1500
    assert stated_tokens(recipe(None, {"tokens": 200}, {"tokens": 500})) == 700
    assert stated_tokens(recipe(None, {"weight": 1}, {"tokens": 500})) is None  # after curation


def _epochs(bp: Any) -> list[tuple[int, Any]]:
    return list(PROGRAM_RULES["data.recipe_epochs"].check(resolve_program(bp)))


def test_training_past_the_recipe_tokens_warns_with_the_epochs(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, total_tokens=1_000_000)
    (found,) = _epochs(make(**{"data.recipe": str(recipe)}))  # 100 steps of 16 x 1024 tokens
    index, finding = found
    assert index == 0 and finding.path == "data.recipe" and finding.severity == "warning"
    assert finding.message.startswith("1.64 epochs over the curated mixture: 100 steps of 16,384")
    assert (
        "1,638,400 tokens from it and recipe" in finding.message and "1,000,000" in finding.message
    )
    enough = make(**{"data.recipe": str(_recipe(tmp_path, "big", total_tokens=2_000_000))})
    assert _epochs(enough) == []
    assert _epochs(make()) == []  # the shipped recipe states no total


def test_a_stage_repeating_its_data_warns_at_the_stage(tmp_path: Path) -> None:
    stages = copy.deepcopy(THREE_STAGES)
    stages[2]["data"]["recipe"] = str(_recipe(tmp_path, "chat", total_tokens=100_000))
    path = write(tmp_path, program_document(stages))
    (warning,) = _warnings(path, "data.recipe_epochs")
    # 30 steps of 8 sequences of 2048 tokens
    assert "stages[2].data.recipe: warning: stage 'sft': 4.92 epochs over the curated" in warning


def test_a_stage_reading_on_counts_what_the_stage_before_read(tmp_path: Path) -> None:
    """Phase 2 carries phase 1's data position: 60 + 40 steps of 16 x 1024 tokens together
    read 1,638,400 tokens of a 1,000,000-token mixture; phase 1 alone reads 983,040."""
    stages = copy.deepcopy(THREE_STAGES)
    recipe = str(_recipe(tmp_path, total_tokens=1_000_000))
    stages[0]["data"] = {"recipe": recipe}
    del stages[1]["data"]
    stages[1]["carry"] = {"data_position": True}
    path = write(tmp_path, program_document(stages))
    (warning,) = _warnings(path, "data.recipe_epochs")
    assert "stage 'phase2': 1.64 epochs over the curated mixture: 40 steps of 16,384" in warning
    assert "after 983,040 read by the stages before read 1,638,400 tokens" in warning


# -- a long sequence without context parallelism ---------------------------------------------


def test_a_long_context_stage_without_cp_does_not_fit_and_cp_is_named(tmp_path: Path) -> None:
    """Nano at 512k tokens on one CP rank: the activations do not fit, CP=8 does (as Nano's
    published long-context layout, CP=8)."""
    document = {
        "extends": str(REPO / "blueprints" / "nano.yaml"),
        "model": {"max_seq_len": 524288},
        "stages": [
            {"name": "phase1"},
            {
                "name": "long_context",
                "data": {"seq_len": 524288},
                "parallelism": {"world_size": 256, "global_batch_size": 64},
            },
        ],
    }
    path = tmp_path / "nano_long.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    (warning,) = _warnings(path, "memory.fits_gpu")
    assert f"{path}:{line_of(path, 'world_size: 256')}: stages[1].parallelism.world_size" in warning
    assert "stage 'long_context'" in warning and "524,288 tokens" in warning
    assert "parallelism.cp=8 brings the peak rank to" in warning
