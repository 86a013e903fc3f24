"""The shipped sample corpus and default tokenizer: shapes, planted defects, freshness, determinism."""

from __future__ import annotations

import ast
import gzip
import json
import re
from collections import Counter
from itertools import combinations
from pathlib import Path

import pytest

from factory.data.samples import (
    BENCHMARKS_FILE,
    DEFAULT_COUNTS,
    GZIP_CATEGORIES,
    generate,
    sample_file,
    write_samples,
)

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "data_recipes" / "samples"
TOKENIZER = REPO / "data_recipes" / "tokenizer" / "tokenizer.json"

TEXT_CATEGORIES = ("pretrain_text", "long_context", "math", "code")
AGENT_CATEGORIES = ("swe_trajectory", "terminal", "search_trajectory")
# Fields every record of a category has (``tools`` is also on chat records that use tools).
FIELDS: dict[str, set[str]] = {
    "pretrain_text": {"id", "text", "url", "meta"},
    "long_context": {"id", "text", "url", "meta"},
    "code": {"id", "text", "path", "meta"},
    "math": {"id", "text", "messages", "answer", "used_in", "meta"},
    "stem_synthetic": {"id", "messages", "answer", "used_in", "meta"},
    "conversational": {"id", "messages", "used_in", "meta"},
    "multilingual_safety": {"id", "messages", "lang", "label", "used_in", "meta"},
    "swe_trajectory": {
        "id", "instance_id", "repo", "messages", "patch", "finished", "tests_passed",
        "test_results", "used_in", "meta",
    },
    "terminal": {"id", "task", "messages", "finished", "tests_passed", "used_in", "meta"},
    "search_trajectory": {
        "id", "question", "answer", "messages", "tools", "finished", "tests_passed", "used_in", "meta",
    },
    "cuda_kernel": {
        "id", "task", "op", "pytorch_reference", "cuda_kernel", "messages", "verified",
        "benchmark", "shape", "used_in", "meta",
    },
}  # fmt: skip
JUNK = {"short", "repetitive", "symbols"}


def load(category: str) -> list[dict]:
    path = SAMPLES / sample_file(category)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[dict]]:
    return {category: load(category) for category in DEFAULT_COUNTS}


def flat_text(record: dict) -> str:
    """Everything a model would read in a record."""
    if "text" in record:
        return record["text"]
    parts = []
    for m in record["messages"]:
        parts += [m.get("reasoning_content") or "", m.get("content") or ""]
        parts += [c["function"]["arguments"] for c in m.get("tool_calls", [])]
    return "\n".join(parts)


def test_generate_is_deterministic_and_seeded() -> None:
    for category in DEFAULT_COUNTS:
        n = 3 if category == "long_context" else 40
        first = json.dumps(list(generate(category, n, seed=3)), ensure_ascii=False)
        again = json.dumps(list(generate(category, n, seed=3)), ensure_ascii=False)
        other = json.dumps(list(generate(category, n, seed=4)), ensure_ascii=False)
        assert first == again, category
        assert first != other, category


def test_generate_rejects_unknown_category() -> None:
    with pytest.raises(KeyError, match="unknown sample category"):
        next(generate("poetry", 1, 0))


def test_shipped_files_equal_a_fresh_generation(tmp_path: Path) -> None:
    """Regenerate with ``python -m factory.data.samples --out data_recipes/samples`` if this fails."""
    fresh = write_samples(tmp_path)
    shipped = {p.name for p in SAMPLES.iterdir()}
    assert shipped == {p.name for p in fresh.values()}
    for path in fresh.values():
        new, old = path.read_bytes(), (SAMPLES / path.name).read_bytes()
        if path.suffix == ".gz":  # compare content: another zlib may compress differently
            new, old = gzip.decompress(new), gzip.decompress(old)
        assert new == old, f"{path.name} is stale"


