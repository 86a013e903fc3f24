"""Benchmark n-gram decontamination (factory.data.steps.decontamination)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from factory.data.steps.decontamination import NgramIndex, read_benchmark_items
from factory.data.steps.dedup_hashing import prepare

_rng = np.random.default_rng(7)
VOCAB = ["".join(_rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 4 + i % 5)) for i in range(4000)]

QUESTION = (
    "Which of the following best explains why the boiling point of water decreases "
    "as altitude increases above sea level in mountainous regions of the world?"
)
QUESTION_WORDS = QUESTION.lower().rstrip("?").split()


def filler(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(VOCAB[i] for i in rng.integers(0, len(VOCAB), words))


@pytest.fixture(scope="module")
def index() -> NgramIndex:
    return NgramIndex.from_items(
        [QUESTION, "Paris is the capital and largest city of France", "B", "42", "True or false"]
    )


def test_13_gram_inside_a_long_document_is_caught(index: NgramIndex) -> None:
    window = QUESTION_WORDS[5:18]
    doc = f"{filler(1, 400)} {' '.join(window)} {filler(2, 400)}"
    assert index.contaminated(doc)
    assert index.first_match(doc) == " ".join(window)
    assert index.first_match(prepare(doc)) == " ".join(window)


def test_12_matching_words_are_not_caught(index: NgramIndex) -> None:
    for start in (0, 5, len(QUESTION_WORDS) - 12):
        doc = f"{filler(3, 300)} {' '.join(QUESTION_WORDS[start : start + 12])} {filler(4, 300)}"
        assert not index.contaminated(doc)
        assert index.first_match(doc) is None


def test_short_items_match_whole_and_tiny_items_are_ignored(index: NgramIndex) -> None:
    # 9 words: shorter than 13, so it matches as a whole; "B", "42" and "True or false"
    # are below min_words=8 and would flag ordinary text.
    assert index.items == 2 and index.skipped == 3
    assert index.lengths == (13, 9)
    caught = f"{filler(5, 50)} Paris is the capital and largest city of France. {filler(6, 50)}"
    assert index.first_match(caught) == "paris is the capital and largest city of france"
    assert not index.contaminated(f"{filler(5, 50)} Paris is the capital and largest city of Spain")
    assert not index.contaminated("The answer is B, not 42. True or false? True.")
    assert index.contaminated("paris is the capital and largest city of france")


def test_case_and_punctuation_do_not_hide_a_match(index: NgramIndex) -> None:
    shouted = (
        "WHICH of the following -- BEST explains, why: the Boiling point (of) WATER decreases!!!"
    )
    assert index.first_match(shouted) == " ".join(QUESTION_WORDS[:13])
    assert index.contaminated("Capital:\n\nPARIS  is the capital, and largest city... of France")


def test_no_false_positives_on_unrelated_text(index: NgramIndex) -> None:
    big = NgramIndex.from_items(filler(1000 + i, 60) for i in range(500))
    assert len(big) == 500 * (60 - 13 + 1)
    for seed in range(200):
        doc = filler(seed, 300)
        assert not index.contaminated(doc)
        assert not big.contaminated(doc)
    assert big.contaminated(f"{filler(9, 20)} {filler(1042, 60)}")


def test_earliest_match_wins() -> None:
    first, second = filler(11, 13), filler(12, 13)
    index = NgramIndex.from_items([second, first])
    assert index.first_match(f"intro {first} middle {second} end") == first


def test_empty_index_and_empty_documents() -> None:
    empty = NgramIndex.from_items([])
    assert len(empty) == 0 and empty.first_match(QUESTION) is None
    assert NgramIndex.from_items([QUESTION]).first_match("") is None
    with pytest.raises(ValueError, match="min_words"):
        NgramIndex.from_items([QUESTION], n=13, min_words=14)


def test_from_files_reads_every_string_field(tmp_path: Path) -> None:
    records = [
        {
            "id": "q1",
            "question": QUESTION,
            "choices": ["A short option", "Another one"],
            "answer": 2,
        },
        {"prompt": {"text": "Name the seven continents of the world in order of size please"}},
    ]
    jsonl = tmp_path / "bench.test.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    txt = tmp_path / "extra.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as handle:
        handle.write(
            "first line item\nThe mitochondria is the powerhouse of the cell, as every biology student learns early\n"
        )
    doc_json = tmp_path / "doc.json"
    doc_json.write_text(json.dumps({"items": [{"q": filler(20, 14)}]}), encoding="utf-8")

    assert list(read_benchmark_items(jsonl))[:2] == ["q1", QUESTION]
    index = NgramIndex.from_files([jsonl, txt, doc_json])
    assert index.items == 4  # question, continents prompt, mitochondria line, json item
    assert index.contaminated(
        "Quiz: name the seven continents of the world in order of size, please!"
    )
    assert index.contaminated(
        "Recall: the mitochondria is the powerhouse of the cell as every biology student learns"
    )
    assert index.contaminated(filler(20, 14))
    assert not index.contaminated("A short option. Another one. first line item.")


def test_bad_benchmark_files_fail_with_their_location(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "fine"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        NgramIndex.from_files([bad])
    with pytest.raises(ValueError, match="must be"):
        NgramIndex.from_files([tmp_path / "bench.csv"])
