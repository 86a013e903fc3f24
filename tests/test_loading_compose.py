"""Composition: fragments, overrides, interpolation, and the public load API."""

from __future__ import annotations

import pytest
from conftest import PRESETS

import factory


def test_presets_compose_from_fragments() -> None:
    nano = factory.load_blueprint("nano")
    # from base/nemotron_h.yaml, base/nemotron3_moe.yaml and nano.yaml respectively
    assert nano.model.mamba.state_size == 128
    assert nano.model.moe.router.aux_loss_coeff == 1e-4
    assert nano.model.moe.router.scaling_factor == 2.5


def test_interpolation_resolves_after_overrides(write_yaml) -> None:
    path = write_yaml(f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  tokens: ${{data.tokens}}\n")
    assert factory.load_blueprint(path).training.tokens == 25 * 10**12
    bp = factory.load_blueprint(path, overrides=["data.tokens=1T"])
    assert bp.training.tokens == 10**12


def test_training_length_defaults_to_one_pass_over_the_data() -> None:
    bp = factory.load_blueprint("nano", ["data.tokens=1T"])
    assert bp.training.tokens is None and bp.training.steps is None
    assert bp.training_tokens == 10**12
    assert bp.training_steps == 10**12 // (3072 * 8192)


def test_overrides_apply_in_order() -> None:
    bp = factory.load_blueprint("nano", ["parallelism.tp=2", "parallelism.tp=8"])
    assert bp.parallelism.tp == 8


def test_blueprint_is_frozen() -> None:
    from pydantic import ValidationError

    bp = factory.load_blueprint("nano")
    with pytest.raises(ValidationError):
        bp.model.hidden_size = 1  # type: ignore[misc]


def test_path_and_name_load_the_same_blueprint() -> None:
    assert factory.load_blueprint(PRESETS / "super.yaml") == factory.load_blueprint("super")


def test_error_carries_every_diagnostic() -> None:
    with pytest.raises(factory.BlueprintError) as info:
        factory.load_blueprint("nano", ["model.hidden_size=0", "parallelism.pp=0"])
    paths = {d.path for d in info.value.errors}
    assert {"model.hidden_size", "parallelism.pp"} <= paths


def test_token_counts_accept_suffixes() -> None:
    assert factory.load_blueprint("ultra").data.tokens == 20 * 10**12
    assert factory.load_blueprint("nano", ["data.tokens=1.5B"]).data.tokens == 1_500_000_000
    with pytest.raises(factory.BlueprintError, match=r"data\.tokens"):
        factory.load_blueprint("nano", ["data.tokens=1.5X"])


def test_resolved_blueprint_round_trips(tmp_path) -> None:
    import yaml

    bp = factory.load_blueprint("super")
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(bp.model_dump(mode="json")), encoding="utf-8")
    assert factory.load_blueprint(path) == bp


def test_a_folder_named_like_a_preset_does_not_shadow_it(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nano").mkdir()
    assert factory.load_blueprint("nano").meta.name == "nano"


@pytest.mark.parametrize("parent", ["/", "..", "a\x00b"])
def test_an_impossible_fragment_path_is_an_error(write_yaml, parent: str) -> None:
    path = write_yaml(f"extends: {parent!r}\n".replace("'", '"'))
    with pytest.raises(
        factory.BlueprintError, match=r"extends: (not a file path|fragment not found)"
    ):
        factory.load_blueprint(path)


def test_an_empty_extends_extends_nothing(write_yaml) -> None:
    path = write_yaml("extends:\nmeta:\n  name: x\n")
    with pytest.raises(factory.BlueprintError) as info:
        factory.load_blueprint(path)
    assert all("extends" not in d.path for d in info.value.errors)


def test_extends_chains_are_bounded(write_yaml) -> None:
    for i in range(20):
        write_yaml(f"extends: f{i + 1}.yaml\n", f"f{i}.yaml")
    write_yaml("meta:\n  name: x\n", "f20.yaml")
    with pytest.raises(factory.BlueprintError, match="extends chain longer than 16 files"):
        factory.load_blueprint(write_yaml("extends: f0.yaml\n"))


def test_a_missing_field_is_reported_in_the_file_named(write_yaml) -> None:
    fragment = write_yaml("model:\n  hidden_size: 64\n", "fragment.yaml")
    path = write_yaml(f"extends: {fragment.name}\nmeta:\n  name: x\n")
    with pytest.raises(factory.BlueprintError) as info:
        factory.load_blueprint(path)
    where = {d.path: (d.file, d.line) for d in info.value.errors}
    assert where["model.pattern"] == (str(path), 1)  # the fragment wrote 'model:', not this file
    assert where["parallelism"] == (str(path), 1)


def test_overrides_that_yaml_cannot_read_are_located() -> None:
    for item in ("model.hidden_size==", "a=" + "[" * 3000 + "]" * 3000):
        with pytest.raises(factory.BlueprintError, match="bad override"):
            factory.load_blueprint("nano", [item])