def test_corpus_size_and_gzip() -> None:
    total = sum(p.stat().st_size for p in SAMPLES.iterdir())
    assert 2_000_000 <= total <= 5_000_000
    for category in GZIP_CATEGORIES:
        assert (SAMPLES / f"{category}.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
        assert not (SAMPLES / f"{category}.jsonl").exists()


def check_messages(record: dict) -> None:
    """OpenAI chat shape; a tool turn answers an earlier call."""
    calls: set[str] = set()
    for m in record["messages"]:
        assert m["role"] in {"system", "user", "assistant", "tool"}
        assert isinstance(m["content"], str)
        if "reasoning_content" in m:
            assert m["role"] == "assistant" and isinstance(m["reasoning_content"], str)
        for call in m.get("tool_calls", []):
            assert m["role"] == "assistant"
            assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
            assert set(call["function"]) == {"name", "arguments"}
            calls.add(call["id"])
        if m["role"] == "tool":
            assert m["tool_call_id"] in calls
    for tool in record.get("tools", []):
        assert tool["type"] == "function"
        params = tool["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])


@pytest.mark.parametrize("category", list(DEFAULT_COUNTS))
def test_records_have_the_documented_fields(corpus: dict[str, list[dict]], category: str) -> None:
    records = corpus[category]
    assert len(records) == DEFAULT_COUNTS[category]
    assert len({r["id"] for r in records}) == len(records)
    for record in records:
        assert FIELDS[category] <= set(record), record["id"]
        assert "defect" in record["meta"]
        if "text" in record:
            assert isinstance(record["text"], str) and record["text"]
        if "messages" in record:
            check_messages(record)
            assert set(record["used_in"]) <= {"nano_v3", "super_v3", "ultra_v3"}


def test_chat_records_have_reasoning_and_multiple_turns(corpus: dict[str, list[dict]]) -> None:
    for category in ("stem_synthetic", "conversational", "math"):
        assistants = [
            m for r in corpus[category] for m in r["messages"] if m["role"] == "assistant"
        ]
        with_reasoning = sum(bool(m.get("reasoning_content")) for m in assistants)
        assert 0.5 < with_reasoning / len(assistants) < 0.9, category
        assert any("reasoning_content" not in m for m in assistants), category  # reasoning off
    for category in ("stem_synthetic", "conversational"):
        users = [sum(m["role"] == "user" for m in r["messages"]) for r in corpus[category]]
        assert sum(u > 1 for u in users) >= 0.1 * len(users), category
    assert sum("tools" in r for r in corpus["conversational"]) > 20


def test_multilingual_safety_languages(corpus: dict[str, list[dict]]) -> None:
    records = corpus["multilingual_safety"]
    assert set(Counter(r["lang"] for r in records)) == {"en", "de", "es", "fr", "it", "ja", "zh"}
    assert {r["label"] for r in records} == {"safe", "unsafe"}
    japanese = next(r for r in records if r["lang"] == "ja")
    assert re.search(r"[\u3040-\u30ff]", japanese["messages"][-1]["content"])


def test_long_context_document_lengths(corpus: dict[str, list[dict]]) -> None:
    clean = [r for r in corpus["long_context"] if r["meta"]["defect"] not in JUNK]
    assert all(20_000 <= len(r["text"]) <= 60_000 for r in clean)


def heuristic_ok(text: str) -> bool:
    """The usual Gopher-style quality rules."""
    words = text.split()
    if len(words) < 50 or not 3 <= sum(map(len, words)) / len(words) <= 10:
        return False
    if (text.count("#") + text.count("...")) / len(words) > 0.1:
        return False
    lines = [line for line in text.split("\n") if line.strip()]
    return len(set(lines)) / len(lines) >= 0.7


@pytest.mark.parametrize("category", TEXT_CATEGORIES)
def test_text_defects_are_planted_and_filterable(
    corpus: dict[str, list[dict]], category: str
) -> None:
    records = corpus[category]
    defects = Counter(r["meta"]["defect"] for r in records)
    assert {"short", "repetitive", "symbols", "duplicate", "near_duplicate"} <= set(defects)
    junk = [r for r in records if r["meta"]["defect"] in JUNK]
    clean = [r for r in records if r["meta"]["defect"] is None]
    assert 0.04 <= len(junk) / len(records) <= 0.12
    assert not any(heuristic_ok(r["text"]) for r in junk)
    assert sum(heuristic_ok(r["text"]) for r in clean) >= 0.85 * len(clean)
    # Exact duplicates are the planted ones (and the records they copy), nothing else.
    by_text = Counter(r["text"] for r in records)
    dup = {
        r["id"] for r in records if by_text[r["text"]] > 1 and r["meta"]["defect"] != "duplicate"
    }
    sources = {r["meta"]["duplicate_of"] for r in records if r["meta"]["defect"] == "duplicate"}
    assert dup <= sources
    for r in records:
        if r["meta"]["defect"] == "near_duplicate":
            source = next(s for s in records if s["id"] == r["meta"]["duplicate_of"])
            a, b = source["text"].split(" "), r["text"].split(" ")
            assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1


def shingles(text: str) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + 5]) for i in range(len(words) - 4)}


