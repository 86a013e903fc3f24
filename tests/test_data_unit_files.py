"""The build's work files: units, sidecars and shard plans round-trip exactly, and none of
them is read as a pickle, so a planted one cannot run code (a shared output folder is a
shared trust boundary)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.stages.shard_plan import plan_path, read_plan
from factory.data.stages.unit_files import (
    CuratedDoc,
    UnitWriter,
    read_records,
    read_sidecar,
    read_unit,
    sidecar_path,
)

RAN: list[str] = []


class _RunsCode:
    """A pickle that calls ``RAN.append`` when it is loaded."""

    def __reduce__(self) -> tuple:
        return (RAN.append, ("code ran",))


def _doc(key: str, tokens: int, signed: bool, seed: int) -> CuratedDoc:
    rng = np.random.default_rng(seed)
    signature = rng.integers(0, 2**32, 8, dtype=np.uint32) if signed else None
    ids = rng.integers(-(2**31), 2**31, tokens, dtype=np.int32)
    mask = rng.integers(0, 2, tokens, dtype=np.uint8)
    return CuratedDoc(key, rng.bytes(16), signature, ids, mask)


def _write(path: Path, docs: list[CuratedDoc]) -> None:
    writer = UnitWriter(path)
    for doc in docs:
        writer.write(doc)
    writer.close({"documents": len(docs)})


def _same(a: CuratedDoc, b: CuratedDoc) -> bool:
    signatures = (a.signature is None and b.signature is None) or (
        a.signature is not None
        and b.signature is not None
        and a.signature.dtype == b.signature.dtype
        and np.array_equal(a.signature, b.signature)
    )
    return (
        a.key == b.key
        and a.content_hash == b.content_hash
        and signatures
        and a.ids.dtype == b.ids.dtype
        and np.array_equal(a.ids, b.ids)
        and a.mask.dtype == b.mask.dtype
        and np.array_equal(a.mask, b.mask)
    )


keys = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
"""Any code point, lone surrogates (JSON input may hold one) and NUL included."""


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(keys, st.integers(0, 40), st.booleans()), max_size=8),
    st.integers(0, 2**16),
)
def test_a_unit_and_its_sidecar_read_back_what_was_written(
    tmp_path_factory: pytest.TempPathFactory, records: list[tuple[str, int, bool]], seed: int
) -> None:
    path = tmp_path_factory.mktemp("unit") / "00000.bin"
    docs = [_doc(key, tokens, signed, seed + i) for i, (key, tokens, signed) in enumerate(records)]
    _write(path, docs)
    read = list(read_unit(path))
    assert len(read) == len(docs) and all(map(_same, read, docs))
    sidecar = read_sidecar(path)
    assert sidecar["keys"] == [d.key for d in docs]
    assert sidecar["lengths"].tolist() == [len(d.ids) for d in docs]
    assert sidecar["exact"].tobytes() == b"".join(d.content_hash for d in docs)
    assert sidecar["signed"].tolist() == [d.signature is not None for d in docs]
    if any(d.signature is not None for d in docs):
        for doc, row in zip(docs, sidecar["signatures"], strict=True):
            assert row.tolist() == (
                doc.signature.tolist() if doc.signature is not None else [0] * 8
            )
    else:
        assert sidecar["signatures"] is None
    by_offset = read_records(path, sidecar["offsets"].tolist()[::-1])
    assert all(
        _same(by_offset[o], d) for o, d in zip(sidecar["offsets"].tolist(), docs, strict=True)
    )


def test_records_are_writable_arrays(tmp_path: Path) -> None:
    """Pickled records used to come back writable; a reader that edits a slice in place must
    not meet a read-only buffer."""
    path = tmp_path / "00000.bin"
    _write(path, [_doc("a", 5, True, 0)])
    (doc,) = read_unit(path)
    doc.ids[0] = 7
    doc.mask[0] = 1
    assert doc.ids[0] == 7 and doc.ids.flags.aligned and doc.signature.flags.aligned


def test_a_record_cut_short_is_an_error_naming_the_unit(tmp_path: Path) -> None:
    path = tmp_path / "00000.bin"
    _write(path, [_doc("a", 30, True, 0)])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"00000\.bin: a record cut short"):
        list(read_unit(path))


def test_a_planted_pickle_is_refused_and_runs_no_code(tmp_path: Path) -> None:
    """Whoever can write the output folder can replace a work file; what replaces it is read
    as data, never unpickled."""
    RAN.clear()
    unit = tmp_path / "units" / "00000.bin"
    _write(unit, [_doc("a", 3, True, 0)])
    sidecar_path(unit).write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ValueError, match="pickled"):
        read_sidecar(unit)
    plan_path(tmp_path, 0).parent.mkdir(parents=True)
    plan_path(tmp_path, 0).write_bytes(pickle.dumps([[_RunsCode()]]))
    with pytest.raises(ValueError):
        read_plan(tmp_path, 0)
    unit.write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ValueError):
        list(read_unit(unit))
    assert RAN == []
