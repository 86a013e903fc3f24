"""Per-source epochs: a source's target is N passes over its curated tokens (SFT's dynamic sampling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import factory.data
from factory.data.loaded_recipe import load_recipe
from factory.data.samples import generate
from factory.data.stages.mixing import plan_mixture, repeats
from factory.errors import BlueprintError
from factory.schemas.data_recipe import DataRecipe

HEAD = "name: r\nsources:\n  - name: a\n    path: x.jsonl\n    category: math\n"
CHAT = "    steps: [{kind: chat}]\n"


def _errors(tmp_path: Path, body: str) -> list[str]:
    (tmp_path / "x.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(body)
    with pytest.raises(BlueprintError) as info:
        load_recipe(path)
    return [d.format() for d in info.value.diagnostics]


@pytest.mark.parametrize(
    ("share", "message"),
    [
        (
            "    weight: 1\n    epochs: 2\n",
            "r.yaml:3: sources[0]: give exactly one of weight, tokens and epochs "
            "(weight and epochs given)",
        ),
        (
            "    tokens: 1M\n    epochs: 2\n",
            "r.yaml:3: sources[0]: give exactly one of weight, tokens and epochs "
            "(tokens and epochs given)",
        ),
        ("", "r.yaml:3: sources[0]: give exactly one of weight, tokens and epochs (none given)"),
        ("    epochs: 0\n", "r.yaml:6: sources[0].epochs: "),
        ("    epochs: -1.5\n", "r.yaml:6: sources[0].epochs: "),
        ("    epochs: 1e7\n", "r.yaml:6: sources[0].epochs: "),
    ],
)
def test_a_source_states_exactly_one_share_and_epochs_are_positive(
    tmp_path: Path, share: str, message: str
) -> None:
    errors = _errors(tmp_path, HEAD + share + CHAT)
    assert len(errors) == 1 and errors[0].startswith(f"{tmp_path}/{message}"), errors


def _recipe(shares: dict[str, dict[str, float]], total_tokens: int | None = None) -> DataRecipe:
    sources = [
        {"name": name, "path": "x", "category": "math", "steps": [{"kind": "chat"}], **share}
        for name, share in shares.items()
    ]
    return DataRecipe.model_validate(
        {"name": "r", "sources": sources, "total_tokens": total_tokens}
    )


def test_epochs_set_the_target_from_the_source_alone() -> None:
    recipe = _recipe(
        {
            "once": {"epochs": 1},
            "thrice": {"epochs": 3},
            "half": {"epochs": 0.5},
            "web": {"weight": 1},
        }
    )
    available = {"once": 1_000, "thrice": 777, "half": 20_000, "web": 5_000}
    plans = plan_mixture(recipe, available)
    assert {name: plan.target_tokens for name, plan in plans.items()} == {
        "once": 1_000,
        "thrice": 2_331,
        "half": 10_000,
        "web": 5_000,  # the weighted pool is the weighted sources' tokens only
    }
    assert plans["once"].ratio == 1.0 and plans["thrice"].ratio == 3.0
    assert plans["half"].ratio == 0.5


def test_epochs_sources_stay_outside_the_weighted_pool() -> None:
    recipe = _recipe({"web": {"weight": 3}, "code": {"weight": 1}, "chat": {"epochs": 2}}, 8_000)
    plans = plan_mixture(recipe, {"web": 1_000, "code": 1_000, "chat": 500})
    assert [plans[n].target_tokens for n in ("web", "code", "chat")] == [6_000, 2_000, 1_000]


def test_total_tokens_without_a_weighted_source_is_refused(tmp_path: Path) -> None:
    errors = _errors(tmp_path, HEAD + "    epochs: 2\n" + CHAT + "total_tokens: 1M\n")
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{tmp_path}/r.yaml:8: total_tokens: the weighted sources share ")


def test_repeat_counts_for_one_three_and_half_an_epoch() -> None:
    keys = [f"doc-{i}" for i in range(4_000)]
    assert {repeats(1.0, 7, key) for key in keys} == {1}
    assert {repeats(3.0, 7, key) for key in keys} == {3}
    halves = [repeats(0.5, 7, key) for key in keys]
    assert set(halves) == {0, 1}
    assert 0.47 < sum(halves) / len(keys) < 0.53
    # the draw is the document's own: the same key gets the same count under another order
    assert [repeats(0.5, 7, key) for key in reversed(keys)] == halves[::-1]


def _jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def epochs_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("epochs")
    _jsonl(root / "in/chat.jsonl", list(generate("conversational", 40, 1)))
    _jsonl(root / "in/stem.jsonl", list(generate("stem_synthetic", 80, 2)))
    recipe = {
        "name": "epochs",
        "seed": 5,
        "sources": [
            {
                "name": "small",
                "path": "in/chat.jsonl",
                "category": "conversational",
                "epochs": 3,
                "steps": [{"kind": "chat"}],
            },
            {
                "name": "large",
                "path": "in/stem.jsonl",
                "category": "stem_synthetic",
                "epochs": 0.5,
                "steps": [{"kind": "chat"}],
            },
        ],
        "dedup": {"minhash": False},
        "packing": {"seq_len": 256, "window": 64},
        "output": {"samples_per_shard": 32, "energon": False},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return root / "recipe.yaml"


def _published(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.parts
    }


def test_a_build_with_two_sources_at_different_epochs(epochs_recipe: Path, tmp_path: Path) -> None:
    one = factory.data.build(epochs_recipe, tmp_path / "w1", workers=1)
    small, large = one["sources"]["small"], one["sources"]["large"]
    assert small["mix"]["declared"] == {"epochs": 3.0}
    assert large["mix"]["declared"] == {"epochs": 0.5}
    assert small["mix"]["target_tokens"] == 3 * small["mix"]["available_tokens"]
    assert small["mix"]["sampling"] == "up" and large["mix"]["sampling"] == "down"
    # three whole passes exactly; half a pass within a few documents of half
    assert small["after"]["documents"] == 3 * small["steps"]["dedup"]["documents_out"]
    assert small["after"]["tokens"] == 3 * small["mix"]["available_tokens"]
    kept = large["after"]["tokens"] / large["mix"]["available_tokens"]
    assert 0.3 < kept < 0.7, kept
    two = factory.data.build(epochs_recipe, tmp_path / "w2", workers=2)
    assert two == one
    assert _published(tmp_path / "w2") == _published(tmp_path / "w1")