@pytest.mark.parametrize("category", ["pretrain_text", "math", "code"])
def test_no_unplanned_near_duplicates(corpus: dict[str, list[dict]], category: str) -> None:
    """Two clean records never reach 5-gram Jaccard 0.8, the usual fuzzy-dedup threshold."""
    clean = [shingles(r["text"]) for r in corpus[category] if r["meta"]["defect"] is None]
    for a, b in combinations(clean, 2):
        if min(len(a), len(b)) >= 0.8 * max(len(a), len(b)):
            assert len(a & b) < 0.8 * len(a | b)


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_benchmark_leaks_are_exactly_the_planted_ones(corpus: dict[str, list[dict]]) -> None:
    items = [json.loads(line) for line in (SAMPLES / BENCHMARKS_FILE).open(encoding="utf-8")]
    assert 45 <= len(items) <= 60 and all({"id", "question", "answer"} <= set(i) for i in items)
    owners: dict[tuple[str, ...], set[str]] = {}
    for item in items:
        for gram in ngrams(item["question"]):
            owners.setdefault(gram, set()).add(item["id"])
    for category, records in corpus.items():
        for record in records:
            hits = set().union(*(owners.get(g, set()) for g in ngrams(flat_text(record))))
            if record["meta"]["defect"] == "contaminated":
                # Items from one template share wording, so a quote can match its siblings too.
                assert record["meta"]["benchmark_id"] in hits
            else:
                assert not hits, (category, record["id"])
    for category in ("math", "stem_synthetic"):
        leaks = sum(r["meta"]["defect"] == "contaminated" for r in corpus[category])
        assert 1 <= leaks <= 0.02 * len(corpus[category])


@pytest.mark.parametrize("category", AGENT_CATEGORIES)
def test_trajectory_defects_match_their_flags(corpus: dict[str, list[dict]], category: str) -> None:
    records = corpus[category]
    defects = Counter(r["meta"]["defect"] for r in records)
    assert set(defects) == {None, "unfinished", "tests_failed", "malformed_tool_call"}
    assert 0.07 <= (len(records) - defects[None]) / len(records) <= 0.15
    for r in records:
        defect = r["meta"]["defect"]
        assert r["finished"] == (defect != "unfinished")
        assert r["tests_passed"] == (defect not in {"unfinished", "tests_failed"})
        if category == "swe_trajectory" and defect is None:
            assert r["test_results"]["failed"] == 0 and r["test_results"]["passed"] > 0
        if defect == "malformed_tool_call":
            detail = r["meta"]["defect_detail"]
            names = {t["function"]["name"] for t in r.get("tools", [])}
            calls = [c["function"] for m in r["messages"] for c in m.get("tool_calls", [])]
            if detail == "missing_tools":
                assert "tools" not in r
            elif detail == "unknown_tool":
                assert any(c["name"] not in names for c in calls)
            else:
                with pytest.raises(json.JSONDecodeError):
                    for c in calls:
                        json.loads(c["arguments"])
        else:
            assert all(
                json.loads(c["function"]["arguments"]) is not None
                for m in r["messages"]
                for c in m.get("tool_calls", [])
            )


