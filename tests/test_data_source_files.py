"""Source files: every input kind streams records with stable keys; bad lines are quarantined."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.data.steps.records import RawRecord
from factory.data.steps.source_files import Quarantined, expand_source_paths, iter_records

GOOD = [{"text": "alpha", "n": 1}, {"text": "beta", "n": 2}, {"text": "gamma", "n": 3}]
# Line 1 good, 2 blank, 3 bad UTF-8, 4 good, 5 malformed, 6 a list, 7 a string, 8 good.
MIXED_LINES = [
    json.dumps(GOOD[0]).encode(),
    b"",
    b'{"text": "caf\xe9"}',
    json.dumps(GOOD[1]).encode(),
    b'{"text": "unterminated',
    b"[1, 2, 3]",
    b'"just a string"',
    json.dumps(GOOD[2], ensure_ascii=False).encode(),
]


def _read(path: Path) -> tuple[list[RawRecord], list[Quarantined]]:
    items = list(iter_records(path, "src", "pretrain_text", 7))
    records = [i for i in items if isinstance(i, RawRecord)]
    bad = [i for i in items if isinstance(i, Quarantined)]
    assert len(records) + len(bad) == len(items)
    return records, bad


def _check_mixed(path: Path) -> None:
    records, bad = _read(path)
    assert [r.data for r in records] == GOOD
    assert [r.key for r in records] == ["src:7:1", "src:7:4", "src:7:8"]
    assert all(r.source == "src" and r.category == "pretrain_text" for r in records)
    assert [(q.key, q.reason) for q in bad] == [
        ("src:7:3", "bad_utf8"),
        ("src:7:5", "malformed_json"),
        ("src:7:6", "not_an_object"),
        ("src:7:7", "not_an_object"),
    ]
    assert "caf" in bad[0].raw and bad[1].raw == '{"text": "unterminated'


def test_jsonl_quarantines_bad_lines_and_reads_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\n".join(MIXED_LINES) + b"\n")
    _check_mixed(path)


def test_jsonl_gz_is_read_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b"\r\n".join(MIXED_LINES)))  # CRLF and no final newline
    _check_mixed(path)


def test_truncated_gzip_keeps_earlier_lines(tmp_path: Path) -> None:
    body = b"".join(json.dumps({"text": f"line {i}" * 50}).encode() + b"\n" for i in range(200))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(body)[:-200])
    records, bad = _read(path)
    assert 0 < len(records) < 200
    assert [r.key for r in records] == [f"src:7:{i}" for i in range(1, len(records) + 1)]
    assert [q.reason for q in bad] == ["truncated_gzip"]


def test_pathological_json_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    lines = [b"[" * 100_000, b'{"n": ' + b"9" * 5000 + b"}", json.dumps(GOOD[0]).encode()]
    path.write_bytes(b"\n".join(lines))
    records, bad = _read(path)
    assert [r.data for r in records] == [GOOD[0]]
    assert [q.reason for q in bad] == ["malformed_json", "malformed_json"]


def test_a_gz_name_on_plain_text_is_quarantined_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl.gz"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n")
    records, bad = _read(path)
    assert not records and [(q.key, q.reason) for q in bad] == [("src:7:1", "bad_gzip")]


def test_byte_order_mark_on_first_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\n")
    records, bad = _read(path)
    assert [r.data for r in records] == [GOOD[0]] and not bad


def test_parquet_streams_across_batches(tmp_path: Path) -> None:
    rows = [{"text": f"doc {i}", "meta": {"i": i}} for i in range(2500)]  # > 2 batches
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    records, bad = _read(path)
    assert not bad
    assert [r.data for r in records] == rows
    assert records[0].key == "src:7:0" and records[-1].key == "src:7:2499"


def test_datasets_directory(tmp_path: Path) -> None:
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "id": i} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert expand_source_paths(tmp_path / "ds") == [tmp_path / "ds"]
    records, bad = _read(tmp_path / "ds")
    assert not bad
    assert [r.data for r in records] == rows
    assert [r.key for r in records] == [f"src:7:{i}" for i in range(5)]


def test_dataset_dict_expands_to_one_input_per_split(tmp_path: Path) -> None:
    import datasets

    split = datasets.Dataset.from_list([{"text": "x"}])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    paths = expand_source_paths(tmp_path / "dd")
    assert paths == [tmp_path / "dd" / "test", tmp_path / "dd" / "train"]
    with pytest.raises(ValueError, match="DatasetDict"):
        list(iter_records(tmp_path / "dd", "src", "pretrain_text", 0))


def test_expand_source_paths_is_sorted_and_filtered(tmp_path: Path) -> None:
    for name in [
        "b.jsonl",
        "a.parquet",
        "sub/c.jsonl.gz",
        "sub/z.jsonl",
        "notes.txt",
        ".hid.jsonl",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    expected = [tmp_path / n for n in ["a.parquet", "b.jsonl", "sub/c.jsonl.gz", "sub/z.jsonl"]]
    assert expand_source_paths(tmp_path) == expected
    assert expand_source_paths(tmp_path / "b.jsonl") == [tmp_path / "b.jsonl"]
    assert expand_source_paths(tmp_path / "**" / "*.jsonl*") == [
        tmp_path / "b.jsonl",
        tmp_path / "sub/c.jsonl.gz",
        tmp_path / "sub/z.jsonl",
    ]


def test_expand_source_paths_finds_nothing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    assert expand_source_paths(tmp_path / "missing.jsonl") == []
    assert expand_source_paths(tmp_path / "*.parquet") == []
    assert expand_source_paths(tmp_path / "notes.txt") == []
    assert expand_source_paths(tmp_path) == []


@pytest.mark.parametrize("content", [b"PAR1 but no footer" * 20, b""], ids=["random", "empty"])
def test_a_corrupt_parquet_is_quarantined_like_a_corrupt_gzip(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "bad.parquet"
    path.write_bytes(content)
    records, bad = _read(path)
    assert not records and [(q.key, q.reason) for q in bad] == [("src:7:0", "bad_parquet")]


def test_a_symlink_loop_is_walked_once_and_each_file_read_once(tmp_path: Path) -> None:
    (tmp_path / "data" / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.jsonl"):
        (tmp_path / "data" / name).write_bytes(b"")
    (tmp_path / "data" / "loop").symlink_to(".")  # followed, it nests 40 levels deep
    (tmp_path / "data" / "z.jsonl").symlink_to("a.jsonl")
    expected = [tmp_path / "data" / "a.jsonl", tmp_path / "data" / "sub" / "b.jsonl"]
    assert expand_source_paths(tmp_path / "data") == expected
    # A glob that reaches one file by two names gives it once, under the first name.
    assert expand_source_paths(tmp_path / "data" / "*.jsonl") == expected[:1]
