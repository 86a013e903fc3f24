"""The shipped sample corpus: a deterministic generator for every data category.

Everything here is written for factory from templates and small word lists of
our own (no copied text), so it can ship in the repository. Each category is
structurally real (the record shapes of the Nemotron SFT and pretraining data,
docs/data.md, Recipe and Formatting) and carries planted flaws for the
curation stages to remove, marked in ``meta.defect`` (see ``common``).

``python -m factory.data.samples --out data_recipes/samples`` regenerates the
shipped files; ``tests/test_data_samples.py`` checks they are up to date.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from factory.data.samples.benchmarks import benchmark_items
from factory.data.samples.code import code
from factory.data.samples.conversational import conversational
from factory.data.samples.cuda import cuda_kernel
from factory.data.samples.mathematics import math_problems
from factory.data.samples.safety import multilingual_safety
from factory.data.samples.search import search_trajectory
from factory.data.samples.stem import stem_synthetic
from factory.data.samples.swe import swe_trajectory
from factory.data.samples.terminal import terminal
from factory.data.samples.text import long_context, pretrain_text

__all__ = [
    "BENCHMARKS_FILE",
    "CATEGORIES",
    "DEFAULT_COUNTS",
    "GZIP_CATEGORIES",
    "generate",
    "sample_file",
    "write_samples",
]

Generator = Callable[[random.Random, int], list[dict]]

# name -> (generator, records at scale 1.0). The counts put the corpus at ~3.5 MB on disk.
CATEGORIES: dict[str, tuple[Generator, int]] = {
    "pretrain_text": (pretrain_text, 400),
    "long_context": (long_context, 30),
    "stem_synthetic": (stem_synthetic, 200),
    "swe_trajectory": (swe_trajectory, 80),
    "cuda_kernel": (cuda_kernel, 100),
    "multilingual_safety": (multilingual_safety, 160),
    "search_trajectory": (search_trajectory, 80),
    "terminal": (terminal, 100),
    "conversational": (conversational, 150),
    "math": (math_problems, 250),
    "code": (code, 200),
}
DEFAULT_COUNTS: dict[str, int] = {name: count for name, (_, count) in CATEGORIES.items()}
# Written gzipped (and only gzipped) so readers' .jsonl.gz path is exercised.
GZIP_CATEGORIES: frozenset[str] = frozenset({"long_context", "terminal"})
BENCHMARKS_FILE = "benchmarks.jsonl"


def sample_file(category: str) -> str:
    """The file name a category is written to: ``{category}.jsonl`` or ``.jsonl.gz``."""
    return f"{category}.jsonl.gz" if category in GZIP_CATEGORIES else f"{category}.jsonl"


def generate(category: str, n: int, seed: int) -> Iterator[dict]:
    """``n`` records of ``category``; the same (category, n, seed) always gives the same records.

    Each category draws from its own ``random.Random`` seeded by a string, which
    Python hashes with SHA-512: the output does not depend on ``PYTHONHASHSEED``,
    the platform or the other categories.
    """
    if category not in CATEGORIES:
        raise KeyError(f"unknown sample category {category!r}; known: {', '.join(CATEGORIES)}")
    make, _ = CATEGORIES[category]
    yield from make(random.Random(f"factory-samples:{seed}:{category}"), n)


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def _gzip(data: bytes) -> bytes:
    """Gzip with no file name and mtime 0, so equal inputs give equal bytes (for one zlib)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(data)
    return buffer.getvalue()


def _readme(stats: dict[str, tuple[int, Counter]]) -> str:
    rows = "\n".join(
        f"| `{sample_file(name)}` | {count} | "
        + (", ".join(f"{k} {v}" for k, v in sorted(defects.items())) or "none")
        + " |"
        for name, (count, defects) in stats.items()
    )
    return f"""# Sample corpus

Written for factory by `python -m factory.data.samples --out data_recipes/samples`
(`factory/data/samples/`): templates and word lists of our own, no copied text.
Do not edit by hand; `tests/test_data_samples.py` fails when these files differ
from a fresh generation.

Every record has `meta.defect`: null when clean, otherwise the flaw planted for
the curation stages to remove. `{BENCHMARKS_FILE}` is a 50-item benchmark of our
own; records with `meta.defect == "contaminated"` quote 15-22 words of one item
(`meta.benchmark_id`).

| File | Records | Planted defects |
|---|---|---|
{rows}
"""


def write_samples(out_dir: Path, seed: int = 0, scale: float = 1.0) -> dict[str, Path]:
    """Write every category, the benchmark set and a README into ``out_dir``.

    Returns category (plus ``benchmarks`` and ``readme``) to path. ``scale``
    multiplies the record counts (at least 1 record per category).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    stats: dict[str, tuple[int, Counter]] = {}
    for name, count in DEFAULT_COUNTS.items():
        records = list(generate(name, max(1, round(count * scale)), seed))
        data = _jsonl(records)
        path = out_dir / sample_file(name)
        path.write_bytes(_gzip(data) if name in GZIP_CATEGORIES else data)
        paths[name] = path
        stats[name] = (
            len(records),
            Counter(r["meta"]["defect"] for r in records if r["meta"]["defect"]),
        )
    paths["benchmarks"] = out_dir / BENCHMARKS_FILE
    paths["benchmarks"].write_bytes(_jsonl(benchmark_items()))
    paths["readme"] = out_dir / "README.md"
    paths["readme"].write_text(_readme(stats), encoding="utf-8")
    return paths
