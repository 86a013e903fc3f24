"""Shards that megatron-energon's own loader opens, with metadata written by us byte for byte.

The data build writes what ``energon prepare`` would (``shards/*.tar.idx``,
``.nv-meta/{index.sqlite, index.uuid, .info.json, split.yaml, dataset.yaml}``)
without importing megatron-energon; here the real library reads it.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from factory.data.build_job import build
from factory.data.samples import generate
from factory.data.shards.energon_index import check_energon_index
from factory.data.shards.energon_metadata import write_energon_dataset
from factory.data.shards.shard_reader import read_samples

energon = pytest.importorskip("megatron.energon", reason="megatron-energon is not installed")
# It imports megatron-energon (and torch) at the top: only once the library is known to be there.
from factory.data.shards.energon_task_encoder import energon_task_encoder  # noqa: E402

SEQ = 128
RECIPE = {
    "name": "energon_tiny",
    "seed": 5,
    "sources": [
        {
            "name": "web",
            "path": "in/web.jsonl",
            "category": "pretrain_text",
            "weight": 2,
            "steps": [{"kind": "text"}],
        },
        {
            "name": "math",
            "path": "in/math.jsonl",
            "category": "math",
            "weight": 1,
            "steps": [{"kind": "chat"}],
        },
    ],
    "packing": {"seq_len": SEQ, "window": 16},
    "output": {"samples_per_shard": 7},
}


def _metadata(out: Path) -> dict[str, bytes]:
    """Every file Energon reads besides the tars, by relative path."""
    files = [*(out / ".nv-meta").iterdir(), *(out / "shards").glob("*.tar.idx")]
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(files)}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("energon_recipe")
    (root / "in").mkdir()
    for name, category, count, seed in (("web", "pretrain_text", 60, 1), ("math", "math", 30, 2)):
        lines = "".join(json.dumps(r) + "\n" for r in generate(category, count, seed))
        (root / "in" / f"{name}.jsonl").write_text(lines)
    (root / "recipe.yaml").write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    return root / "recipe.yaml"


@pytest.fixture(scope="module")
def built(recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("energon_out") / "data"
    build(recipe, out)
    return out


def _train_dataset(path: Path, batch_size: int | None) -> Any:
    """One pass, in order, in this process: what a test can compare sample by sample."""
    return energon.get_train_dataset(
        path,
        worker_config=energon.WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=batch_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=energon_task_encoder(),
    )


def _manifest_keys(out: Path) -> list[str]:
    """Sample keys in our reader's order: manifest shard order, then tar order."""
    manifest = json.loads((out / "manifest.json").read_text())
    return [
        f"{int(shard['name'][-10:-4]):06d}{i:06d}"
        for shard in manifest["shards"]
        for i in range(shard["samples"])
    ]


