"""The ``multilingual_safety`` family: harmful and harmless-but-alarming prompts in 7 languages.

Records are ``{"id", "messages", "lang", "label", "used_in", "meta": {"topic",
"defect"}}``. ``label`` is ``unsafe`` (the assistant declines and offers a safe
alternative) or ``safe`` (over-safety probes such as "kill a process", which the
assistant answers). Prompts and replies were written for factory in English,
German, Spanish, French, Italian, Japanese and Chinese; reasoning is in English,
as in deliberative-alignment traces.
"""

from __future__ import annotations

import random

from factory.data.samples.common import assistant, reasoning_fields, used_in
from factory.data.samples.safety_text import ITEMS, LANGS
from factory.data.samples.words import FIRST_NAMES

__all__ = ["multilingual_safety"]

_SYSTEM = (
    "You are a helpful assistant. Reply in the user's language.",
    "You are a careful assistant that follows the safety policy.",
    "Answer briefly and in the same language as the question.",
)


def multilingual_safety(rng: random.Random, n: int) -> list[dict]:
    """Safety chats; every (item, language, name, system prompt) combination appears at most once."""
    records: list[dict] = []
    seen: set[tuple[int, str, str, int]] = set()
    while len(records) < n:
        item_index, lang = rng.randrange(len(ITEMS)), rng.choice(LANGS)
        name, system = rng.choice(FIRST_NAMES), rng.randrange(len(_SYSTEM) + 2)  # 2 of 5: none
        key = (item_index, lang, name, system)
        if key in seen:
            continue
        seen.add(key)
        item = ITEMS[item_index]
        prompt, reply = (t.format(name=name) for t in item["text"][lang])
        messages: list[dict] = []
        if system < len(_SYSTEM):
            messages.append({"role": "system", "content": _SYSTEM[system]})
        messages += [
            {"role": "user", "content": prompt},
            assistant(reply, reasoning_fields(rng, item["reasoning"])),
        ]
        records.append(
            {
                "id": f"multilingual_safety-{len(records):05d}",
                "messages": messages,
                "lang": lang,
                "label": item["label"],
                "used_in": used_in(rng),
                "meta": {"topic": item["category"], "defect": None},
            }
        )
    return records
