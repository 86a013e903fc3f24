"""``factory data build`` end to end vs DataTrove's equivalent pipeline vs the tokenizer alone.

Corpus: 40 jsonl files, ~207 MB, web text and code from ``factory.data.samples``, one seed
per file (so the generator's planted junk and duplicates are there, not 40 copies of one
file); generated once into ``--corpus``. Its documents are short (median ~2,000 characters).
``--corpus-kind long`` builds the same records into long documents, as web pages are (median
~8,000 characters): each file's records, shuffled as before, are grouped by kind (text, code)
and every ``LONG_GROUP`` consecutive ones are joined by a blank line into one document, so the
bytes are nearly the same and only the document lengths change; cached separately
(``/tmp/factory-bench-corpus-long`` by default). Each measurement runs in a fresh interpreter after
``os.sync()``, interleaved per round (``--rounds``, medians); MB/s are corpus bytes on disk
per second for all three, tokens/s the tokens written (or produced, for the tokenizer).

* ours: one source (text + heuristics), exact + MinHash dedup (5-word shingles, 16 x 8),
  no decontamination, BFD packing to 2048, webdataset shards: ``build(load_recipe(...))``
  with ``--workers``, timed from loading the recipe to the manifest.
* DataTrove: ``LocalPipelineExecutor`` stages run back to back, ``workers`` at a time:
  JsonlReader -> GopherQuality -> GopherRepetition -> JsonlWriter -> MinhashDedupSignature
  (a task per file); MinhashDedupBuckets (16 tasks); MinhashDedupCluster; JsonlReader ->
  MinhashDedupFilter -> DocumentTokenizer (same tokenizer.json and EOS; a task per file).
  In its favour: words are ``str.split`` (its English tokenizer needs spaCy), ``fork``
  workers, no shuffling, no Merger, no exact-dedup stage, no packing (its output is one
  token file per task). xxhash gets encoded bytes (0.10.1 passes str; xxhash 4 refuses).
* tokenizer alone: ``encode_batch_fast`` (its own thread pool, both cores) over every
  record's text, 1000 per call; only the calls are timed: the ceiling our pipeline is measured
  against.

Goals (issue 16): ours >= 4x DataTrove, and >= 70% of the tokenizer alone, on both corpora.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import describe

try:  # module level so that worker processes can unpickle SplitWords
    from datatrove.utils.word_tokenizers import WordTokenizer
except ImportError:  # pragma: no cover - `--only ours` / `--only tokenizer` still run
    WordTokenizer = object  # type: ignore[assignment,misc]

CORPUS_VERSION = 1
CORPUS_KINDS = ("short", "long")
TEXT_PER_FILE, CODE_PER_FILE = 1800, 600
LONG_GROUP = 4  # records per long document
SEED_BASE = 1000
PATTERN = "part-*.jsonl"
EOS = "<|endoftext|>"
SEQ_LEN, BANDS, ROWS, SHINGLE = 2048, 16, 8, 5
TOKENIZER_BATCH = 1000
RECIPE = """\
name: bench
sources:
  - {{name: web, path: "{path}", category: pretrain_text, weight: 1,
     steps: [{{kind: text}}, {{kind: heuristics}}]}}
