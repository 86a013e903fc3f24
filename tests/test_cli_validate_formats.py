"""`factory validate --format json|github` and `--strict`: the same findings, for CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PRESETS

from factory.diagnostic_formats import github_annotation
from factory.errors import Diagnostic, did_you_mean, suggestion_in

NANO = PRESETS / "nano.yaml"
TYPO = f"extends: {NANO}\nmodel:\n  hiden_size: 4096\n"
# Valid, with one warning: nothing to switch to bf16 in an all-bf16 recipe. On a one-stage
# preset: Nano's long-context stage adds its published layout's warnings (tests/preset_stages.py).
SWITCH = (
    f"extends: {PRESETS / 'nemotron_h_8b.yaml'}\nprecision:\n  switch_to_bf16:\n"
    "    after_fraction: 0.5\n"
)
SWITCH_RULE = "precision.switch_to_bf16_unused"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the folder holding the blueprints, as CI runs from the checkout."""
    monkeypatch.chdir(tmp_path)


def _clean(out: str, err: str) -> None:
    assert "Traceback" not in out + err and "internal error" not in out + err


def test_json_gives_each_fact_its_own_field(cli, write_yaml) -> None:
    write_yaml(TYPO)
    status, out, err = cli("validate", "--format", "json", "bp.yaml")
    assert status == 2
    _clean(out, err)
    assert json.loads(out) == [
        {
            "file": "bp.yaml",
            "line": 3,
            "column": 3,
            "path": "model.hiden_size",
            "rule": None,
            "severity": "error",
            "message": "unknown key (did you mean 'hidden_size'?)",
            "did_you_mean": "hidden_size",
        }
    ]


def test_json_of_valid_targets_is_an_empty_list(cli) -> None:
    # a program and a one-stage preset that raise no warning
    status, out, err = cli("validate", "--format", "json", "super", "nemotron_h_8b")
    assert (status, json.loads(out), err) == (0, [], "")


def test_json_names_the_rule_and_the_warning(cli, write_yaml) -> None:
    write_yaml(SWITCH)
    status, out, _ = cli("validate", "--format", "json", "bp.yaml")
    assert status == 0
    [record] = json.loads(out)
    assert record["rule"] == SWITCH_RULE and record["severity"] == "warning"
    assert (record["file"], record["line"], record["column"]) == ("bp.yaml", 3, 3)


def test_json_locates_malformed_yaml_to_the_column(cli, write_yaml) -> None:
    write_yaml("model:\n  hidden_size: [1, 2\n")
    status, out, _ = cli("validate", "--format", "json", "bp.yaml")
    assert status == 2
    [record] = json.loads(out)
    assert record["message"].startswith("malformed YAML")
    assert record["line"] == 3 and record["column"] == 1


def test_github_annotates_the_file_line_and_column(cli, write_yaml) -> None:
    write_yaml(TYPO)
    status, out, err = cli("validate", "--format", "github", "bp.yaml")
    assert status == 2
    _clean(out, err)
    assert out.splitlines() == [
        "::error file=bp.yaml,line=3,col=3,title=factory validate::"
        "model.hiden_size: unknown key (did you mean 'hidden_size'?)"
    ]


def test_github_titles_a_rule_and_names_an_override_in_the_message(cli) -> None:
    status, out, _ = cli("validate", "--format", "github", "nano", "--set", "parallelism.tp=3")
    assert status == 2
    # '--set' is no file to pin the annotation on, so the message says where; the override
    # reaches the stages that keep the base's tp (the later ones set their own), and it
    # names them.
    assert (
        "::error title=parallelism.tp_attention::--set: parallelism.tp: "
        "stages 'phase1', 'phase2': tp=3 must divide attention heads (32)"
    ) in out.splitlines()


def test_github_warning_is_a_warning_annotation_and_passes(cli, write_yaml) -> None:
    write_yaml(SWITCH)
    status, out, _ = cli("validate", "--format", "github", "bp.yaml")
    assert status == 0
    assert out.startswith(f"::warning file=bp.yaml,line=3,col=3,title={SWITCH_RULE}::")
    assert "ok: bp.yaml" in out


def test_strict_makes_warnings_errors(cli, write_yaml) -> None:
    write_yaml(SWITCH)
    status, out, _ = cli("validate", "--strict", "--format", "github", "bp.yaml")
    assert status == 2
    assert out.startswith(f"::error file=bp.yaml,line=3,col=3,title={SWITCH_RULE}::")
    assert "ok:" not in out


def test_strict_text_fails_without_the_warning_prefix(cli, write_yaml) -> None:
    write_yaml(SWITCH)
    status, out, err = cli("validate", "--strict", "bp.yaml")
    assert status == 2
    assert err.startswith("bp.yaml:3: precision.switch_to_bf16: switch_to_bf16")
    assert f"[{SWITCH_RULE}]" in err and "warning:" not in err and "ok:" not in out


def test_github_escapes_what_would_end_the_command(cli, write_yaml) -> None:
    # A percent sign in a key, in a file whose name holds ',' and ':' (property separators).
    write_yaml(f'extends: {NANO}\nmodel:\n  "50%": 1\n', name="a,b:c.yaml")
    status, out, _ = cli("validate", "--format", "github", "a,b:c.yaml")
    assert status == 2
    [annotation] = out.splitlines()
    assert annotation.startswith("::error file=a%2Cb%3Ac.yaml,line=3,col=3,title=")
    assert "::model['50%25']: unknown key" in annotation


def test_github_keeps_a_multiline_message_one_command() -> None:
    finding = Diagnostic("model", "first\r\nsecond", "--set", rule="a,b:c")
    assert github_annotation(finding) == "::error title=a%2Cb%3Ac::--set: model: first%0D%0Asecond"


def test_an_unknown_format_is_a_usage_error(cli) -> None:
    status, _, err = cli("validate", "--format", "xml", "nano")
    assert status == 2
    assert "github" in err and "Traceback" not in err  # the choices it offers


@pytest.mark.parametrize("word", ["hidden_size", "it's", 'a"b', "back\\slash"])
def test_suggestion_reads_back_what_did_you_mean_wrote(word: str) -> None:
    message = "unknown key" + did_you_mean(word, [word]) + " [rule]"
    assert suggestion_in(message) == word
    assert suggestion_in("unknown key") is None


def test_an_undecodable_file_name_is_escaped_not_an_internal_error(tmp_path: Path) -> None:
    # A name that is not UTF-8 and a stdout that refuses what it cannot encode (a UTF-8 locale).
    bad, good = os.fsdecode(b"\xff.yaml"), os.fsdecode(b"\xfe.yaml")
    (tmp_path / bad).write_text(TYPO)
    (tmp_path / good).write_text(f"extends: {NANO}\n")
    for how in ("github", "text"):
        done = subprocess.run(
            [sys.executable, "-m", "factory", "validate", "--format", how, bad, good],
            cwd=tmp_path,
            env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
            capture_output=True,
            text=True,
            errors="backslashreplace",
        )
        assert done.returncode == 2, done.stderr
        assert "internal error" not in done.stderr and "Traceback" not in done.stderr
        assert "ok: \\udcfe.yaml" in done.stdout
    assert done.stderr.startswith("\\udcff.yaml:3: model.hiden_size: unknown key")
