"""Stream raw records out of source files, one record at a time.

Every supported kind is read incrementally (jsonl line by line, parquet batch
by batch, a ``datasets`` directory through its memory-mapped Arrow files), so
a multi-gigabyte source never has to fit in memory.

Keys are ``{source}:{file_index}:{position}`` where the position is the
1-based physical line for jsonl (blank lines count, so keys stay put when a
file is edited elsewhere) and the 0-based row for parquet and ``datasets``.
They are the same on every run and machine, which is what resume and the
deterministic reasoning choices in ``formatting`` key on.

One bad jsonl line (bad UTF-8, malformed JSON, a JSON value that is not an
object) is yielded as a :class:`Quarantined` instead of raising: one corrupt
line in a 10 GB crawl dump must not cost the other records. A file whose
bytes are corrupt (a gzip cut short, a parquet file that is not one, or empty)
is quarantined the same way, from the point where it breaks, so a source's
corrupt files are counted in the manifest and the build goes on. A file that
cannot be opened at all (missing, unreadable) still raises, since that is a
recipe or storage error rather than a data error.

A source folder is walked once per real folder and each real file is read
once: symbolic links that lead back into a folder already walked (``ln -s .
loop``) are not followed again, and two paths to one file count as one input.
"""

from __future__ import annotations

import glob
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.data.steps.records import RawRecord

__all__ = [
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "Quarantined",
    "expand_source_paths",
    "is_datasets_dir",
    "iter_records",
]

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
_FILE_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
# `save_to_disk` writes these next to the Arrow files of one Dataset.
_DATASET_MARKERS = ("dataset_info.json", "state.json")
# ... and this one at the top of a DatasetDict, whose splits are subdirectories.
_DATASET_DICT_MARKER = "dataset_dict.json"
_PARQUET_BATCH_ROWS = 1024
_RAW_PREVIEW_CHARS = 2048  # a quarantined line keeps this much, so a 1 GB line stays cheap


@dataclass(frozen=True)
class Quarantined:
    """A line that could not become a record, kept for the quarantine report.

    ``reason`` is one of ``bad_utf8``, ``malformed_json``, ``not_an_object``,
    ``truncated_gzip`` or ``bad_gzip`` (the rest of a compressed file is
    unreadable) or ``bad_parquet`` (the rest of a parquet file is); ``raw`` is the (possibly lossy-decoded, clipped) line text,
    or the decompressor's message, so a human can see what was wrong.
    """

    key: str
    reason: str
    raw: str


def is_datasets_dir(path: Path) -> bool:
    """Whether ``path`` is one Dataset written by ``datasets.Dataset.save_to_disk``."""
    return path.is_dir() and any((path / marker).is_file() for marker in _DATASET_MARKERS)


def _is_supported_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_FILE_SUFFIXES)


def _expand_dir(path: Path, walked: set[Path]) -> list[Path]:
    """Supported files and datasets dirs under ``path``; hidden entries are skipped.

    ``walked`` holds the real folders already listed: a link back into one of
    them (a loop, or a second way into the same tree) is not followed again.
    Children are visited in sorted order so the same path wins on every machine.
    """
    real = path.resolve()
    if real in walked:
        return []
    walked.add(real)
    if is_datasets_dir(path):
        return [path]
    found: list[Path] = []
    for child in sorted(path.iterdir(), key=lambda p: p.name):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            found.extend(_expand_dir(child, walked))
        elif _is_supported_file(child):
            found.append(child)
    return found


def _one_path_per_file(paths: list[Path]) -> list[Path]:
    """``paths`` sorted by path string, keeping the first of several that name one real file."""
    seen: set[Path] = set()
    unique = []
    for path in sorted(paths, key=lambda p: p.as_posix()):
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(path)
    return unique