dedup: {{exact: true, minhash: true, shingle_size: {shingle}, bands: {bands}, rows: {rows}}}
packing: {{seq_len: {seq}, window: 4096}}
output: {{samples_per_shard: 256}}
"""


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    seconds: float
    input_bytes: int
    tokens: int
    docs: int
    driver_peak_mb: float = 0.0  # the measuring process's peak RSS (not its workers')

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _long_documents(records: list[dict], seed: int) -> list[dict]:
    """Every ``LONG_GROUP`` consecutive records of one kind joined into one document."""
    by_kind: dict[bool, list[dict]] = {}
    for record in records:
        by_kind.setdefault("path" in record, []).append(record)  # code records carry a path
    joined = []
    for group in by_kind.values():
        for lo in range(0, len(group), LONG_GROUP):
            part = group[lo : lo + LONG_GROUP]
            text = "\n\n".join(r["text"] for r in part)
            joined.append({"id": f"{part[0]['id']}+{len(part)}", "text": text})
    random.Random(seed).shuffle(joined)
    return joined


def make_corpus(root: Path, files: int, kind: str = "short") -> list[Path]:
    """``files`` jsonl files of web text and code under ``root``, generated once and reused."""
    from factory.data.samples import generate

    stamp = root / "corpus.json"
    wanted = {
        "version": CORPUS_VERSION,
        "files": files,
        "text": TEXT_PER_FILE,
        "code": CODE_PER_FILE,
    }
    if kind == "long":  # the short corpus's stamp stays as it was: its cache stays valid
        wanted["long_group"] = LONG_GROUP
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
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
        if kind == "long":
            records = _long_documents(records, seed)
        path = root / f"part-{i:05d}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
        tmp.replace(path)
    stamp.write_text(json.dumps(wanted))
    return sorted(root.glob(PATTERN))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_ours(
    corpus: Path, work: Path, workers: int, input_bytes: int, executor: str = "local"
) -> Result:
    """Our build; on Ray the local instance is started first, untimed (a cluster is up)."""
    from factory.data.build_job import build
    from factory.data.loaded_recipe import load_recipe

    path = work / "bench.yaml"
    path.write_text(
        RECIPE.format(path=corpus / PATTERN, shingle=SHINGLE, bands=BANDS, rows=ROWS, seq=SEQ_LEN)
    )
    if executor == "ray":
        import ray

        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    manifest = build(load_recipe(path), work / "ours", workers=workers, executor=executor)
    seconds = time.perf_counter() - start
    docs = sum(s["after"]["documents"] for s in manifest["sources"].values())
    name = "ours" if executor == "local" else "ours-ray"
    tokens = manifest["packing"]["tokens"]
    return Result(name, seconds, input_bytes, tokens, docs, _peak_rss_mb())


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
    import datatrove.pipeline.dedup.minhash as mh
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    from factory.data.steps.tokenize import DEFAULT_TOKENIZER

    root, words = work / "datatrove", SplitWords("en")
    sigs, buckets, remove = str(root / "sigs"), str(root / "buckets"), str(root / "remove")
    config = mh.MinhashConfig(n_grams=SHINGLE, num_buckets=BANDS, hashes_per_bucket=ROWS)
    signature = mh.MinhashDedupSignature(sigs, config=config, language=words)
    signature._hash_func = _xxh64
    curate = [
        JsonlReader(str(corpus), glob_pattern=PATTERN),
        GopherQualityFilter(language=words),
        GopherRepetitionFilter(language=words),
        JsonlWriter(str(root / "filtered"), compression=None),
        signature,
    ]
    tokenizer = DocumentTokenizer(
        str(root / "tokens"), str(DEFAULT_TOKENIZER), eos_token=EOS, shuffle_documents=False
    )
    stages = [
        (files, curate),
        (BANDS, [mh.MinhashDedupBuckets(sigs, buckets, config=config)]),
        (1, [mh.MinhashDedupCluster(buckets, remove, config=config)]),
        (files, [JsonlReader(str(root / "filtered")), mh.MinhashDedupFilter(remove), tokenizer]),
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

    from factory.data.steps.tokenize import DEFAULT_TOKENIZER

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


MEASURE = {
    "ours": "ours",
    "ray": "ours on Ray",
    "datatrove": "DataTrove",
    "tokenizer": "tokenizer alone",
}


def measure(name: str, corpus: Path, work: Path, workers: int) -> Result:
    """One measurement, in this process (``--child``): a fresh output folder, dirty pages synced."""
    paths = sorted(corpus.glob(PATTERN))
    input_bytes = sum(p.stat().st_size for p in paths)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.sync()  # the corpus or an earlier run's output must not be flushed on our time
    if name == "ours":
        return run_ours(corpus, work, workers, input_bytes)
    if name == "ray":
        return run_ours(corpus, work, workers, input_bytes, executor="ray")
    if name == "datatrove":
        return run_datatrove(corpus, work, workers, len(paths), input_bytes)
    return run_tokenizer(paths, input_bytes)


def spawn(name: str, args: argparse.Namespace, work: Path) -> Result:
    """Run ``measure`` in a fresh interpreter: no state (thread pools, caches) carries over."""
    command = [sys.executable, "-m", "benchmarks", "data_pipeline", "--child", name]
    command += ["--corpus", str(args.corpus), "--workers", str(args.workers), "--work", str(work)]
    log = work.with_name(f"{work.name}.log")
    with open(log, "w") as stderr:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed; see {log}:\n{log.read_text()[-3000:]}")
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def _row(r: Result, label: str) -> str:
    peak = f" {r.driver_peak_mb:9.0f}" if r.driver_peak_mb else ""
    return (
        f"{label:22s} {r.seconds:8.1f} {r.mb_per_s:7.2f} {r.tokens:12,d} "
        f"{r.tokens_per_s:11,.0f} {r.docs:7,d}{peak}"
    )


def _driver_memory_scan(args: argparse.Namespace, paths: list[Path], work: Path) -> None:
    """Both executors on the first quarter, half and all of the corpus: the driver's peak RSS."""
    print(f"\n{'driver peak RSS':22s} {'files':>6s} {'MB in':>8s} {'local MB':>9s} {'Ray MB':>8s}")
    for count in sorted({max(1, len(paths) // 4), max(1, len(paths) // 2), len(paths)}):
        subset = work / f"corpus-{count}"
        subset.mkdir(parents=True, exist_ok=True)
        for path in paths[:count]:
            link = subset / path.name
            if not link.exists():
                link.symlink_to(path)
        sized = argparse.Namespace(**{**vars(args), "corpus": subset})
        local = spawn("ours", sized, work / f"scan-local-{count}")
        on_ray = spawn("ray", sized, work / f"scan-ray-{count}")
        mb = local.input_bytes / 1e6
        print(
            f"{'':22s} {count:6d} {mb:8.1f} {local.driver_peak_mb:9.0f} {on_ray.driver_peak_mb:8.0f}",
            flush=True,
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks data_pipeline")
    default_corpus = Path(tempfile.gettempdir()) / "factory-bench-corpus"
    parser.add_argument("--corpus", type=Path, default=None, help="corpus cache folder")
    parser.add_argument(
        "--corpus-kind",
        choices=CORPUS_KINDS,
        default="short",
        help="long: the same records joined into long documents (module docstring)",
    )
    parser.add_argument("--files", type=int, default=40, help="corpus files (~5.2 MB each)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for both")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all three; medians")
    parser.add_argument("--work", type=Path, default=None, help="output folder (default: temp)")
    parser.add_argument("--only", choices=list(MEASURE), action="append", help="run a subset")
    parser.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="ray: ours on Ray beside ours locally, then the driver's peak memory by corpus size",
    )
    parser.add_argument("--child", choices=list(MEASURE), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.corpus is None:
        suffix = "" if args.corpus_kind == "short" else f"-{args.corpus_kind}"
        args.corpus = default_corpus.with_name(default_corpus.name + suffix)
    args.corpus = args.corpus.resolve()
    if args.child:
        result = measure(args.child, args.corpus, args.work, args.workers)
        print(json.dumps(dataclasses.asdict(result)))
        return 0

    start = time.perf_counter()
    paths = make_corpus(args.corpus, args.files, args.corpus_kind)
    input_bytes = sum(p.stat().st_size for p in paths)
    os.sync()
    with open(paths[0], encoding="utf-8") as handle:  # one file shows the shape; all cost time
        lengths = sorted(len(json.loads(line)["text"]) for line in handle)
    print(f"machine: {describe()}, load average {os.getloadavg()[0]:.2f}")
    print(
        f"corpus: {args.corpus} ({args.corpus_kind}), {len(paths)} files, {input_bytes / 1e6:.1f} MB "
        f"({time.perf_counter() - start:.1f} s to generate or check); "
        f"median document {lengths[len(lengths) // 2]:,} characters in {paths[0].name}"
    )
    work = (args.work or Path(tempfile.mkdtemp(prefix="factory-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    default = ["ours", "ray"] if args.executor == "ray" else ["ours", "datatrove", "tokenizer"]
    names = [name for name in MEASURE if name in (args.only or default)]
    runs: dict[str, list[Result]] = {name: [] for name in names}
    print(
        f"\n{'round / what':22s} {'seconds':>8s} {'MB/s':>7s} {'tokens':>12s} {'tokens/s':>11s} "
        f"{'docs':>7s} {'driver MB':>9s}"
    )
    try:
        for round_index in range(args.rounds):
            for name in names:  # interleaved, so that machine noise hits all three alike
                runs[name].append(spawn(name, args, work / name))
                print(_row(runs[name][-1], f"{round_index + 1}: {MEASURE[name]}"), flush=True)
        if args.executor == "ray":
            _driver_memory_scan(args, paths, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    median = {n: sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for n, rs in runs.items()}
    print(f"\nmedians of {args.rounds} round(s):")
    for name, r in median.items():
        print(_row(r, MEASURE[name]))
    ours = median.get("ours")
    if ours and "datatrove" in median:
        ratio = median["datatrove"].seconds / ours.seconds
        print(f"ours / DataTrove (MB/s): {ratio:.2f} (goal >= 4)")
    if ours and "tokenizer" in median:
        share = median["tokenizer"].seconds / ours.seconds
        print(f"ours / tokenizer alone (MB/s): {share:.2f} (goal >= 0.7)")
    if ours and "ray" in median:
        overhead = median["ray"].seconds / ours.seconds - 1
        print(f"Ray on one node vs local: {overhead:+.1%} time (goal within 15%)")
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
    return 0
