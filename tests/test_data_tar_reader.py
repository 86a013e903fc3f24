"""The one tar reader against tarfile: the header walk finds tarfile's members, or steps aside
and tarfile reads the archive; damage is named where the walk finds it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from factory.data.shards.energon_index import scan_shard
from factory.data.shards.sample_format import PackedSample
from factory.data.shards.tar_reader import (
    DamagedTar,
    TarListing,
    _NotPlainUstar,
    _tarfile_listing,
    _walk,
    file_listing,
    tar_listing,
)
from factory.data.shards.tar_writer import write_shard

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
names = st.text(st.characters(blacklist_characters="\0/", codec="utf-8"), min_size=1, max_size=120)


def walked(path: Path) -> TarListing | None:
    """The header walk's listing, or None where it steps aside (another format, or damage)."""
    try:
        return _walk(path.read_bytes())
    except (_NotPlainUstar, DamagedTar):
        return None


def by_tarfile(path: Path) -> TarListing:
    return _tarfile_listing(path)


def _tar(path: Path, members: list[tuple[str, int]], form: int) -> None:
    with tarfile.open(path, "w", format=form) as tar:
        for name, size in members:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(range(256)) * (size // 256 + 1)))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(names, st.integers(0, 3000)), max_size=8),
    st.sampled_from(sorted(FORMATS)),
)
def test_members_equal_tarfile_or_the_reader_steps_aside(
    tmp_path_factory: pytest.TempPathFactory, members: list[tuple[str, int]], form: str
) -> None:
    path = tmp_path_factory.mktemp("tar") / "x.tar"
    try:
        _tar(path, members, FORMATS[form])
    except ValueError:  # USTAR cannot hold a long name that no "/" splits: nothing to read
        assume(False)
    found = walked(path)
    if found is not None:  # long, non-ASCII or PAX names make tarfile's job of it
        assert found == by_tarfile(path)
    if form == "ustar" and all(len(n.encode()) <= 100 for n, _ in members):
        assert found is not None
    # Either way, both entry points give tarfile's members.
    assert tar_listing(path.read_bytes()) == file_listing(path) == by_tarfile(path)


def test_our_shards_are_read_without_tarfile(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [
        PackedSample(
            tokens=rng.integers(0, 1000, 64, dtype=np.int64),
            loss_mask=np.ones(64, np.uint8),
            cu_seqlens=np.array([0, 30, 64], np.int32),
            doc_keys=["a", "b"],
        )
        for _ in range(5)
    ]
    path = tmp_path / "shard-000003.tar"
    write_shard(path, samples, 3)
    found = walked(path)
    assert found is not None and found == by_tarfile(path)
    assert len(scan_shard(path, "shards/shard-000003.tar").samples) == 5


def test_damaged_or_truncated_archives_go_to_tarfile(tmp_path: Path) -> None:
    path = tmp_path / "x.tar"
    _tar(path, [("a.bin", 700), ("b.bin", 3)], tarfile.USTAR_FORMAT)
    data = bytearray(path.read_bytes())
    assert walked(path) is not None
    flipped = bytearray(data)
    flipped[1536 + 10] ^= 0x01  # a byte of the second member's name: its checksum fails
    path.write_bytes(bytes(flipped))
    assert walked(path) is None
    path.write_bytes(bytes(data[:2048]))  # cut before the end-of-archive blocks
    assert walked(path) is None
    path.write_bytes(b"")
    assert walked(path) is None


def test_damage_is_named_at_the_first_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "x.tar"
    _tar(path, [("a.bin", 700), ("b.bin", 3), ("c.bin", 10)], tarfile.USTAR_FORMAT)
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[1536 + 10] ^= 0x01  # the second member's name
    flipped[1536 + 124] = ord("9")  # ... and its size, no longer octal: the checksum is first
    with pytest.raises(DamagedTar, match=r"bad tar header checksum at byte 1536$"):
        tar_listing(bytes(flipped))
    with pytest.raises(DamagedTar, match=r"truncated inside member at byte 512$"):
        tar_listing(bytes(data[:1024]))
    with pytest.raises(DamagedTar, match=r"truncated at byte 2560 \(no end-of-archive marker\)"):
        tar_listing(bytes(data[:2560]))
    whole = tar_listing(bytes(data))
    assert [m.name for m in whole.members] == ["a.bin", "b.bin", "c.bin"] and whole.end == 3584
    lone = bytes(data[:3584]) + bytes(512) + bytes(data[:512])  # one zero block, then more
    with pytest.raises(DamagedTar, match=r"bad tar header checksum at byte 3584$"):
        tar_listing(lone)
    path.write_bytes(lone)  # tarfile, the reference, ends the archive at the zero block
    assert file_listing(path) == whole
