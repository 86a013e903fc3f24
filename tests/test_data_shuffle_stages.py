"""The distributed stages' functions, run in order in this process (no Ray), against the
local stages: the shuffle dedup keeps exactly what the sequential indexes keep, and shards
planned from lengths and written one by one are the local writer's bytes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.shards.tar_writer import write_shard
from factory.data.stages.dedup import dedup_units, read_keep_mask
from factory.data.stages.dedup_shuffle import map_unit, mask_unit, reduce_partition, resolve_groups
from factory.data.stages.mixed_stream import MixedStream
from factory.data.stages.mixing import SourcePlan
from factory.data.stages.packing import PackingStats, pack_best_fit_decreasing
from factory.data.stages.shard_plan import plan_shards
from factory.data.stages.unit_files import CuratedDoc, UnitWriter
from factory.data.stages.write_shards import write_planned_shard
from factory.schemas.data_recipe import DedupConfig

BANDS, ROWS = 4, 2
BASES = np.random.default_rng(0).integers(0, 2**32, size=(5, BANDS * ROWS), dtype=np.uint32)

# One document: (exact-hash id, base signature or None, bands replaced at random, length)
doc_strategy = st.tuples(
    st.integers(0, 7),
    st.one_of(st.none(), st.integers(0, 4)),
    st.integers(0, 15),
    st.integers(0, 40),
)
corpus_strategy = st.lists(st.lists(doc_strategy, max_size=12), min_size=1, max_size=5)


def _write_units(root: Path, corpus: list[list[tuple]], seed: int = 1) -> list[Path]:
    rng = np.random.default_rng(seed)
    units = []
    for u, docs in enumerate(corpus):
        path = root / f"u{u:03d}.bin"
        writer = UnitWriter(path)
        for r, (exact, base, noisy, length) in enumerate(docs):
            signature = None
            if base is not None:
                signature = BASES[base].copy()
                for band in range(BANDS):
                    if noisy >> band & 1:
                        signature[band * ROWS : (band + 1) * ROWS] = rng.integers(0, 2**32, ROWS)
            ids = rng.integers(0, 100, length, dtype=np.int32)
            mask = (rng.random(length) < 0.8).astype(np.uint8)
            digest = exact.to_bytes(16, "little")
            writer.write(CuratedDoc(f"d{u}-{r}", digest, signature, ids, mask))
        writer.close({})
        units.append(path)
    return units


def _shuffle_dedup(units: list[Path], config: DedupConfig, work: Path, partitions: int) -> list:
    for i, unit in enumerate(units):
        map_unit(unit, i, config, work, partitions)
    for p in range(partitions):
        reduce_partition(work, p)
    resolve_groups(work, partitions)
    return [mask_unit(unit, i, work) for i, unit in enumerate(units)]


@settings(max_examples=40, deadline=None)
@given(corpus=corpus_strategy, partitions=st.integers(1, 4), exact=st.booleans())
def test_shuffle_dedup_keeps_what_the_sequential_indexes_keep(
    corpus: list[list[tuple]], partitions: int, exact: bool
) -> None:
    config = DedupConfig(exact=exact, minhash=True, bands=BANDS, rows=ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local = _write_units(root / "local", corpus)
        shuffled = _write_units(root / "shuffled", corpus)
        expected = dedup_units(local, config, root / "dedup.json")
        counts = _shuffle_dedup(shuffled, config, root / "work", partitions)
        for a, b, row in zip(local, shuffled, counts, strict=True):
            assert row == expected[str(a)]
            np.testing.assert_array_equal(read_keep_mask(a), read_keep_mask(b))


def test_a_near_duplicate_of_a_dropped_document_is_kept_as_locally() -> None:
    """No transitive clustering: A ~ B ~ C with A !~ C keeps A and C when B came second."""
    # Bits set are bands drawn at random: B shares band 0 with A and band 1 with C;
    # A and C share none.
    a, b, c = (0, 0, 0b1110, 5), (1, 0, 0b1100, 5), (2, 0, 0b1101, 5)
    corpus = [[a], [b], [c]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        units = _write_units(root / "u", corpus)
        counts = _shuffle_dedup(units, DedupConfig(bands=BANDS, rows=ROWS), root / "w", 2)
        assert [n["near_duplicates"] for n in counts] == [0, 1, 0]


def _streamed(
    stream: MixedStream, out: Path, seq_len: int, window: int, per_shard: int
) -> tuple[list[str], PackingStats]:
    """The one-pass reference: pack the documents with their tokens, write shards in turn."""
    stats = PackingStats()
    samples = list(pack_best_fit_decreasing(stream, seq_len, window=window, pad_id=0, stats=stats))
    (out / "shards").mkdir(parents=True, exist_ok=True)
    digests = [
        write_shard(out / f"shards/shard-{i:06d}.tar", samples[lo : lo + per_shard], i)
        for i, lo in enumerate(range(0, len(samples), per_shard))
    ]
    return digests, stats


def test_shards_planned_from_lengths_are_the_streamed_packers_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    corpus = [[(int(rng.integers(0, 10**6)), None, 0, int(n)) for n in rng.integers(0, 300, 40)]]
    corpus += [[(int(rng.integers(0, 10**6)), None, 0, int(n)) for n in rng.integers(0, 60, 30)]]
    config = DedupConfig(bands=BANDS, rows=ROWS)
    roots = {}
    for name in ("local", "planned"):
        units = _write_units(tmp_path / name / ".work", corpus, seed=7)
        roots[name] = units
    dedup_units(roots["local"], config, tmp_path / "local" / ".work" / "dedup.json")
    _shuffle_dedup(roots["planned"], config, tmp_path / "planned" / ".work" / "shuffle", 3)
    # one source up-sampled (copies keyed key#1), one down-sampled
    plans = {"a": SourcePlan(1000, 1700), "b": SourcePlan(1000, 600)}
    seq_len, window, per_shard = 128, 16, 5

    def by_source(units: list[Path]) -> dict[str, list[Path]]:
        return {"a": [units[0]], "b": [units[1]]}

    local_stream = MixedStream(by_source(roots["local"]), plans, seed=9)
    digests, stats = _streamed(local_stream, tmp_path / "local", seq_len, window, per_shard)
    work = tmp_path / "planned" / ".work"
    summary = plan_shards(
        by_source(roots["planned"]), roots["planned"], plans, 9, seq_len, window, per_shard, work
    )
    planned = [
        write_planned_shard(tmp_path / "planned", work, i, roots["planned"], seq_len, 0)
        for i in range(len(summary["samples"]))
    ]
    assert stats.split_documents > 0 and len(digests) > 2
    assert [r["sha256"] for r in planned] == digests
    planned_stats = PackingStats(**summary["packing"])
    planned_stats.loss_tokens = sum(r["loss_tokens"] for r in planned)
    assert planned_stats == stats
    assert summary["emitted"] == local_stream.emitted
    for receipt in planned:
        a = (tmp_path / "local" / receipt["name"]).read_bytes()
        assert a == (tmp_path / "planned" / receipt["name"]).read_bytes()
