"""`factory validate`: exit 0 on valid blueprints, 2 with located messages otherwise."""

from __future__ import annotations

from pathlib import Path

from conftest import PRESETS

NANO = PRESETS / "nano.yaml"


def _child(write_yaml, body: str) -> Path:
    """A blueprint that extends the Nano preset and changes what `body` says."""
    return write_yaml(f"extends: {NANO}\n{body}")


def test_every_preset_is_valid(cli) -> None:
    status, out, err = cli("validate")
    assert status == 0, err
    for name in ("nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"):
        assert f"ok: {name}" in out
    assert err == ""


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
