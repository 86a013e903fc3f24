"""Reading YAML: line numbers, and refusing what a blueprint must never contain."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from factory.errors import BlueprintError
from factory.loading.blueprint import read_blueprint
from factory.loading.yaml_source import read_yaml_text


def _error(text: str) -> str:
    with pytest.raises(BlueprintError) as info:
        read_yaml_text(text, "f.yaml")
    (diagnostic,) = info.value.diagnostics
    return diagnostic.format()


def test_records_the_line_of_every_value() -> None:
    data, source_map = read_yaml_text("a: 1\nb:\n  c: [1, 2]\n  d:\n    - x\n", "f.yaml")
    assert data == {"a": 1, "b": {"c": [1, 2], "d": ["x"]}}
    assert source_map.locate("a") == ("f.yaml", 1)
    assert source_map.locate("b.c") == ("f.yaml", 3)
    assert source_map.locate("b.d[0]") == ("f.yaml", 5)
    # an unknown child is reported at its nearest written parent
    assert source_map.locate("b.missing.deeper") == ("f.yaml", 2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "a: !!python/object/apply:os.system [echo hi]",
            "f.yaml:1: a: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed",
        ),
        ("a:\n  b: !custom 3", "f.yaml:2: a.b: tag '!custom' is not allowed"),
        ("a: &x [*x]", "recursive alias"),
        ("a: 1\nb: 2\na: 3", "f.yaml:3: a: duplicate key (first set on line 1)"),
        ("", "f.yaml:1: <root>: the document is empty"),
        ("# only a comment\n", "the document is empty"),
        ("a: [1, 2", "malformed YAML"),
        ("a: 1\n  b: 2", "f.yaml:2: <root>: malformed YAML"),
        ("---\na: 1\n---\nb: 2\n", "malformed YAML"),
        ("<<: {a: 1}", "merge keys"),
        ("? [1, 2]\n: x", "keys must be plain strings"),
        ("a: " + "[" * 33 + "]" * 33, "f.yaml:1: <root>: nested more than 32 levels deep"),
        ("a: " + "{b: " * 40 + "1" + "}" * 40, "nested more than 32 levels deep"),
        ("- " * 50 + "x", "nested more than 32 levels deep"),
        ("a: 1\nb: \x00", "f.yaml:2: <root>: malformed YAML: character '\\x00' is not allowed"),
        ("a: " + "1" * 5000, "f.yaml:1: a: an integer of 5000 characters is too long"),
    ],
)
def test_bad_yaml_is_a_located_error(text: str, expected: str) -> None:
    assert expected in _error(text)


def test_alias_bomb_fails_fast() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    message = _error("\n".join(lines))
    assert "expands to more than" in message


_scalars = st.one_of(
    st.integers(-(10**12), 10**12),
    st.booleans(),
    st.text(alphabet="abcxyz_", min_size=1, max_size=8),
)
_keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
_trees = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_keys, children, min_size=1, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(_keys, _trees, min_size=1, max_size=5))
def test_round_trips_plain_data(tree: dict) -> None:
    import yaml

    text = yaml.safe_dump(tree, sort_keys=False)
    data, source_map = read_yaml_text(text, "f.yaml")
    assert data == tree
    for key in tree:
        assert source_map.locate(key)[1] >= 1


def test_nesting_within_the_limit_is_fine() -> None:
    data, _ = read_yaml_text("a: " + "[" * 31 + "]" * 31, "f.yaml")
    assert data["a"] is not None


def test_aliases_cannot_nest_past_the_limit() -> None:
    # Each line is shallow; following the aliases is not.
    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 40)]
    assert "nested more than 32 levels deep" in _error("\n".join(lines))


def test_oversized_files_are_not_read(tmp_path, monkeypatch) -> None:
    from factory.loading import yaml_source

    monkeypatch.setattr(yaml_source, "MAX_BYTES", 8)
    path = tmp_path / "big.yaml"
    path.write_text("a: 123456789\n", encoding="utf-8")
    with pytest.raises(BlueprintError, match="larger than 8 bytes"):
        yaml_source.read_yaml(path)


RECIPE_WITH_MERGE_KEY = """\
name: r
sources:
  - name: a
    path: a.jsonl
    category: math
    weight: 1
    steps: [{kind: text}]
    <<: {weight: 2}
"""

BLUEPRINT_WITH_MERGE_KEY = "meta:\n  name: b\n  <<: {description: x}\n"


def test_a_merge_key_in_a_recipe_points_to_anchors_not_extends(tmp_path: Path, cli) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_WITH_MERGE_KEY)
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith(f"{recipe}:8: sources[0]: YAML merge keys ('<<') are not supported")
    assert "&name" in line and "*name" in line
    assert "use 'extends'" not in line and "has no 'extends'" in line


def test_a_merge_key_in_a_blueprint_points_to_extends(tmp_path: Path, cli) -> None:
    blueprint = tmp_path / "b.yaml"
    blueprint.write_text(BLUEPRINT_WITH_MERGE_KEY)
    with pytest.raises(BlueprintError) as info:
        read_blueprint(blueprint)
    (diagnostic,) = info.value.diagnostics
    assert (diagnostic.file, diagnostic.line, diagnostic.path) == (str(blueprint), 3, "meta")
    assert "build on another blueprint with 'extends'" in diagnostic.message
    assert "&name" in diagnostic.message
    # 'factory validate' reads the file before it knows which kind it is: both ways are named.
    status, _, err = cli("validate", str(blueprint))
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith(f"{blueprint}:3: meta: YAML merge keys ('<<') are not supported")
    assert "&name" in line and "a blueprint may also use 'extends'" in line


def _not_a_file(tmp_path: Path, kind: str) -> Path:
    """A named pipe (no writer: reading it would block for ever), a folder, or a device."""
    if kind == "fifo":
        path = tmp_path / "pipe.yaml"
        os.mkfifo(path)
        return path
    if kind == "folder":
        path = tmp_path / "folder.yaml"
        path.mkdir()
        return path
    return Path("/dev/null")


@pytest.mark.parametrize(
    ("kind", "what"),
    [("fifo", "a named pipe (FIFO)"), ("folder", "a folder"), ("device", "a device")],
)
@pytest.mark.parametrize("command", ["recipe", "blueprint"])
def test_a_recipe_or_blueprint_that_is_not_a_regular_file_is_refused_up_front(
    tmp_path: Path, cli, kind: str, what: str, command: str
) -> None:
    path = _not_a_file(tmp_path, kind)
    if command == "recipe":
        args = ("data", "build", str(path), "--out", str(tmp_path / "o"))
    else:
        args = ("validate", str(path))
    # A worker thread, so a regression that blocks on the FIFO fails the test instead of hanging it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(cli, *args)
        try:
            status, _, err = future.result(timeout=60)
        except concurrent.futures.TimeoutError:
            with open(path, "wb"):  # a writer lets the blocked reader finish
                pass
            pytest.fail(f"reading {kind} {path} blocked")
    assert status == 2
    (line,) = err.splitlines()
    assert line == f"{path}: <root>: {what}, not a YAML file"
    assert not (tmp_path / "o").exists()