def test_the_build_writes_what_energon_prepare_writes(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3, "the recipe must span several shards"
    for shard in manifest["shards"]:
        assert (built / shard["name"].replace(".tar", ".tar.idx")).is_file()
    names = set(_metadata(built))
    for name in ("index.sqlite", "index.uuid", ".info.json", "split.yaml", "dataset.yaml"):
        assert f".nv-meta/{name}" in names
    assert check_energon_index(built) == []


def test_energon_loader_yields_every_sample_with_our_tokens(built: Path) -> None:
    tokens, mask = read_samples(built)
    keys = _manifest_keys(built)
    assert (
        len(keys)
        == len(tokens)
        == json.loads((built / "manifest.json").read_text())["packing"]["samples"]
    )
    seen = {}
    for sample in energon.get_loader(_train_dataset(built, None)):
        assert sample.__key__ not in seen
        seen[sample.__key__] = sample
    assert sorted(seen) == sorted(keys)
    for row, key in enumerate(keys):
        sample = seen[key]
        assert sample.tokens.dtype.is_floating_point is False
        np.testing.assert_array_equal(sample.tokens.numpy(), tokens[row])
        np.testing.assert_array_equal(sample.loss_mask.numpy(), mask[row])
        cu = sample.cu_seqlens.numpy()
        assert cu[0] == 0 and np.all(np.diff(cu) > 0) and cu[-1] <= SEQ
        assert len(sample.doc_keys) == len(cu) - 1


def test_energon_batches_carry_flat_cu_seqlens(built: Path) -> None:
    batch = next(iter(energon.get_loader(_train_dataset(built, 3))))
    assert tuple(batch.tokens.shape) == (3, SEQ) and tuple(batch.loss_mask.shape) == (3, SEQ)
    cu = batch.cu_seqlens.numpy()
    assert cu[0] == 0 and cu[-1] == 3 * SEQ and np.all(np.diff(cu) > 0)
    for row in range(1, 3):
        assert row * SEQ in cu, "each row starts a segment"


def test_energon_metadata_and_sqlite_readers_read_the_dataset(built: Path) -> None:
    """What ``energon info`` reads, through the library's own parsers.

    (The ``energon info`` command itself raises KeyError('sample_type') in
    7.4.1 on any crude dataset.yaml, also the one ``energon prepare`` writes.)
    """
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.indexing import SqliteIndexReader
    from megatron.energon.flavors.webdataset.metadata import (
        EnergonDatasetType,
        WebdatasetMeta,
        get_dataset_type,
    )

    keys = _manifest_keys(built)
    total = len(keys)
    path = EPath(built)
    assert get_dataset_type(path) is EnergonDatasetType.WEBDATASET
    meta = WebdatasetMeta.from_config(path, split_part="train")  # strict parse of both files
    assert sum(shard.count for shard in meta.shards) == total
    assert meta.info_shard_files == [s.name for s in meta.shards]

    reader = SqliteIndexReader(EPath(built / ".nv-meta" / "index.sqlite"))
    try:
        assert reader.get_sample_count() == total
        last = keys[-1]
        pointer = reader.get_sample_pointer_by_key(last)
        idx = np.fromfile(built / "shards" / f"shard-{last[:6]}.tar.idx", dtype="<u8")
        assert (pointer.byte_offset, pointer.byte_size) == (int(idx[-2]), int(idx[-1] - idx[-2]))
        parts = {name for name, _, _ in reader.list_sample_parts(last)}
        assert parts == {"tokens.npy", "loss_mask.npy", "cu_seqlens.npy", "json"}
    finally:
        reader.close()


def test_same_index_as_energon_prepare(built: Path, tmp_path: Path) -> None:
    """The real ``energon prepare`` on a copy rewrites the index: ours must match it."""
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    copy = tmp_path / "copy"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(".work"))
    ours = _metadata(copy)
    names = list(json.loads(ours[".nv-meta/.info.json"])["shard_counts"])
    WebdatasetPreparator.prepare_dataset(
        copy, names, split_parts_patterns=[("train", "shards/.*")], workers=1
    )
    theirs = _metadata(copy)
    for name in ours:
        if name.endswith(".tar.idx"):
            assert theirs[name] == ours[name], name

    def rows(data: bytes) -> tuple:
        path = tmp_path / "probe.sqlite"
        path.write_bytes(data)
        db = sqlite3.connect(path)
        try:
            return tuple(
                sorted(db.execute(query).fetchall())
                for query in (
                    "SELECT * FROM samples",
                    "SELECT * FROM sample_parts",
                    "SELECT type, name, tbl_name, sql FROM sqlite_master",
                )
            )
        finally:
            db.close()

    assert rows(theirs[".nv-meta/index.sqlite"]) == rows(ours[".nv-meta/index.sqlite"])
    info = json.loads(theirs[".nv-meta/.info.json"])
    assert info == json.loads(ours[".nv-meta/.info.json"])


def test_metadata_bytes_are_identical_across_builds_and_reruns(
    built: Path, recipe: Path, tmp_path: Path
) -> None:
    first = _metadata(built)
    other = tmp_path / "again"
    build(recipe, other)
    assert _metadata(other) == first

    # A rerun over finished output (the resume path) leaves every byte in place.
    (other / "shards" / "shard-000000.tar.idx").unlink()
    (other / ".nv-meta" / "index.uuid").write_text("00000000-0000-0000-0000-000000000000")
    build(recipe, other)
    assert _metadata(other) == first
    assert not [p for p in other.rglob("*") if ".tmp" in p.name]


def test_verify_flags_a_missing_or_stale_tar_index(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from factory.cli.app import main

    copy = tmp_path / "copy"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(".work"))
    assert main(["data", "verify", str(copy)]) == 0

    idx = copy / "shards" / "shard-000001.tar.idx"
    good = idx.read_bytes()
    idx.unlink()
    assert main(["data", "verify", str(copy)]) == 1
    assert "shards/shard-000001.tar.idx: missing" in capsys.readouterr().err

    offsets = np.frombuffer(good, dtype="<u8").copy()
    offsets[1] += 512  # off by one tar block: Energon would read from the wrong header
    idx.write_bytes(offsets.tobytes())
    assert main(["data", "verify", str(copy)]) == 1
    assert "shards/shard-000001.tar.idx: stale" in capsys.readouterr().err

    idx.write_bytes(good)
    (copy / ".nv-meta" / "index.uuid").write_text("not the content's uuid")
    assert main(["data", "verify", str(copy)]) == 1
    assert ".nv-meta/index.uuid: stale" in capsys.readouterr().err


def test_the_index_refuses_counts_the_tars_do_not_hold(built: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(".work"))
    info = json.loads((copy / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    names, counts = list(info), list(info.values())
    before = _metadata(copy)
    with pytest.raises(ValueError, match="samples"):
        write_energon_dataset(copy, names, [counts[0] + 1, *counts[1:]])
    assert _metadata(copy) == before, "nothing is published from a failed check"
