"""Plain-text families: web-style articles (``pretrain_text``) and ``long_context`` reports.

Records are ``{"id", "text", "url", "meta": {"topic", "defect"}}``. About 5% are
junk (too short, repeated lines, symbol soup), 2% exact duplicates and 2%
near-duplicates (one word changed) of an earlier record.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from factory.data.samples.common import JUNK_KINDS, plan_defects
from factory.data.samples.prose import Prose, junk_text, mutate_one_word
from factory.data.samples.words import PLACES, TOPICS

__all__ = ["TEXT_DEFECT_RATES", "long_context", "plant_text_defects", "pretrain_text"]

TEXT_DEFECT_RATES: dict[str, float] = {
    **dict.fromkeys(JUNK_KINDS, 0.05 / len(JUNK_KINDS)),
    "duplicate": 0.02,
    "near_duplicate": 0.02,
}


def plant_text_defects(
    rng: random.Random,
    records: list[dict],
    *,
    rates: dict[str, float] = TEXT_DEFECT_RATES,
    set_text: Callable[[dict, str, dict | None], None] | None = None,
) -> None:
    """Overwrite some clean records in place with junk, duplicates and near-duplicates.

    ``set_text(record, text, source)`` writes a new text into a record (default:
    its ``text`` field); ``source`` is the record a duplicate copies, else None.
    Families whose records hold the text in several fields pass their own.
    """
    set_text = set_text or (lambda record, text, _source: record.__setitem__("text", text))
    plan = plan_defects(rng, len(records), rates)
    for index in sorted(plan):
        kind = plan[index]
        record = records[index]
        if kind in JUNK_KINDS:
            set_text(record, junk_text(rng, kind), None)
        else:
            clean = [i for i in range(index) if records[i]["meta"]["defect"] is None]
            source = records[rng.choice(clean)]
            text = source["text"]
            set_text(record, text if kind == "duplicate" else mutate_one_word(rng, text), source)
            record["meta"]["duplicate_of"] = source["id"]
        record["meta"]["defect"] = kind


def _url(rng: random.Random, title: str) -> str:
    slug = "-".join(title.lower().split())[:60]
    host = rng.choice(("example.org", "example.net", "example.com"))
    return f"https://{rng.choice(PLACES).lower()}.{host}/{rng.randint(1998, 2024)}/{slug}"


def pretrain_text(rng: random.Random, n: int) -> list[dict]:
    """Web-style articles of ~150-700 words."""
    records = []
    for i in range(n):
        prose = Prose(rng)
        text = prose.document()
        records.append(
            {
                "id": f"pretrain_text-{i:05d}",
                "text": text,
                "url": _url(rng, text.split("\n", 1)[0]),
                "meta": {"topic": prose.topic.name, "defect": None},
            }
        )
    plant_text_defects(rng, records)
    return records


def _long_document(rng: random.Random, min_chars: int, max_chars: int) -> tuple[str, list[str]]:
    """A multi-section report that drifts across topics, with a few facts to retrieve.

    The facts (``Registry code for ...``) are planted at random depths so a
    long-context eval can ask for them; the report ends with a question about one.
    """
    target = rng.randint(min_chars, max_chars)
    topics = rng.sample(TOPICS, rng.randint(2, 4))
    title = Prose(rng, topics[0]).title()
    parts = [f"{title}\n\nA report in several parts, compiled from field notes and letters."]
    facts: list[tuple[str, str]] = []
    length = len(parts[0])
    section = 0
    while length < target:
        section += 1
        prose = Prose(rng, topics[section % len(topics)])
        paragraphs = [prose.paragraph(4, 8) for _ in range(rng.randint(3, 6))]
        fact = None
        if rng.random() < 0.3:
            fact = (prose.name(), f"{rng.choice('KMRTVX')}-{rng.randint(1000, 9999)}")
            paragraphs.insert(
                rng.randrange(len(paragraphs) + 1), f"Registry code for {fact[0]}: {fact[1]}."
            )
        text = f"## Part {section}: {prose.title()}\n\n" + "\n\n".join(paragraphs)
        if length + len(text) + 300 > max_chars and length >= min_chars:
            break  # leave room for the closing question
        parts.append(text)
        length += len(text) + 2
        if fact:
            facts.append(fact)
    if facts:
        subject, code = rng.choice(facts)
        parts.append(f"Question: what is the registry code for {subject}?\nAnswer: {code}")
    return "\n\n".join(parts), [t.name for t in topics]


def long_context(rng: random.Random, n: int) -> list[dict]:
    """Reports of 20,000-60,000 characters (the long-context extension phase)."""
    records = []
    for i in range(n):
        text, topics = _long_document(rng, 20_000, 60_000)
        records.append(
            {
                "id": f"long_context-{i:05d}",
                "text": text,
                "url": _url(rng, text.split("\n", 1)[0]),
                "meta": {"topic": topics[0], "topics": topics, "defect": None},
            }
        )
    plant_text_defects(rng, records)
    return records
