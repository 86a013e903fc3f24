"""``factory.runtime.loader``: order, exact resume, ranks, document ids, bounded memory, errors."""

from __future__ import annotations

import gc
import itertools
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from shard_reference import read_shard

from factory.data.build_job import build
from factory.data.loaded_recipe import load_recipe, with_seq_len
from factory.data.shards.manifest import shard_entry, write_manifest
from factory.data.shards.sample_format import PackedSample
from factory.data.shards.shard_reader import read_samples
from factory.data.shards.tar_writer import write_shard
from factory.runtime.batches import MicroBatch
from factory.runtime.loader import DataError, ShardLoader

COUNTS = (5, 3, 0, 8, 4, 6, 2)  # uneven, with an empty shard: boundaries everywhere
TOTAL = sum(COUNTS)
SEQ = 16


def _sample(rng: np.random.Generator, shard: int, i: int, seq: int) -> PackedSample:
    """tokens[0:2] = (shard, i) identify the sample; documents end before ``seq`` (padding)."""
    tokens = rng.integers(2, 1000, seq, dtype=np.int32)
    tokens[:2] = shard, i
    ends = np.sort(rng.choice(np.arange(3, seq), size=int(rng.integers(1, 4)), replace=False))
    return PackedSample(
        tokens=tokens,
        loss_mask=rng.integers(0, 2, seq, dtype=np.uint8),
        cu_seqlens=np.concatenate([[0], ends]).astype(np.int32),
        doc_keys=[f"d{j}" for j in range(ends.size)],
    )


def write_dataset(root: Path, counts: tuple[int, ...] | list[int], seq: int) -> Path:
    """Shards written as the data build writes them, and their manifest."""
    rng = np.random.default_rng(len(counts))
    entries = []
    for shard, count in enumerate(counts):
        name = f"shards/shard-{shard:06d}.tar"
        samples = [_sample(rng, shard, i, seq) for i in range(count)]
        entries.append(shard_entry(name, write_shard(root / name, samples, shard), count))
    write_manifest(root, {"shards": entries})
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("loader"), COUNTS, SEQ)


def reference(seed: int, epochs: int) -> list[tuple[int, int]]:
    """The module docstring's order scheme, written out independently of the loader."""
    stream = []
    for epoch in range(epochs):
        for shard in np.random.default_rng([seed, epoch]).permutation(len(COUNTS)):
            within = np.random.default_rng([seed, epoch, int(shard)]).permutation(COUNTS[shard])
            stream += [(int(shard), int(i)) for i in within]
    return stream


def ids(batches: list[MicroBatch]) -> list[tuple[int, int]]:
    """(shard, index) of every sample of ``batches``, in order."""
    return [(int(row[0]), int(row[1])) for b in batches for row in b.input_ids]


def take(loader: ShardLoader, n: int) -> list[MicroBatch]:
    return list(itertools.islice(loader, n))


