"""Shard sinks: byte-identical tars, webdataset readability, verification, Energon and Megatron files."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
import yaml
from shard_reference import read_shard

from factory.data.shards.energon_metadata import write_energon_metadata
from factory.data.shards.manifest import sha256_file, shard_entry, verify, write_manifest
from factory.data.shards.megatron_index import MAGIC, IndexedDatasetWriter, read_indexed
from factory.data.shards.sample_format import PackedSample
from factory.data.shards.tar_writer import write_shard
from factory.data.stages.packing import TokenizedDoc, pack_best_fit_decreasing


def make_samples(n_docs: int = 40, seq_len: int = 64, seed: int = 0) -> list[PackedSample]:
    rng = np.random.default_rng(seed)
    docs = [
        TokenizedDoc(
            f"src:{i}",
            rng.integers(0, 1000, size=int(n), dtype=np.int32),
            rng.integers(0, 2, size=int(n), dtype=np.uint8),
        )
        for i, n in enumerate(rng.integers(1, 80, size=n_docs))
    ]
    return list(pack_best_fit_decreasing(docs, seq_len, window=16))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


def test_shards_are_byte_identical_on_rewrite(tmp_path: Path) -> None:
    samples = make_samples()
    first = write_shard(tmp_path / "a" / "shard-000007.tar", samples, 7)
    second = write_shard(tmp_path / "b" / "shard-000007.tar", make_samples(), 7)
    again = write_shard(tmp_path / "a" / "shard-000007.tar", samples, 7)
    assert first == second == again == sha256_file(tmp_path / "a" / "shard-000007.tar")
    assert (tmp_path / "a" / "shard-000007.tar").read_bytes() == (
        tmp_path / "b" / "shard-000007.tar"
    ).read_bytes()
    assert write_shard(tmp_path / "c.tar", samples, 8) != first, "the key carries the shard index"
    assert leftovers(tmp_path) == []


def test_tar_layout_is_pinned(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"
    write_shard(path, make_samples()[:2], 3)
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:4]] == [
        "000003000000.tokens.npy",
        "000003000000.loss_mask.npy",
        "000003000000.cu_seqlens.npy",
        "000003000000.json",
    ]
    assert members[4].name == "000003000001.tokens.npy"
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
        assert m.isreg()


def test_webdataset_reads_the_shard(tmp_path: Path) -> None:
    samples = make_samples()
    path = tmp_path / "shard-000000.tar"
    write_shard(path, samples, 0)
    read = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert len(read) == len(samples)
    for i, (got, want) in enumerate(zip(read, samples, strict=True)):
        assert got["__key__"] == f"000000{i:06d}"
        np.testing.assert_array_equal(got["tokens.npy"], want.tokens)
        assert got["tokens.npy"].dtype == np.int32
        np.testing.assert_array_equal(got["loss_mask.npy"], want.loss_mask)
        np.testing.assert_array_equal(got["cu_seqlens.npy"], want.cu_seqlens)
        assert got["json"] == {"doc_keys": want.doc_keys}
    back = read_shard(path)
    assert [s.doc_keys for s in back] == [s.doc_keys for s in samples]


def test_failed_write_leaves_no_temp_and_keeps_the_old_shard(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    good = write_shard(path, make_samples(), 0)
    broken = PackedSample(
        tokens=np.array(["not", "ids"], dtype=object),
        loss_mask=np.zeros(2, np.uint8),
        cu_seqlens=np.zeros(1, np.int32),
        doc_keys=[],
    )
    with pytest.raises((ValueError, TypeError)):
        write_shard(path, [*make_samples(), broken], 0)
    assert sha256_file(path) == good
    assert leftovers(tmp_path) == []


def test_verify_catches_a_flipped_byte_and_a_missing_shard(tmp_path: Path) -> None:
    names = ["shards/shard-000000.tar", "shards/shard-000001.tar"]
    entries = []
    for index, name in enumerate(names):
        samples = make_samples(seed=index)
        entries.append(
            shard_entry(name, write_shard(tmp_path / name, samples, index), len(samples))
        )
    write_manifest(tmp_path, {"shards": entries, "recipe": "toy"})
    assert verify(tmp_path) == []

    manifest_text = (tmp_path / "manifest.json").read_text()
    assert json.loads(manifest_text)["shards"][0]["name"] == names[0]
    assert manifest_text == json.dumps(json.loads(manifest_text), sort_keys=True, indent=2) + "\n"

    target = tmp_path / names[1]
    data = bytearray(target.read_bytes())
    data[len(data) // 3] ^= 0x01
    target.write_bytes(bytes(data))
    assert verify(tmp_path) == [names[1]]

    (tmp_path / names[0]).unlink()
    assert verify(tmp_path) == names


def test_verify_rejects_entries_outside_the_output(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"shards": [{"name": "../x.tar", "sha256": "0" * 64}, "junk"]})
    assert verify(tmp_path) == ["../x.tar", "<shards[1]>"]


def test_energon_metadata(tmp_path: Path) -> None:
    names = ["shards/shard-000000.tar", "shards/shard-000001.tar"]
    write_energon_metadata(tmp_path, names, [5, 3])
    meta = tmp_path / ".nv-meta"
    dataset = yaml.safe_load((meta / "dataset.yaml").read_text())
    assert dataset == {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    split = yaml.safe_load((meta / "split.yaml").read_text())
    assert split == {"exclude": [], "split_parts": {"train": names, "val": [], "test": []}}
    info = json.loads((meta / ".info.json").read_text())
    assert info["shard_counts"] == {names[0]: 5, names[1]: 3}
    assert list(info["shard_counts"]) == names, "shard order is part of the dataset"
    assert isinstance(info["energon_version"], str)

    before = {p.name: p.read_bytes() for p in meta.iterdir()}
    write_energon_metadata(tmp_path, names, [5, 3])
    assert {p.name: p.read_bytes() for p in meta.iterdir()} == before
    assert leftovers(tmp_path) == []

    write_energon_metadata(tmp_path, names, [5, 3], subflavors={"source": "sft"})
    assert yaml.safe_load((meta / "dataset.yaml").read_text())["subflavors"] == {"source": "sft"}
    with pytest.raises(ValueError):
        write_energon_metadata(tmp_path, names, [5])
    with pytest.raises(ValueError):
        write_energon_metadata(tmp_path, ["../escape.tar"], [1])


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(32000, np.uint16), (131072, np.int32), (None, np.int32)]
)
def test_megatron_index_round_trip(tmp_path: Path, vocab_size: int | None, dtype: type) -> None:
    rng = np.random.default_rng(0)
    limit = vocab_size or 2**31 - 1
    docs = [rng.integers(0, limit, size=int(n)) for n in [5, 0, 17, 1, 300]]
    prefix = tmp_path / "out" / "text_document"
    with IndexedDatasetWriter(prefix, vocab_size=vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)
    back = read_indexed(prefix)
    assert len(back) == len(docs)
    for got, want in zip(back, docs, strict=True):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)

    idx = (tmp_path / "out" / "text_document.idx").read_bytes()
    assert idx.startswith(MAGIC)
    header = np.frombuffer(idx[len(MAGIC) :][:8], "<u8")[0], idx[len(MAGIC) + 8]
    assert header == (1, 8 if dtype is np.uint16 else 4)
    assert (tmp_path / "out" / "text_document.bin").stat().st_size == sum(
        map(len, docs)
    ) * np.dtype(dtype).itemsize
    assert leftovers(tmp_path) == []


def test_megatron_writer_rejects_out_of_vocab_and_cleans_up(tmp_path: Path) -> None:
    prefix = tmp_path / "bad"
    with (
        pytest.raises(ValueError, match="token ids"),
        IndexedDatasetWriter(prefix, vocab_size=100) as writer,
    ):
        writer.add_document([1, 2, 100])
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()
    assert leftovers(tmp_path) == []
