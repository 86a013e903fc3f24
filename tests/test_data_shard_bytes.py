"""``write_shard`` builds its tar and ``.npy`` bytes directly; they must be exactly what
``tarfile`` (USTAR) and ``np.save`` write, which is what earlier builds recorded."""

from __future__ import annotations

import hashlib
import io
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.shards.sample_format import ARRAY_FIELDS, PackedSample, json_bytes, sample_key
from factory.data.shards.tar_writer import _header, _member, write_shard


def _reference(samples: list[PackedSample], shard_index: int) -> bytes:
    """The shard as the writer built it before: ``tarfile`` members of ``np.save`` bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, sample in enumerate(samples):
            key = sample_key(shard_index, i)
            parts = []
            for ext, attr, dtype in ARRAY_FIELDS:
                npy = io.BytesIO()
                array = np.ascontiguousarray(getattr(sample, attr), dtype=dtype)
                np.save(npy, array, allow_pickle=False)
                parts.append((ext, npy.getvalue()))
            parts.append(("json", json_bytes(sample)))
            for ext, data in parts:
                tar.addfile(_member(f"{key}.{ext}", len(data)), io.BytesIO(data))
    return buffer.getvalue()


keys = st.lists(st.text(min_size=0, max_size=30), max_size=6)
sample_shapes = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 7), keys), max_size=9)


@settings(max_examples=60, deadline=None)
@given(shapes=sample_shapes, shard_index=st.integers(0, 999_999), seed=st.integers(0, 2**16))
def test_direct_bytes_equal_tarfile_and_np_save(
    shapes: list[tuple[int, int, list[str]]], shard_index: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    samples = [
        PackedSample(
            tokens=rng.integers(-(2**31), 2**31, seq, dtype=np.int64),  # cast to <i4 on write
            loss_mask=rng.integers(0, 2, seq, dtype=np.uint8),
            cu_seqlens=np.sort(rng.integers(0, seq + 1, docs + 1)).astype(np.int32),
            doc_keys=doc_keys,
        )
        for seq, docs, doc_keys in shapes
    ]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shard.tar"
        digest = write_shard(path, samples, shard_index)
        written = path.read_bytes()
    expected = _reference(samples, shard_index)
    assert written == expected
    assert digest == hashlib.sha256(expected).hexdigest()


@given(name=st.text(min_size=1, max_size=40), size=st.integers(0, 8**11 - 1))
def test_header_equals_tarfile_header(name: str, size: int) -> None:
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or "\x00" in name or not name.isprintable():
        return  # our member names are 12 digits and an extension
    expected = _member(name, size).tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    assert _header(name, size) == expected
