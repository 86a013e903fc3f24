"""The CLI's last line of defence: whatever is raised inside a command, or whatever a user
passes, ``factory`` answers with a status and a line or two, never a traceback.

Two properties. First, any exception a command lets escape (an ``OSError`` of any errno, with
or without its path; any built-in error; a library's ``BaseException`` subclass, as
``torch.distributed.checkpoint.CheckpointException`` is) exits 1 with one line on stderr
naming the path of an ``OSError`` and saying the disk is full for ENOSPC (an unforeseen error
adds a second line: how to see its traceback). Second, every fast command given every hostile
path (missing, empty, a directory, random bytes, a FIFO, a damaged manifest or metrics file)
exits 0, 1 or 2 without a traceback or an "internal error".
"""

from __future__ import annotations

import errno
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factory.cli import validate_cmd
from factory.cli.app import main

BOUNDED = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class LibraryAbort(BaseException):
    """What some libraries raise instead of an Exception (DCP's CheckpointException does)."""


_messages = st.text(max_size=40) | st.just("first line\n  File 'x.py', line 3\nsecond")
_paths = st.none() | st.text(alphabet="abc/._- \n\t", min_size=1, max_size=20)
_os_errors = st.builds(
    lambda code, message, path: OSError(code, message, path) if path else OSError(code, message),
    st.sampled_from(sorted(errno.errorcode)),
    _messages,
    _paths,
)
_other_errors = st.builds(
    lambda kind, message: kind(message),
    st.sampled_from([ValueError, RuntimeError, KeyError, TypeError, AssertionError, LibraryAbort]),
    _messages,
)


@BOUNDED
@given(error=_os_errors | _other_errors)
def test_anything_a_command_raises_is_one_line(
    error: BaseException, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.delenv("FACTORY_DEBUG", raising=False)
    monkeypatch.setattr(validate_cmd, "_check", fail)
    assert main(["validate", "nano"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert lines and all(line.isprintable() for line in lines)
    if isinstance(error, OSError):
        assert len(lines) == 1 and "internal error" not in err
        if error.filename:
            assert _escaped(str(error.filename)) in lines[0]
        if error.errno == errno.ENOSPC:
            assert "the disk is full" in lines[0]
    else:
        assert len(lines) == 2 and type(error).__name__ in lines[0]


def _escaped(text: str) -> str:
    return text if text.isprintable() else text.encode("unicode_escape").decode()


def test_a_keyboard_interrupt_exits_130_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(validate_cmd, "_check", interrupt)
    assert main(["validate", "nano"]) == 130
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths a user (or a crash) can leave behind."""
    root = tmp_path_factory.mktemp("hostile")
    paths = {name: root / name for name in ("missing", "empty_dir", "dir.yaml", "noise.yaml")}
    paths["empty_dir"].mkdir()
    paths["dir.yaml"].mkdir()
    paths["noise.yaml"].write_bytes(bytes(range(256)) * 4)
    paths["empty.yaml"] = root / "empty.yaml"
    paths["empty.yaml"].write_text("")
    paths["fifo.yaml"] = root / "fifo.yaml"
    os.mkfifo(paths["fifo.yaml"])
    damaged = root / "damaged_data"
    damaged.mkdir()
    (damaged / "manifest.json").write_text('{"shards": [')
    paths["damaged_data"] = damaged
    wrong = root / "wrong_manifest"
    wrong.mkdir()
    (wrong / "manifest.json").write_text(json.dumps({"shards": [{"name": "../../etc/x"}]}))
    paths["wrong_manifest"] = wrong
    torn = root / "torn_run"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n{"kind": "st')
    paths["torn_run"] = torn
    return paths


_COMMANDS = [
    ["validate", "{p}"],
    ["validate", "{p}", "--set", "parallelism.tp=3"],
    ["plan", "{p}"],
    ["schema", "--out", "{p}"],
    ["data", "verify", "{p}"],
    ["data", "inspect", "{p}"],
    ["report", "{p}"],
    ["{p}"],
    ["validate", "--set"],
    ["plan", "nano", "--nope"],
]


_HOSTILE = ["missing", "empty_dir", "dir.yaml", "noise.yaml", "empty.yaml", "fifo.yaml",
            "damaged_data", "wrong_manifest", "torn_run"]  # fmt: skip


@pytest.mark.parametrize("name", _HOSTILE)
@pytest.mark.parametrize("command", _COMMANDS, ids=" ".join)
def test_hostile_paths_get_a_status_never_a_traceback(
    command: list[str],
    name: str,
    hostile: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("FACTORY_DEBUG", raising=False)
    argv = [part.format(p=hostile[name]) for part in command]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status in (0, 1, 2), argv
    assert "Traceback" not in out + err, argv
    assert "internal error" not in err, (argv, err)
