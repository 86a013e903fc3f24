"""The data build when its inputs, its folder or its disk go wrong: one clear line, the right
exit status, and a folder a rerun (or ``factory data verify``) can trust."""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from factory.cli.app import main
from factory.data.samples import generate

CliRun = Callable[..., tuple[int, str, str]]

RECIPE = """\
name: faults
seed: 1
sources:
  - name: web
    path: in
    category: pretrain_text
    weight: 1
    steps: [{kind: text}]
dedup: {exact: false, minhash: false}
packing: {seq_len: 256, window: 8}
output: {samples_per_shard: 4}
"""


def _documents(path: Path, count: int = 30) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = generate("pretrain_text", count, 1)
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))


def _recipe(root: Path) -> Path:
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    return recipe


PROGRESS = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} ")
"""The timestamp that starts a progress line (output that is not a terminal gets them)."""


def _lines(text: str) -> list[str]:
    """What a command printed, without its progress lines."""
    return [line for line in text.splitlines() if line.strip() and not PROGRESS.match(line)]


def _published(out: Path) -> dict[str, bytes]:
    """Every file of the folder but the ``.work`` intermediates, by relative path."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.relative_to(out).parts
    }


def _no_temporary_files(out: Path) -> bool:
    return not [p for p in out.rglob("*") if ".tmp" in p.name]


@pytest.fixture(scope="module")
def good_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    _documents(root / "in" / "a.jsonl")
    return _recipe(root)


@pytest.fixture(scope="module")
def clean_build(good_recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The published files of an undisturbed build of ``good_recipe``."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(["data", "build", str(good_recipe), "--out", str(out)]) == 0
    return _published(out)


def test_corrupt_parquet_is_quarantined_like_corrupt_gzip(tmp_path: Path, cli: CliRun) -> None:
    _documents(tmp_path / "in" / "a.jsonl")
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n')[:-12])
    (tmp_path / "in" / "c.parquet").write_bytes(bytes(range(256)) * 4)  # not parquet
    (tmp_path / "in" / "d.parquet").write_bytes(b"")
    out = tmp_path / "out"
    status, _, err = cli("data", "build", str(_recipe(tmp_path)), "--out", str(out))
    assert status == 0, err
    web = json.loads((out / "manifest.json").read_text())["sources"]["web"]
    assert web["files"] == 4
    assert web["quarantined"] == {"truncated_gzip": 1, "bad_parquet": 2}
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    # Each line names the input file as the recipe's source path resolves it, not only its index.
    assert [(q["file"], q["reason"]) for q in quarantine] == [
        (str(tmp_path / "in" / "b.jsonl.gz"), "truncated_gzip"),
        (str(tmp_path / "in" / "c.parquet"), "bad_parquet"),
        (str(tmp_path / "in" / "d.parquet"), "bad_parquet"),
    ]


def test_a_symlink_loop_in_a_source_folder_reads_each_file_once(
    tmp_path: Path, cli: CliRun
) -> None:
    _documents(tmp_path / "in" / "a.jsonl", count=30)
    (tmp_path / "in" / "loop").symlink_to(".")  # ln -s . in/loop
    (tmp_path / "in" / "again.jsonl").symlink_to("a.jsonl")  # a second name for one file
    out = tmp_path / "out"
    status, _, err = cli("data", "build", str(_recipe(tmp_path)), "--out", str(out))
    assert status == 0, err
    web = json.loads((out / "manifest.json").read_text())["sources"]["web"]
    assert web["files"] == 1
    assert web["steps"]["read"]["documents_in"] == 30


def _hold_lock(out: Path) -> subprocess.Popen[str]:
    """Another process holding ``out``'s build lock, as a running build does, until killed."""
    code = (
        "import sys, time; from pathlib import Path; "
        "from factory.data.build_lock import build_lock\n"
        "with build_lock(Path(sys.argv[1])):\n"
        "    print('locked', flush=True); time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    return holder


def test_a_second_build_into_a_busy_folder_is_refused_and_a_killed_one_never_blocks(
    good_recipe: Path, clean_build: dict[str, bytes], tmp_path: Path, cli: CliRun
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    holder = _hold_lock(out)
    try:
        status, _, err = cli("data", "build", str(good_recipe), "--out", str(out))
        assert status == 2
        assert _lines(err) == [
            f"factory: {out}: another data build (pid {holder.pid}) is writing this folder; "
            "wait for it to finish or build into another --out"
        ]
        assert not (out / "manifest.json").exists() and not (out / ".work").exists()
    finally:
        holder.kill()  # SIGKILL: the lock file stays, the lock does not
        holder.wait()
    status, _, err = cli("data", "build", str(good_recipe), "--out", str(out))
    assert status == 0, err
    assert _published(out) == clean_build
    assert cli("data", "verify", str(out))[0] == 0


def test_a_rerun_rebuilds_a_shard_damaged_since_the_build(
    good_recipe: Path, clean_build: dict[str, bytes], tmp_path: Path, cli: CliRun
) -> None:
    out = tmp_path / "out"
    assert cli("data", "build", str(good_recipe), "--out", str(out))[0] == 0
    victim = out / "shards" / "shard-000001.tar"
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 3] ^= 0x01
    victim.write_bytes(bytes(damaged))
    assert cli("data", "verify", str(out))[0] == 1
    status, _, err = cli("data", "build", str(good_recipe), "--out", str(out))
    assert status == 0, err
    assert cli("data", "verify", str(out))[0] == 0
    assert _published(out) == clean_build


def _disk_full_on(marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsync`` fails with ENOSPC (as on a full disk) for the temporary file whose name
    holds ``marker``; the kernel's error names no file."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if marker in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize(
    ("marker", "named"),
    [(".shard-000002.tar.", "shards/shard-000002.tar"), (".manifest.json.", "manifest.json")],
)
def test_a_full_disk_names_the_file_and_leaves_nothing_a_rerun_would_trust(
    good_recipe: Path,
    clean_build: dict[str, bytes],
    tmp_path: Path,
    cli: CliRun,
    monkeypatch: pytest.MonkeyPatch,
    marker: str,
    named: str,
) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _disk_full_on(marker, patch)
        status, _, err = cli("data", "build", str(good_recipe), "--out", str(out))
    assert status == 1
    assert "Traceback" not in err and "internal error" not in err
    (line,) = _lines(err)
    assert str(out / named) in line and "the disk is full" in line
    assert not (out / "manifest.json").exists()
    assert not (out / named).exists()
    assert _no_temporary_files(out)
    status, _, err = cli("data", "build", str(good_recipe), "--out", str(out))
    assert status == 0, err
    assert _published(out) == clean_build
    assert cli("data", "verify", str(out))[0] == 0


def _broken_manifest(root: Path) -> tuple[Path, str]:
    (root / "built").mkdir()
    (root / "built" / "manifest.json").write_text('{"shards": [')
    return root / "built", f"factory: {root / 'built' / 'manifest.json'}: not valid JSON"


def _no_manifest(root: Path) -> tuple[Path, str]:
    (root / "empty").mkdir()
    return root / "empty", f"factory: {root / 'empty' / 'manifest.json'}: no manifest"


def _no_folder(root: Path) -> tuple[Path, str]:
    return root / "nowhere", f"factory: {root / 'nowhere'}: no such folder"


@pytest.mark.parametrize("case", [_no_folder, _no_manifest, _broken_manifest])
def test_verify_a_folder_without_a_readable_manifest_is_bad_input(
    tmp_path: Path, cli: CliRun, case: Callable[[Path], tuple[Path, str]]
) -> None:
    folder, expected = case(tmp_path)
    status, out, err = cli("data", "verify", str(folder))
    assert status == 2
    (line,) = _lines(err)
    assert line.startswith(expected)
    assert "internal error" not in err and not out


def test_a_build_no_document_survives_is_refused_unless_allowed(
    tmp_path: Path, cli: CliRun
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.parquet").write_bytes(b"not parquet")
    (tmp_path / "in" / "b.jsonl").write_text("")
    recipe, out = _recipe(tmp_path), tmp_path / "out"
    status, _, err = cli("data", "build", str(recipe), "--out", str(out))
    assert status == 2
    (line,) = _lines(err)
    assert line.startswith(f"factory: {recipe}: no documents survived curation (")
    assert "quarantined: bad_parquet 1" in line and "--allow-empty" in line
    assert not (out / "manifest.json").exists()
    status, said, err = cli("data", "build", str(recipe), "--out", str(out), "--allow-empty")
    assert status == 0
    (warning,) = _lines(err)
    assert warning.startswith(f"warning: {out}: built 0 shards, no documents survived curation")
    assert json.loads((out / "manifest.json").read_text())["shards"] == []
    assert "0 shards" in said