def expand_source_paths(path: Path) -> list[Path]:
    """Resolve a recipe's source path into the ordered list of readable inputs.

    ``path`` may be a file, a directory (walked recursively for ``.jsonl``,
    ``.jsonl.gz`` and ``.parquet`` files; a directory holding a saved
    ``datasets`` Dataset is one input, a saved DatasetDict is one input per
    split) or a glob pattern. The result is sorted by path string so that the
    ``file_index`` of each input, and therefore every record key, is the same
    whatever order the filesystem lists entries in. Each real file or folder
    appears once, whatever links lead to it.

    An empty list means nothing readable is there (a missing path, a glob
    with no match, a file of another kind): the recipe loader reports that
    against the recipe line, which it can do better than an exception here.
    """
    path = Path(path)
    text = str(path)
    if any(ch in text for ch in "*?["):
        matches = [Path(m) for m in glob.glob(text, recursive=True)]
    else:
        matches = [path] if path.exists() else []
    found: list[Path] = []
    walked: set[Path] = set()
    for match in sorted(matches, key=lambda p: p.as_posix()):
        if match.is_dir():
            found.extend(_expand_dir(match, walked))
        elif _is_supported_file(match):
            found.append(match)
    return _one_path_per_file(found)


def iter_records(
    path: Path, source: str, category: str, file_index: int
) -> Iterator[RawRecord | Quarantined]:
    """Yield the records of one input (a file or a datasets dir), in file order.

    ``file_index`` is the input's position in :func:`expand_source_paths`;
    it makes the key unique across the files of one source.
    """
    path = Path(path)
    prefix = f"{source}:{file_index}:"
    if path.is_dir():
        yield from _iter_datasets_dir(path, prefix, source, category)
    elif path.name.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(path, prefix, source, category)
    elif path.name.endswith(PARQUET_SUFFIXES):
        yield from _iter_parquet(path, prefix, source, category)
    else:
        raise ValueError(f"{path}: unsupported file kind")


def _parse_line(raw: bytes, key: str) -> dict[str, Any] | Quarantined:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        clipped = raw[: 4 * _RAW_PREVIEW_CHARS]
        return Quarantined(key, "bad_utf8", _preview(clipped.decode("utf-8", errors="replace")))
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        # ValueError covers JSONDecodeError and integers past Python's digit limit;
        # RecursionError, a line of 100k "[" that would otherwise crash the worker.
        return Quarantined(key, "malformed_json", _preview(text))
    if not isinstance(value, dict):
        return Quarantined(key, "not_an_object", _preview(text))
    return value


def _preview(text: str) -> str:
    return text[:_RAW_PREVIEW_CHARS].rstrip("\r\n")


def _iter_jsonl(
    path: Path, prefix: str, source: str, category: str
) -> Iterator[RawRecord | Quarantined]:
    # Binary mode: decoding per line keeps one bad byte sequence from
    # poisoning the rest of the file, which text mode would.
    opener = gzip.open if path.name.endswith(".gz") else open
    line_no = 0
    with opener(path, "rb") as handle:
        try:
            for line_no, raw in enumerate(handle, start=1):
                if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark some editors prepend
                if not raw.strip():
                    continue
                key = f"{prefix}{line_no}"
                parsed = _parse_line(raw, key)
                if isinstance(parsed, Quarantined):
                    yield parsed
                else:
                    yield RawRecord(key, source, category, parsed)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            # A gzip cut short (an interrupted download) or corrupt part-way still
            # gives us the lines before the break; report the break as one bad line.
            reason = "truncated_gzip" if isinstance(exc, EOFError) else "bad_gzip"
            yield Quarantined(f"{prefix}{line_no + 1}", reason, str(exc))


def _iter_parquet(
    path: Path, prefix: str, source: str, category: str
) -> Iterator[RawRecord | Quarantined]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for data in batch.to_pylist():
                yield RawRecord(f"{prefix}{row}", source, category, data)
                row += 1
    except pa.ArrowException as exc:
        # Not a parquet file (random bytes, empty) or corrupt part-way: as with a broken
        # gzip, keep the rows before the break and report the break as one bad record.
        yield Quarantined(f"{prefix}{row}", "bad_parquet", str(exc))


def _iter_datasets_dir(
    path: Path, prefix: str, source: str, category: str
) -> Iterator[RawRecord | Quarantined]:
    # Imported here: `datasets` is heavy and only this input kind needs it.
    import datasets

    if (path / _DATASET_DICT_MARKER).is_file():
        raise ValueError(
            f"{path}: a saved DatasetDict; pass its split directories "
            "(expand_source_paths does this)"
        )
    dataset = datasets.load_from_disk(str(path))
    row = 0
    for batch in dataset.iter(batch_size=_PARQUET_BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield RawRecord(
                f"{prefix}{row}", source, category, dict(zip(columns, values, strict=True))
            )
            row += 1
