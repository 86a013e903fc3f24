"""`factory validate`: exit 0 on valid blueprints, 2 with located messages otherwise."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import PRESETS, REPO
from preset_stages import published_warnings

NANO = PRESETS / "nano.yaml"
# A preset's warning in validate's text: its file, the stages it names, its rule.
PRESET_WARNING = re.compile(
    r".*blueprints/(\w+)\.yaml:\d+: \S+: warning: stages? ((?:'\w+'(?:, )?)+): .* \[([\w.]+)\]"
)


def _child(write_yaml, body: str) -> Path:
    """A blueprint that extends the Nano preset and changes what `body` says."""
    return write_yaml(f"extends: {NANO}\n{body}")


def test_every_preset_and_recipe_is_valid(cli) -> None:
    status, out, err = cli("validate")
    assert status == 0, err
    for name in ("nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"):
        assert f"ok: {name}" in out
        assert f"ok: data recipe {name}" in out
    # The warnings are the published layouts' (tests/preset_stages.py), each on its stages.
    warned = set()
    for line in err.splitlines():
        match = PRESET_WARNING.fullmatch(line)
        assert match, line
        preset, stages, rule = match.groups()
        warned |= {(preset, stage.strip("'"), rule) for stage in stages.split(", ")}
    assert warned == published_warnings()


def test_overrides_without_targets_check_the_presets_only(cli) -> None:
    status, out, _ = cli("validate", "--set", "parallelism.tp=2")
    assert status == 0
    assert "ok: nano" in out and "data recipe" not in out


def test_unknown_key_gets_did_you_mean(cli, write_yaml) -> None:
    path = _child(write_yaml, "model:\n  hiden_size: 4096\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:3: model.hiden_size: unknown key (did you mean 'hidden_size'?)" in err
    assert "Traceback" not in err


def test_unknown_nested_key(cli, write_yaml) -> None:
    path = _child(write_yaml, "model:\n  moe:\n    router:\n      scor_function: softmax\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert ":5: model.moe.router.scor_function: unknown key (did you mean 'score_function'?)" in err


def test_wrong_type_names_the_value(cli, write_yaml) -> None:
    path = _child(write_yaml, "parallelism:\n  tp: four\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert ":3: parallelism.tp: Input should be a valid integer" in err
    assert "'four'" in err


def test_missing_required_field_points_at_its_section(cli, write_yaml) -> None:
    path = write_yaml("meta:\n  name: x\nmodel:\n  hidden_size: 64\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:3: model.pattern: required field is missing" in err
    assert f"{path.name}:1: parallelism: required field is missing" in err


def test_cross_field_rule_names_rule_and_numbers(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", "parallelism.tp=3")
    assert status == 2
    assert "--set:1: parallelism.tp:" in err
    assert "3" in err and "32" in err  # tp and the attention heads it must divide
    assert "[parallelism." in err


def test_bad_pattern_symbol(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", "model.pattern=MEMXM")
    assert status == 2
    assert "model.pattern: unknown symbol 'X' at position 3" in err


def test_several_errors_are_all_reported(cli, write_yaml) -> None:
    path = _child(write_yaml, "model:\n  hidden_size: -1\nparallelism:\n  pp: 0\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "model.hidden_size" in err and "parallelism.pp" in err


def test_malformed_yaml(cli, write_yaml) -> None:
    path = write_yaml("model: [unclosed\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:2: <root>: malformed YAML" in err
    assert "Traceback" not in err


def test_tagged_yaml_is_refused(cli, write_yaml) -> None:
    path = write_yaml("meta: !!python/object/apply:os.system [touch /tmp/pwned]\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "is not allowed" in err


def test_alias_bomb_is_refused(cli, write_yaml) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    status, _, err = cli("validate", str(write_yaml("\n".join(lines))))
    assert status == 2
    assert "alias bomb" in err


def test_recursive_alias_is_refused(cli, write_yaml) -> None:
    status, _, err = cli("validate", str(write_yaml("meta: &m\n  name: *m\n")))
    assert status == 2
    assert "recursive alias" in err


def test_empty_file(cli, write_yaml) -> None:
    path = write_yaml("")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:1: <root>: the document is empty" in err


def test_not_a_mapping(cli, write_yaml) -> None:
    status, _, err = cli("validate", str(write_yaml("- a\n- b\n")))
    assert status == 2
    assert "must be a mapping" in err


def test_not_utf8(cli, tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"meta:\n  name: caf\xe9\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "latin1.yaml:2: <root>: not UTF-8" in err


def test_missing_file(cli, tmp_path: Path) -> None:
    status, _, err = cli("validate", str(tmp_path / "nope.yaml"))
    assert status == 2
    assert "nope.yaml: <root>: file not found" in err


def test_unknown_preset_suggests_one(cli) -> None:
    status, _, err = cli("validate", "nanoo")
    assert status == 2
    assert "did you mean 'nano'?" in err


def test_override_without_equals(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", "model.hidden_size")
    assert status == 2
    assert "--set:1: <root>: override 'model.hidden_size' is not key=value" in err


def test_override_of_unknown_key(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", "parallelism.tensor_parallel=2")
    assert status == 2
    assert "--set:1: parallelism.tensor_parallel: unknown key" in err


def test_broken_interpolation(cli, write_yaml) -> None:
    path = _child(write_yaml, "training:\n  tokens: ${data.missing}\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "interpolation failed" in err


def test_circular_extends(cli, write_yaml) -> None:
    write_yaml("extends: b.yaml\n", "a.yaml")
    path = write_yaml("extends: a.yaml\n", "b.yaml")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "circular extends" in err


def test_missing_fragment(cli, write_yaml) -> None:
    path = write_yaml("extends: base/nope.yaml\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:1: extends: fragment not found: 'base/nope.yaml'" in err


def test_one_bad_target_does_not_hide_the_others(cli) -> None:
    status, out, err = cli("validate", "nano", "nanoo", "super")
    assert status == 2
    assert "ok: nano" in out and "ok: super" in out
    assert "nanoo" in err


# Data recipes: told apart from blueprints by their top-level keys.

RECIPE = REPO / "data_recipes" / "nano.yaml"


def test_a_recipe_path_is_validated_as_a_recipe(cli) -> None:
    status, out, err = cli("validate", str(RECIPE))
    assert status == 0, err
    assert "ok:" in out and err == ""


def test_recipe_errors_are_located_with_did_you_mean(cli, tmp_path: Path) -> None:
    (tmp_path / "samples").symlink_to(RECIPE.parent / "samples")
    text = RECIPE.read_text(encoding="utf-8").replace("  window: 4096", "  windw: 4096")
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("weight: 34", "weight: -1"), encoding="utf-8")
    line = text[: text.index("weight: 34")].count("\n") + 1
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert "packing.windw: unknown key (did you mean 'window'?)" in err
    assert f"recipe.yaml:{line}: sources[0].weight: Input should be greater than 0" in err


def test_a_file_neither_blueprint_nor_recipe_is_refused(cli, write_yaml) -> None:
    for text in ("foo: 1\n", "meta: {name: x}\nsources: []\n", "{}\n"):
        status, _, err = cli("validate", str(write_yaml(text)))
        assert status == 2
        assert "bp.yaml:1: <root>: not a blueprint (top-level keys: extends, meta" in err
        assert "nor a data recipe (name, description, seed" in err


def test_misspelt_keys_still_choose_the_schema(cli, write_yaml) -> None:
    status, _, err = cli("validate", str(write_yaml("sorces: []\nname: x\n")))
    assert status == 2
    assert "sorces: unknown key (did you mean 'sources'?)" in err


def test_overrides_do_not_apply_to_recipes(cli) -> None:
    status, _, err = cli("validate", str(RECIPE), "--set", "seed=1")
    assert status == 2
    assert "--set:1: <root>: --set applies to blueprints" in err


# Input that used to crash: exit 2 and a located message, never a traceback.


def test_a_huge_width_is_out_of_bounds(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", f"model.hidden_size={10**400}")
    assert status == 2
    assert "--set:1: model.hidden_size: Input should be less than or equal to 131072" in err
    assert "(got an integer of about 401 digits)" in err


def test_an_integer_too_long_to_read(cli, write_yaml) -> None:
    status, _, err = cli("validate", str(write_yaml("meta:\n  name: " + "9" * 5000 + "\n")))
    assert status == 2
    assert "bp.yaml:2: meta.name: an integer of 5000 characters is too long" in err


def test_deep_nesting_is_refused(cli, write_yaml) -> None:
    status, _, err = cli("validate", str(write_yaml("a: " + "[" * 100 + "]" * 100)))
    assert status == 2
    assert "bp.yaml:1: <root>: nested more than 32 levels deep" in err


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_very_deep_nesting_is_one_clean_line(cli, write_yaml, depth: int) -> None:
    # Newer PyYAML scanners stop such text themselves, before our event walk sees
    # it; whose wording wins is theirs to choose, the exit code and the place are ours.
    status, _, err = cli("validate", str(write_yaml("a: " + "[" * depth + "]" * depth)))
    assert status == 2
    assert err.count("\n") == 1
    assert re.search(r"bp\.yaml:1: <root>: \S", err)
    assert "Traceback" not in err and "internal error" not in err


def test_deep_block_mappings_are_refused(cli, write_yaml) -> None:
    text = "".join(f"{'  ' * i}k:\n" for i in range(40)) + "  " * 40 + "v: 1\n"
    status, _, err = cli("validate", str(write_yaml(text)))
    assert status == 2
    assert "bp.yaml:33: <root>: nested more than 32 levels deep" in err


def test_a_truncated_file_is_named_not_its_fragment(cli, tmp_path: Path) -> None:
    shutil.copytree(PRESETS / "base", tmp_path / "base")
    text = NANO.read_text(encoding="utf-8")
    path = tmp_path / "nano.yaml"
    path.write_text(text[: text.index("model:")], encoding="utf-8")  # model: only in a fragment
    status, _, err = cli("validate", str(path))
    assert status == 2
    extends = text[: text.index("extends:")].count("\n") + 1
    assert f"nano.yaml:{extends}: model.pattern: required field is missing" in err
    assert f"nano.yaml:{extends}: model.hidden_size: required field is missing" in err
    assert "base/" not in err


def test_control_characters_stay_on_one_line(cli, write_yaml) -> None:
    path = write_yaml(f'extends: {NANO}\nmodel:\n  pattern: "M\\rE\\nM"\n')
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert "\\r" in err


# Usage mistakes: click's usage message and exit 2.


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["export", "onnx"], "No such command 'onnx'; choose from: hf, megatron."),
        (["train", "--bogus"], "No such option: --bogus"),
        (["frobnicate"], "choose from: validate, build, plan"),
        (["plan"], "Missing argument"),
        (["validate", "--bogus"], "No such option: --bogus"),
        (["import", "hf", "/nonexistent/folder", "--out", "x.yaml"], "does not exist"),
    ],
)
def test_usage_mistakes_print_usage_and_exit_2(cli, argv: list[str], expected: str) -> None:
    status, _, err = cli(*argv)
    assert status == 2
    assert expected in err
    assert "Usage: factory" in err or argv[0] == "plan"
    assert "internal error" not in err and "Traceback" not in err


def test_a_rule_that_cannot_run_does_not_hide_the_rule_that_explains_why(cli) -> None:
    # The memory planner cannot size '-' layers without model.mlp; layer_sections says so.
    status, _, err = cli("validate", "nemotron_h_8b", "--set", "model.mlp=null")
    assert status == 2
    assert "model.mlp is not set [model.layer_sections]" in err
    assert "internal error" not in err


def test_a_section_an_override_creates_is_located_at_the_override(cli) -> None:
    status, _, err = cli("validate", "nano", "--set", "precision.switch_to_bf16.after_fraction=0.5")
    assert status == 0
    assert err.startswith("--set:1: precision.switch_to_bf16: warning:")
