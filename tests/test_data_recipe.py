"""The recipe schema: every rule fails at load time, located at the value that breaks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.data.loaded_recipe import load_recipe, with_seq_len
from factory.errors import BlueprintError
from factory.schemas.data_recipe import DedupConfig

HEAD = "name: r\nsources:\n  - name: a\n    path: x.jsonl\n    category: math\n"


def _recipe(tmp_path: Path, body: str) -> Path:
    (tmp_path / "x.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(body)
    return path


def _errors(tmp_path: Path, body: str) -> list[str]:
    with pytest.raises(BlueprintError) as info:
        load_recipe(_recipe(tmp_path, body))
    return [d.format() for d in info.value.diagnostics]


def test_disjoint_reasoning_shares_fail_at_load_time_where_they_are_written(
    tmp_path: Path, cli
) -> None:
    body = HEAD + (
        "    weight: 1\n"
        "    steps:\n"
        "      - kind: chat\n"
        "        reasoning:\n"
        "          strip_fraction: 0.6\n"
        "          truncate_fraction: 0.5\n"
    )
    status, _, err = cli(
        "data", "build", str(_recipe(tmp_path, body)), "--out", str(tmp_path / "o")
    )
    assert status == 2
    assert "r.yaml:9: sources[0].steps[0].reasoning: strip_fraction (0.6) + " in err
    assert "truncate_fraction (0.5) = 1.1 must not exceed 1" in err
    assert not (tmp_path / "o").exists()  # refused before any work started


def test_step_errors_name_the_yaml_path_not_the_union_tag(tmp_path: Path) -> None:
    body = HEAD + (
        "    weight: 1\n"
        "    steps:\n"
        "      - kind: text\n"
        "      - kind: heuristics\n"
        "        min_word: 3\n"
        "        max_url_ratio: 2\n"
    )
    errors = _errors(tmp_path, body)
    assert any(
        "r.yaml:10: sources[0].steps[1].min_word: unknown key" in e
        and "did you mean 'min_words'?" in e
        for e in errors
    ), errors
    assert any("r.yaml:11: sources[0].steps[1].max_url_ratio: " in e for e in errors)


@pytest.mark.parametrize(
    ("tail", "where"),
    [
        ("    tokens: 1000000000000000000000000000000000T\n    steps: [{kind: text}]\n", "tokens"),
        ("    tokens: 20000T\n    steps: [{kind: text}]\n", "tokens"),
        ("    weight: 1\n    steps: [{kind: text}]\npacking: {seq_len: 100000000}\n", "seq_len"),
        ("    weight: 1\n    steps: [{kind: text}]\nseed: " + "9" * 400 + "\n", "seed"),
        ("    weight: 1\n    steps: [{kind: text}]\ndedup: {seed: -1}\n", "dedup.seed"),
        (
            "    weight: 1\n    steps: [{kind: text}]\noutput: {samples_per_shard: 1e400}\n",
            "output",
        ),
    ],
)
def test_sizes_and_counts_have_upper_bounds(tmp_path: Path, tail: str, where: str) -> None:
    errors = _errors(tmp_path, HEAD + tail)
    assert len(errors) == 1 and where in errors[0], errors


def test_minhash_signature_size_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"bands \(128\) x rows \(64\) = 8192"):
        DedupConfig(bands=128, rows=64)


def test_with_seq_len_validates_the_new_length() -> None:
    loaded = load_recipe("nano")
    assert with_seq_len(loaded, 256).recipe.packing.seq_len == 256
    with pytest.raises(ValueError, match="cannot pack recipe 'nano' to 33554432"):
        with_seq_len(loaded, 2**25)