def test_stream_follows_the_documented_order_across_epochs(data: Path) -> None:
    with ShardLoader(data, 3, seed=5) as loader:
        got = ids(take(loader, 3 * TOTAL // 3 + 4))
    assert got == reference(5, 4)[: len(got)]
    for epoch in range(3):
        assert sorted(got[epoch * TOTAL : (epoch + 1) * TOTAL]) == sorted(reference(0, 1))


def test_same_seed_same_stream_other_seed_other_stream(data: Path) -> None:
    def stream(seed: int) -> list[MicroBatch]:
        with ShardLoader(data, 4, seed=seed) as loader:
            return take(loader, 20)

    first, again, other = stream(1), stream(1), stream(2)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.document_ids, b.document_ids)
    assert ids(first) != ids(other)


def test_unshuffled_order_is_the_manifests(data: Path) -> None:
    with ShardLoader(data, 2, shuffle=False) as loader:
        got = ids(take(loader, TOTAL // 2))
    assert got == [(s, i) for s, count in enumerate(COUNTS) for i in range(count)]


@pytest.mark.parametrize("start", [0, 1, 5, 8, 16, TOTAL - 1, TOTAL, TOTAL + 7, 3 * TOTAL + 2])
def test_seek_equals_the_uninterrupted_stream(data: Path, start: int) -> None:
    with ShardLoader(data, 3, seed=9) as loader:
        loader.seek(start)
        assert loader.position == start
        got = ids(take(loader, 12))
    assert got == reference(9, 6)[start : start + 36]


def test_state_dict_restores_exactly_and_counts_only_yielded_samples(data: Path) -> None:
    with ShardLoader(data, 3, seed=4, prefetch=8) as loader:
        take(loader, 5)
        time.sleep(0.2)  # let the prefetch queue fill well past what was consumed
        state = loader.state_dict()
        assert state["consumed"] == 15 and loader.epoch == 0
        rest = ids(take(loader, 10))
    with ShardLoader(data, 3, seed=4) as resumed:
        resumed.load_state_dict(state)
        assert ids(take(resumed, 10)) == rest
    with ShardLoader(data, 3, seed=5) as other, pytest.raises(ValueError, match="seed=4"):
        other.load_state_dict(state)


def test_skip_advances_without_yielding(data: Path) -> None:
    with ShardLoader(data, 2, seed=3) as loader:
        take(loader, 1)
        loader.skip(TOTAL + 5)
        assert loader.position == TOTAL + 7
        got = ids(take(loader, 2))
    assert got == reference(3, 3)[TOTAL + 7 : TOTAL + 11]


def test_ranks_interleave_into_the_global_stream(data: Path) -> None:
    world, micro, steps = 3, 2, 11
    streams = []
    for rank in range(world):
        with ShardLoader(data, micro, seed=8, rank=rank, world_size=world) as loader:
            streams.append(ids(take(loader, steps)))
            assert loader.position == steps * micro * world  # every rank agrees
    window = micro * world  # rank r takes the r-th block of `micro` samples of each window
    merged = [
        streams[g // micro % world][g // window * micro + g % micro]
        for g in range(steps * micro * world)
    ]
    assert merged == reference(8, 4)[: len(merged)]


def test_document_ids_come_from_cu_seqlens(data: Path) -> None:
    with ShardLoader(data, 4, seed=0) as loader:
        batches = take(loader, TOTAL // 4)
    stored = {(s, i): x for s in range(len(COUNTS)) for i, x in enumerate(_shard(data, s))}
    for batch in batches:
        assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
        assert batch.document_ids is not None and batch.document_ids.dtype == torch.int64
        assert batch.targets.shape == batch.target_mask.shape == (4, SEQ - 1)
        assert batch.num_tokens == 4 * SEQ
        for row, docs, mask in zip(
            batch.input_ids, batch.document_ids, batch.loss_mask, strict=True
        ):
            sample = stored[(int(row[0]), int(row[1]))]
            expected = [sum(p >= int(end) for end in sample.cu_seqlens[1:]) for p in range(SEQ)]
            assert docs.tolist() == expected  # padding past the last bound is one more document
            assert row.tolist() == sample.tokens.tolist()
            assert mask.tolist() == sample.loss_mask.astype(bool).tolist()


def _shard(root: Path, shard: int) -> list[PackedSample]:
    """The tests' tarfile-based reader (``shard_reference``): an independent check of ours."""
    return read_shard(root / f"shards/shard-{shard:06d}.tar")


def _streaming_peak(root: Path, shards: int, micro: int) -> int:
    """Peak traced bytes while streaming one epoch, over what the constructed loader holds
    (its shard list is manifest metadata: a few hundred bytes per shard, no samples)."""
    threads = torch.get_num_threads()
    # One intra-op thread: per-row torch.searchsorted (document ids) is ~20x slower with more.
    torch.set_num_threads(1)
    tracemalloc.start()
    try:
        with ShardLoader(root, micro, seed=0, prefetch=4) as loader:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for _ in range(shards * 16 // micro):
                next(loader)
            return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        torch.set_num_threads(threads)


def test_memory_stays_bounded_however_many_shards(tmp_path: Path) -> None:
    seq, micro = 256, 4
    small = write_dataset(tmp_path / "small", [16] * 20, seq)
    large = write_dataset(tmp_path / "large", [16] * 200, seq)
    shard_bytes = (large / "shards/shard-000000.tar").stat().st_size
    batch_bytes = micro * seq * (8 + 1)  # int64 ids + bool mask (document ids are torch's)
    bound = 2 * shard_bytes + (4 + 2) * batch_bytes + 64 * 1024
    peaks = [_streaming_peak(root, n, micro) for root, n in ((small, 20), (large, 200))]
    assert max(peaks) < bound, (peaks, bound)
    assert peaks[1] < peaks[0] + shard_bytes, peaks  # 10x the data, not 10x the memory
    assert 200 * shard_bytes > 40 * bound  # the dataset is far larger than the window


def test_close_and_garbage_collection_stop_the_prefetch_thread(data: Path) -> None:
    loader = ShardLoader(data, 2)
    next(loader)
    thread = loader._slot[0].thread
    loader.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)
    dropped = ShardLoader(data, 2)
    next(dropped)
    thread = dropped._slot[0].thread
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_missing_manifest_or_shard_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no manifest\.json"):
        ShardLoader(tmp_path, 2)
    root = write_dataset(tmp_path / "d", [4, 4], SEQ)
    (root / "shards/shard-000001.tar").unlink()
    with pytest.raises(DataError, match=r"shard-000001\.tar.*missing"):
        ShardLoader(root, 2)


@pytest.mark.parametrize(
    ("cut", "why"), [(10_001, "not a whole tar"), (32 * 1024, "no end-of-archive marker")]
)
def test_truncated_shard_is_a_data_error(tmp_path: Path, cut: int, why: str) -> None:
    root = write_dataset(tmp_path, [4, 4], 1024)  # 40 KiB shards
    path = root / "shards/shard-000000.tar"
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(DataError, match=f"shard-000000.tar.*{why}.*truncated"):
        ShardLoader(root, 2)


def _count_lies(root: Path) -> None:
    write_manifest(root, {"shards": [shard_entry("shards/shard-000000.tar", "0" * 64, 3)]})


def _header_damaged(root: Path) -> None:
    path = root / "shards/shard-000000.tar"
    data = bytearray(path.read_bytes())
    data[4096 + 3] ^= 1  # a byte of the second sample's first member name
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [(_count_lies, "4 samples, the manifest lists 3"), (_header_damaged, "bad tar header")],
)
def test_damage_found_while_streaming_surfaces_in_the_consumer(
    tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    root = write_dataset(tmp_path, [4], SEQ)
    damage(root)
    with ShardLoader(root, 2) as loader, pytest.raises(DataError, match=message):
        next(loader)  # raised in the prefetch thread, re-raised here


def test_verify_rehashes_every_shard(tmp_path: Path) -> None:
    root = write_dataset(tmp_path, [4, 4], SEQ)
    path = root / "shards/shard-000001.tar"
    data = bytearray(path.read_bytes())
    data[512 + 128] ^= 1  # one bit of the first token: same size, same structure
    path.write_bytes(bytes(data))
    ShardLoader(root, 2).close()  # the cheap checks cannot see it
    with pytest.raises(DataError, match="differ from the manifest's sha256: shards/shard-000001"):
        ShardLoader(root, 2, verify=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped Nano recipe, built by the data pipeline at 512 tokens (a few seconds)."""
    out = tmp_path_factory.mktemp("nano-data")
    build(with_seq_len(load_recipe("nano"), 512), out)
    return out


def test_a_real_build_streams_as_the_in_memory_reader_reads_it(built: Path) -> None:
    tokens, mask = read_samples(built)
    micro = 7
    with ShardLoader(built, micro, shuffle=False, verify=True) as loader:
        assert loader.samples_per_epoch == len(tokens)
        batches = take(loader, -(-len(tokens) // micro))
    streamed = torch.cat([b.input_ids for b in batches])[: len(tokens)]
    assert torch.equal(streamed, torch.from_numpy(tokens))
    assert torch.equal(
        torch.cat([b.loss_mask for b in batches])[: len(tokens)], torch.from_numpy(mask)
    )
    first = read_shard(built / "shards/shard-000000.tar")[0]
    ends = torch.as_tensor(first.cu_seqlens[1:].astype(np.int64))
    expected = torch.searchsorted(ends, torch.arange(512), right=True)
    assert torch.equal(batches[0].document_ids[0], expected)