def test_code_is_valid_python(corpus: dict[str, list[dict]]) -> None:
    for r in corpus["code"]:
        if r["meta"]["defect"] in {None, "duplicate"}:
            ast.parse(r["text"])
    for r in corpus["cuda_kernel"]:
        ast.parse(r["pytorch_reference"])


def test_cuda_kernels_pair_torch_and_benchmarks(corpus: dict[str, list[dict]]) -> None:
    records = corpus["cuda_kernel"]
    bad = 0
    for r in records:
        assert "__global__" in r["cuda_kernel"] and "import torch" in r["pytorch_reference"]
        assert r["cuda_kernel"].count("{") == r["cuda_kernel"].count("}")
        slower = r["benchmark"]["kernel_ms"] > r["benchmark"]["reference_ms"]
        assert slower == (r["meta"]["defect"] == "slower")
        assert r["verified"] == (r["meta"]["defect"] != "unverified")
        bad += slower or not r["verified"]
    assert 0.10 <= bad / len(records) <= 0.20


# --- the default tokenizer -------------------------------------------------------------

tokenizers = pytest.importorskip("tokenizers")


def test_tokenizer_vocab_and_special_tokens() -> None:
    from factory.data.train_tokenizer import SPECIAL_TOKENS

    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    assert tok.get_vocab_size() == 4096
    assert SPECIAL_TOKENS == {
        "<pad>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3,
        "<think>": 4, "</think>": 5, "<tool_call>": 6, "</tool_call>": 7,
    }  # fmt: skip
    for token, index in SPECIAL_TOKENS.items():
        assert tok.token_to_id(token) == index
        assert tok.encode(f"a{token}b").ids.count(index) == 1  # one token, even mid-word
    ids = tok.encode("<|im_start|>assistant\n<think>hm</think>ok<|im_end|>").ids
    assert tok.decode(ids) == "assistant\n<think>hm</think>ok"  # 0-3 skipped, 4-7 kept
    assert TOKENIZER.stat().st_size < 1_000_000


@pytest.mark.parametrize(
    "text",
    [
        "The tram depot in Lowbridge opened in 1911; 42 carriages, 3 turntables.",
        "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n",
        "Größe, señal, naïve café — 東京で「こんにちは」、你好！ 😀",
        '<|im_start|>user\nhi<|im_end|>\n<tool_call>{"a": [1, 2]}</tool_call>  trailing  ',
    ],
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_round_trips_the_corpus(corpus: dict[str, list[dict]]) -> None:
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    texts = [flat_text(r) for records in corpus.values() for r in records[:5]]
    decoded = tok.decode_batch([e.ids for e in tok.encode_batch(texts)], skip_special_tokens=False)
    assert decoded == texts


def test_retraining_gives_the_shipped_tokenizer(tmp_path: Path) -> None:
    """Regenerate with ``python -m factory.data.train_tokenizer`` if this fails (about 1 s)."""
    from factory.data.train_tokenizer import (
        TRAINED_WITH,
        corpus_texts,
        train_tokenizer,
        write_tokenizer,
    )

    first = write_tokenizer(train_tokenizer(corpus_texts(SAMPLES)), tmp_path / "a.json")
    second = write_tokenizer(train_tokenizer(corpus_texts(SAMPLES)), tmp_path / "b.json")
    assert first.read_bytes() == second.read_bytes()
    if tokenizers.__version__ != TRAINED_WITH:
        pytest.skip(f"shipped tokenizer was trained with tokenizers {TRAINED_WITH}")
    assert first.read_bytes() == TOKENIZER.read_bytes()
