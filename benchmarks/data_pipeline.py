"""``factory data build`` end to end vs DataTrove's equivalent pipeline vs the tokenizer alone.

One generated corpus (40 jsonl files, ~210 MB: web text and code records of
``factory.data.samples``, one seed per file, with the generator's planted
junk, exact and near duplicates), three measurements in one run, in this order:

* ours: a one-source recipe (text + heuristics; exact + MinHash dedup, 5-word
  shingles, 16 x 8 bands; no decontamination; BFD packing to 2048; webdataset
  shards) through ``factory.data.pipeline.build`` with ``--workers``, wall time
  of the whole build from loading the recipe.
* DataTrove (from PyPI), ``LocalPipelineExecutor`` per stage, ``workers`` at a
  time, stages run back to back and timed together: JsonlReader ->
  GopherQualityFilter -> GopherRepetitionFilter -> JsonlWriter (uncompressed)
  -> MinhashDedupSignature (one task per file); MinhashDedupBuckets (16 tasks);
  MinhashDedupCluster (1 task); JsonlReader -> MinhashDedupFilter ->
  DocumentTokenizer (same tokenizer.json, same EOS; one task per file).
  Work-arounds, all in DataTrove's favour: words are ``str.split`` (English
  wants spaCy, not installed, and slower), xxhash gets encoded bytes (0.10.1
  passes ``str``, which xxhash 4 refuses), ``fork`` instead of ``forkserver``,
  no document shuffling, no DocumentTokenizerMerger, no exact-dedup stages
  (MinHash catches exact copies too). It has no packing: its output is one
  concatenated token file per task.
* the tokenizer alone: ``Tokenizer.encode_batch_fast`` (its default thread
  pool, both cores) over every record's text, 1000 per call; only the encode
  calls are timed (texts already in memory), the ceiling for a pipeline that
  must tokenize all of them.

MB/s are corpus bytes (jsonl on disk) per second for all three; tokens/s are
tokens written (ours, DataTrove) or produced (tokenizer). The goals (issue 4):
ours >= 2x DataTrove and >= 50% of the tokenizer alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import describe

try:  # module level so that worker processes can unpickle SplitWords
    from datatrove.utils.word_tokenizers import WordTokenizer
except ImportError:  # pragma: no cover - `--only ours` / `--only tokenizer` still run
    WordTokenizer = object  # type: ignore[assignment,misc]

CORPUS_VERSION = 1
TEXT_PER_FILE, CODE_PER_FILE = 1800, 600
SEED_BASE = 1000
PATTERN = "part-*.jsonl"
EOS = "<|endoftext|>"
SEQ_LEN, BANDS, ROWS, SHINGLE = 2048, 16, 8, 5
TOKENIZER_BATCH = 1000


@dataclass(frozen=True)
class Result:
    name: str
    seconds: float
    input_bytes: int
    tokens: int
    docs: int

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_corpus(root: Path, files: int) -> list[Path]:
    """``files`` jsonl files of web text and code under ``root``, generated once and reused."""
    from factory.data.samples import generate

    stamp = root / "corpus.json"
    spec = {"version": CORPUS_VERSION, "files": files, "text": TEXT_PER_FILE, "code": CODE_PER_FILE}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return sorted(root.glob(PATTERN))
    root.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    for old in root.glob(PATTERN):
        old.unlink()
    for i in range(files):
        seed = SEED_BASE + i
        records = [
            *generate("pretrain_text", TEXT_PER_FILE, seed),
            *generate("code", CODE_PER_FILE, seed),
        ]
        random.Random(seed).shuffle(records)
        path = root / f"part-{i:05d}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
        tmp.replace(path)
    stamp.write_text(json.dumps(spec))
    return sorted(root.glob(PATTERN))


def run_ours(corpus: Path, work: Path, workers: int, input_bytes: int) -> Result:
    from factory.data.pipeline import build
    from factory.data.recipe_loading import load_recipe

    recipe = {
        "name": "bench",
        "sources": [
            {
                "name": "web",
                "path": str(corpus / PATTERN),
                "category": "pretrain_text",
                "weight": 1,
                "steps": [{"kind": "text"}, {"kind": "heuristics"}],
            }
        ],
        "dedup": {
            "exact": True,
            "minhash": True,
            "shingle_size": SHINGLE,
            "bands": BANDS,
            "rows": ROWS,
        },
        "packing": {"seq_len": SEQ_LEN, "window": 4096},
        "output": {"samples_per_shard": 256},
    }
    path = work / "bench.yaml"
    path.write_text(json.dumps(recipe, indent=2))  # JSON is YAML
    start = time.perf_counter()
    manifest = build(load_recipe(path), work / "ours", workers=workers)
    seconds = time.perf_counter() - start
    docs = sum(s["after"]["documents"] for s in manifest["sources"].values())
    return Result("ours", seconds, input_bytes, manifest["packing"]["tokens"], docs)


class SplitWords(WordTokenizer):
    """A DataTrove WordTokenizer on ``str.split`` (its English one needs spaCy)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


def _xxh64(text: str) -> int:
    """DataTrove 0.10.1 hashes ``str`` with xxhash, which xxhash 4 rejects; encode first."""
    import xxhash

    return xxhash.xxh64_intdigest(text.encode("utf-8"))


