"""Fuzzing `factory validate`: whatever a user writes, it answers 0 or 2, never a traceback.

Every preset (with the ``base/`` fragments it extends) and every shipped data
recipe is mutated (values of other types and absurd magnitudes, deeper or
shallower nesting, deleted and renamed keys, truncation, stray bytes) and
validated in-process. Derandomized and bounded, so CI sees the same cases.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import PRESETS, REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factory.cli.app import main

RECIPES = REPO / "data_recipes"
DOCUMENTS = sorted(PRESETS.glob("*.yaml")) + sorted(RECIPES.glob("*.yaml"))
FRAGMENTS = sorted((PRESETS / "base").glob("*.yaml"))
# Read once: hypothesis replays examples and needs the same inputs every time.
CONTENTS = {path: path.read_bytes() for path in DOCUMENTS + FRAGMENTS + [PRESETS / "ultra.yaml"]}
FUZZ = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=3),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# `file:line: path: message`, line optional (missing files have none).
DIAGNOSTIC = re.compile(r"^[^\s:][^:]*(:\d+)?: \S.*: .+$")
DEEP = "__deep__"
"""Placeholder swapped for deeply nested YAML text after dumping (PyYAML's dumper recurses)."""

_odd_values = st.sampled_from(
    [
        0,
        -1,
        10**20,
        10**400,
        -(10**400),
        2**63,
        0.5,
        -1.5,
        1e308,
        float("inf"),
        float("nan"),
        "",
        "x",
        "25T",
        "9" * 80 + "T",
        "1e400",
        "${model}",
        "${nope.nothing}",
        "???",
        True,
        None,
        [],
        {},
        [1, "a"],
        {"a": 1},
        DEEP,
    ]
)
_values = st.one_of(
    _odd_values,
    st.integers(),
    st.floats(),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/*?["), max_size=12),
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the fragments and sample data that mutated documents point at."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(PRESETS / "base", root / "base")
    (root / "samples").symlink_to(RECIPES / "samples", target_is_directory=True)
    with contextlib.redirect_stdout(io.StringIO()):  # import everything outside the deadline
        assert main(["validate", "--quiet"]) == 0
    return root


def _validate(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["validate", *args])
    return status, out.getvalue(), err.getvalue()


def _assert_clean(status: int, out: str, err: str) -> None:
    assert status in (0, 2), (status, err)
    assert "Traceback" not in out + err and "internal error" not in err, err
    if status == 2:
        assert err.strip(), "exit 2 must say why"
        for line in err.strip().splitlines():
            assert DIAGNOSTIC.match(line), line


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a parsed document (keys and list indices), parents before children."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        children: list[tuple[Any, Any]] = list(node.items())
    else:
        children = list(enumerate(node)) if isinstance(node, list) else []
    for key, child in children:
        found += _paths(child, (*prefix, key))
    return found


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _mutate(tree: Any, path: tuple, how: str, value: Any) -> None:
    """Change the value at ``path`` in place: replace, delete, rename, wrap or unwrap it."""
    parent, key = _parent(tree, path), path[-1]
    value = copy.deepcopy(value)  # the strategy's lists and dicts are shared between examples
    if how == "replace":
        parent[key] = value
    elif how == "delete":
        del parent[key]
    elif how == "rename" and isinstance(parent, dict):
        parent[f"{key}{value}" if isinstance(value, str) and value else f"{key}x"] = parent.pop(key)
    elif how == "wrap":
        parent[key] = [parent[key]] if isinstance(value, int) else {"x": parent[key]}
    elif how == "unwrap" and isinstance(parent[key], (dict, list)) and parent[key]:
        inner = parent[key]
        parent[key] = next(iter(inner.values())) if isinstance(inner, dict) else inner[0]


def _deep_text(depth: int, mapping: bool) -> str:
    return "{a: " * depth + "1" + "}" * depth if mapping else "[" * depth + "]" * depth


@FUZZ
@given(data=st.data())
def test_mutated_documents_never_crash(workdir: Path, data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(DOCUMENTS), label="document")
    tree = yaml.safe_load(CONTENTS[source])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = _paths(tree)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        how = data.draw(st.sampled_from(["replace"] * 4 + ["delete", "rename", "wrap", "unwrap"]))
        _mutate(tree, path, how, data.draw(_values, label="value"))
    text = yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
    depth = data.draw(st.sampled_from([2, 40, 5000, 200_000]), label="depth")
    text = text.replace(DEEP, _deep_text(depth, data.draw(st.booleans(), label="mapping")))
    target = workdir / source.name
    target.write_text(text, encoding="utf-8")
    _assert_clean(*_validate(str(target)))


@FUZZ
@given(data=st.data())
def test_damaged_files_never_crash(workdir: Path, data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(DOCUMENTS + FRAGMENTS), label="file")
    raw = CONTENTS[source]
    at = data.draw(st.integers(0, len(raw)), label="offset")
    how = data.draw(st.sampled_from(["truncate", "insert", "overwrite"]), label="how")
    noise = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
    damaged = {
        "truncate": raw[:at],
        "insert": raw[:at] + noise + raw[at:],
        "overwrite": raw[:at] + noise + raw[at + len(noise) :],
    }[how]
    # A damaged fragment is reached through an intact preset that extends it.
    folder = workdir / "damaged"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(workdir / "base", folder / "base")
    (folder / "samples").symlink_to(RECIPES / "samples", target_is_directory=True)
    is_fragment = source in FRAGMENTS
    (folder / ("base" if is_fragment else ".") / source.name).write_bytes(damaged)
    if is_fragment:
        (folder / "ultra.yaml").write_bytes(CONTENTS[PRESETS / "ultra.yaml"])
    target = folder / ("ultra.yaml" if is_fragment else source.name)
    status, out, err = _validate(str(target))
    _assert_clean(status, out, err)
    # What a truncated file lacks is reported in it, not in the fragments it extends.
    missing = [line for line in err.splitlines() if "required field is missing" in line]
    assert all(line.startswith(f"{target.resolve()}:") for line in missing), missing


def _dotted_keys() -> list[str]:
    """Every mapping path of a composed preset, plus a few that do not exist."""
    from factory.loading.compose import compose

    data, _ = compose(PRESETS / "super.yaml")
    paths = [p for p in _paths(data) if all(isinstance(k, str) for k in p)]
    return [".".join(p) for p in paths] + ["a.b.c", "model.nope", "precision.overrides"]


@settings(FUZZ, max_examples=100)
@given(
    preset=st.sampled_from([p.stem for p in PRESETS.glob("*.yaml")]),
    key=st.sampled_from(_dotted_keys()),
    value=st.one_of(
        st.sampled_from(["10" + "0" * 400, "-1", "0", "1e400", "[" * 3000 + "]" * 3000, "${x}"]),
        st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
    ),
)
def test_overrides_never_crash(workdir: Path, preset: str, key: str, value: str) -> None:
    _assert_clean(*_validate(preset, "--set", f"{key}={value}"))
