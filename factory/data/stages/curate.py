"""Stage 1, per input file: read -> format -> filter -> decontaminate -> tokenize -> hash.

Runs in worker processes, one unit (input file) at a time. Its output depends
only on the unit and the recipe, never on the worker, so any worker count
gives the same files. Every document count is taken before and after each
step, and every drop is counted by reason.

The filters and decontamination run before tokenizing, so a dropped document
is never tokenized (on web text the heuristics drop about a quarter of the
tokens, and the tokenizer is most of this stage's time). Their rows therefore
count documents only: tokens are counted from the ``tokenize`` step on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.data.stages.unit_files import CuratedDoc, UnitWriter
from factory.data.steps.chain import Chain, build_chain
from factory.data.steps.chat_template import ChatTemplate
from factory.data.steps.decontamination import NgramIndex
from factory.data.steps.dedup_hashing import MinHasher, Prepared, content_hash, prepare
from factory.data.steps.records import Document, RawRecord
from factory.data.steps.source_files import Quarantined, iter_records
from factory.data.steps.tokenize import DocumentTokenizer
from factory.schemas.data_recipe import DataRecipe

__all__ = ["UnitTask", "curate_unit"]

BATCH = 256
"""Documents tokenized per Rust call: large enough to amortise the call, small enough to stream."""
BATCH_CHARS = 1 << 19
"""...and at most this much text per call, so memory does not grow with document length."""


@dataclass(frozen=True)
class UnitTask:
    """Curate one input file of one source into ``output_path`` (a unit)."""

    recipe: DataRecipe
    source_index: int
    file_index: int
    input_path: Path
    output_path: Path
    tokenizer_path: Path | None
    benchmark_paths: tuple[Path, ...]
    chat_template: ChatTemplate | None = None
    """The recipe's, read from its file by ``load_recipe`` (None: the built-in format)."""


class _Counts:
    """Documents and tokens entering and leaving each step, and drops by reason."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[str, int]] = {}
        self.dropped: Counter[str] = Counter()
        self.quarantined: Counter[str] = Counter()
        self.quarantine_lines: list[dict[str, str]] = []

    def step(self, name: str, docs_in: int, docs_out: int) -> None:
        """Documents in and out of a step before tokenization (its tokens are not known)."""
        row = self.steps.setdefault(name, {"documents_in": 0, "documents_out": 0})
        row["documents_in"] += docs_in
        row["documents_out"] += docs_out

    def passed(self, name: str, kept: bool) -> None:
        self.step(name, 1, 1 if kept else 0)

    def tokenized(self, docs: int, tokens: int) -> None:
        row = self.steps.setdefault(
            "tokenize", {"documents_in": 0, "tokens_in": 0, "documents_out": 0, "tokens_out": 0}
        )
        row["documents_in"] += docs
        row["documents_out"] += docs
        row["tokens_in"] += tokens  # tokenizing drops nothing: what comes out is what went in
        row["tokens_out"] += tokens

    def quarantine(self, line: Quarantined) -> None:
        self.quarantined[line.reason] += 1
        self.quarantine_lines.append({"key": line.key, "reason": line.reason})


class _Curation:
    """One unit's curation under way: its source's steps, the hashers, the counts, and the
    kept documents waiting for the next tokenizer call."""

    def __init__(self, task: UnitTask) -> None:
        recipe = task.recipe
        self.chain: Chain = build_chain(
            recipe.sources[task.source_index], recipe.seed, task.chat_template
        )
        self.tokenizer = DocumentTokenizer(task.tokenizer_path, eos=recipe.tokenizer.eos)
        dedup = recipe.dedup
        self.hasher = (
            MinHasher(dedup.bands * dedup.rows, dedup.shingle_size, dedup.seed)
            if dedup.minhash
            else None
        )
        self.contamination = (
            NgramIndex.from_files(list(task.benchmark_paths), recipe.decontam.ngram)
            if task.benchmark_paths
            else None
        )
        self.counts = _Counts()
        self.writer = UnitWriter(task.output_path)
        self.pending: list[tuple[Document, Prepared]] = []
        self.pending_chars = 0

    def add(self, record: RawRecord) -> None:
        """Format ``record`` and queue the documents that pass; tokenize a full batch."""
        counts, chain = self.counts, self.chain
        counts.passed("read", True)
        formatted = chain.format(record)
        if not isinstance(formatted, list):  # a Drop
            counts.passed(chain.format_name, False)
            counts.dropped[f"{chain.format_name}:{formatted.reason}"] += 1
            return
        counts.step(chain.format_name, 1, len(formatted))
        for doc in formatted:
            prepared = self.keep(record, doc)
            if prepared is not None:
                self.pending.append((doc, prepared))
                self.pending_chars += len(doc.text)
        if len(self.pending) >= BATCH or self.pending_chars >= BATCH_CHARS:
            self.flush()

    def keep(self, record: RawRecord, doc: Document) -> Prepared | None:
        """Run the filters and decontamination; the prepared words of a kept document."""
        counts = self.counts
        for name, check in self.chain.filters:
            reason = check(record, doc)
            counts.passed(name, reason is None)
            if reason is not None:
                counts.dropped[f"{name}:{reason}"] += 1
                return None
        # Normalise once: decontamination, MinHash and the exact hash share it.
        prepared = prepare(doc.text)
        if self.contamination is not None:
            match = self.contamination.first_match(prepared)
            counts.passed("decontam", match is None)
            if match is not None:
                counts.dropped["decontam:benchmark_ngram"] += 1
                return None
        return prepared

    def flush(self) -> None:
        """Tokenize the queued documents and write them, hashed, to the unit."""
        tokenized = self.tokenizer.encode([doc for doc, _ in self.pending])
        for (doc, prepared), tok in zip(self.pending, tokenized, strict=True):
            self.counts.tokenized(1, len(tok.ids))
            signature = self.hasher.signature(prepared) if self.hasher is not None else None
            record = CuratedDoc(doc.key, content_hash(prepared), signature, tok.ids, tok.mask)
            self.writer.write(record)
        self.pending.clear()
        self.pending_chars = 0


def curate_unit(task: UnitTask) -> dict[str, Any]:
    """Curate one input file into its unit (records, sidecar, then stats); return the stats."""
    source = task.recipe.sources[task.source_index]
    curation = _Curation(task)
    try:
        for item in iter_records(task.input_path, source.name, source.category, task.file_index):
            if isinstance(item, Quarantined):
                curation.counts.quarantine(item)
            else:
                curation.add(item)
        if curation.pending:
            curation.flush()
    except BaseException:
        curation.writer.abort()
        raise
    counts = curation.counts
    stats = {
        "source": source.name,
        "file_index": task.file_index,
        "input": str(task.input_path),
        "steps": counts.steps,
        "dropped": dict(counts.dropped),
        "quarantined": dict(counts.quarantined),
        "quarantine": counts.quarantine_lines,
    }
    curation.writer.close(stats)
    return stats