def run_datatrove(corpus: Path, work: Path, workers: int, files: int, input_bytes: int) -> Result:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    from factory.data.tokenize import DEFAULT_TOKENIZER

    root = work / "datatrove"
    words = SplitWords("en")
    config = MinhashConfig(n_grams=SHINGLE, num_buckets=BANDS, hashes_per_bucket=ROWS)
    signature = MinhashDedupSignature(str(root / "sigs"), config=config, language=words)
    signature._hash_func = _xxh64
    stages = [
        (
            files,
            [
                JsonlReader(str(corpus), glob_pattern=PATTERN),
                GopherQualityFilter(language=words),
                GopherRepetitionFilter(language=words),
                JsonlWriter(str(root / "filtered"), compression=None),
                signature,
            ],
        ),
        (BANDS, [MinhashDedupBuckets(str(root / "sigs"), str(root / "buckets"), config=config)]),
        (1, [MinhashDedupCluster(str(root / "buckets"), str(root / "remove"), config=config)]),
        (
            files,
            [
                JsonlReader(str(root / "filtered")),
                MinhashDedupFilter(str(root / "remove")),
                DocumentTokenizer(
                    str(root / "tokens"),
                    str(DEFAULT_TOKENIZER),
                    eos_token=EOS,
                    shuffle_documents=False,
                ),
            ],
        ),
    ]
    start = time.perf_counter()
    for index, (tasks, pipeline) in enumerate(stages):
        LocalPipelineExecutor(
            pipeline,
            tasks=tasks,
            workers=workers,
            logging_dir=str(root / f"logs-{index}"),
            start_method="fork",
        ).run()
    seconds = time.perf_counter() - start
    token_bytes = sum(p.stat().st_size for p in (root / "tokens").glob("*.ds"))
    index_bytes = sum(p.stat().st_size for p in (root / "tokens").glob("*.ds.index"))
    # vocab 4096 -> 2-byte tokens; the index holds one uint64 end per document
    return Result("DataTrove", seconds, input_bytes, token_bytes // 2, index_bytes // 8)


def run_tokenizer(paths: list[Path], input_bytes: int) -> Result:
    from tokenizers import Tokenizer

    from factory.data.tokenize import DEFAULT_TOKENIZER

    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    seconds, tokens, docs = 0.0, 0, 0
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            texts = [json.loads(line)["text"] for line in handle]
        for lo in range(0, len(texts), TOKENIZER_BATCH):
            batch = texts[lo : lo + TOKENIZER_BATCH]
            start = time.perf_counter()
            encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(e.ids) for e in encodings)
        docs += len(texts)
    return Result("tokenizer alone", seconds, input_bytes, tokens, docs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks data_pipeline")
    default_corpus = Path(tempfile.gettempdir()) / "factory-bench-corpus"
    parser.add_argument("--corpus", type=Path, default=default_corpus, help="corpus cache folder")
    parser.add_argument("--files", type=int, default=40, help="corpus files (~5.2 MB each)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for both")
    parser.add_argument("--work", type=Path, default=None, help="output folder (default: temp)")
    parser.add_argument(
        "--only", choices=("ours", "datatrove", "tokenizer"), action="append", help="run a subset"
    )
    args = parser.parse_args(argv)
    only = set(args.only or ("ours", "datatrove", "tokenizer"))

    start = time.perf_counter()
    paths = make_corpus(args.corpus, args.files)
    input_bytes = sum(p.stat().st_size for p in paths)
    print(f"machine: {describe()}, load average {os.getloadavg()[0]:.2f}")
    print(
        f"corpus: {args.corpus}, {len(paths)} files, {input_bytes / 1e6:.1f} MB "
        f"({time.perf_counter() - start:.1f} s to generate or check)"
    )
    work = args.work or Path(tempfile.mkdtemp(prefix="factory-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: dict[str, Result] = {}
    try:
        if "ours" in only:
            results["ours"] = run_ours(args.corpus.resolve(), work, args.workers, input_bytes)
        if "datatrove" in only:
            results["datatrove"] = run_datatrove(
                args.corpus.resolve(), work, args.workers, len(paths), input_bytes
            )
        if "tokenizer" in only:  # last: its Rust thread pool must not exist when the others fork
            results["tokenizer"] = run_tokenizer(paths, input_bytes)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'':16s} {'seconds':>9s} {'MB/s':>7s} {'tokens':>13s} {'tokens/s':>11s} {'docs':>8s}")
    for r in results.values():
        print(
            f"{r.name:16s} {r.seconds:9.1f} {r.mb_per_s:7.2f} {r.tokens:13,d} "
            f"{r.tokens_per_s:11,.0f} {r.docs:8,d}"
        )
    ours = results.get("ours")
    if ours and "datatrove" in results:
        ratio = ours.mb_per_s / results["datatrove"].mb_per_s
        print(f"ours / DataTrove (MB/s): {ratio:.2f} (goal >= 2)")
    if ours and "tokenizer" in results:
        share = ours.mb_per_s / results["tokenizer"].mb_per_s
        print(f"ours / tokenizer alone (MB/s): {share:.2f} (goal >= 0.5)")
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
    return 0
