"""The ``search_trajectory`` family: multi-hop questions answered with search and page tools.

Each record invents a small world (a person, their birthplace, the river through
it) and a question that needs 2-3 hops through it. Records are ``{"id",
"question", "answer", "messages", "tools", "finished", "tests_passed",
"used_in", "meta": {"topic", "defect", "hops"}}``; ``tests_passed`` says whether
the final answer matches. ~11% are planted failures (``unfinished``,
``tests_failed``: the distractor's answer, ``malformed_tool_call``).
"""

from __future__ import annotations

import json
import random

from factory.data.samples.common import (
    TRAJECTORY_DEFECTS,
    assistant,
    break_tool_call,
    plan_defects,
    reasoning_fields,
    tool_call,
    tool_definition,
    tool_result,
    used_in,
)
from factory.data.samples.prose import Prose
from factory.data.samples.words import TOPICS

__all__ = ["search_trajectory"]

TOOLS = [
    tool_definition(
        "search",
        "Web search; returns the top results as JSON.",
        {"query": ("string", "Search query"), "max_results": ("integer", "How many results")},
        ["query"],
    ),
    tool_definition(
        "open_page",
        "Fetch a page and return its main text.",
        {"url": ("string", "Page URL")},
        ["url"],
    ),
]
_SYLLABLES = (
    "vel",
    "ost",
    "mar",
    "ren",
    "kal",
    "dor",
    "ith",
    "bra",
    "sen",
    "lun",
    "tor",
    "ama",
    "quel",
)
_ROLES = ("composer", "cartographer", "botanist", "shipwright", "astronomer", "weaver", "engineer")


def _proper(r: random.Random, parts: int) -> str:
    return "".join(r.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _world(r: random.Random) -> dict:
    return {
        "person": f"{_proper(r, 2)} {_proper(r, 3)}",
        "role": r.choice(_ROLES),
        "born": r.randint(1720, 1960),
        "town": _proper(r, 3),
        "founded": r.randint(900, 1700),
        "river": f"the {_proper(r, 2)} river",
        "length_km": r.randint(40, 1900),
        "other_river": f"the {_proper(r, 2)} river",
        "other_length_km": r.randint(40, 1900),
    }


def _page(r: random.Random, facts: list[str]) -> str:
    prose = Prose(r, r.choice(TOPICS))
    sentences = [prose.sentence() for _ in range(r.randint(2, 4))]
    for fact in facts:
        sentences.insert(r.randrange(len(sentences) + 1), fact)
    return " ".join(sentences)


def _url(name: str) -> str:
    return "https://wiki.example.org/" + name.replace("the ", "").replace(" ", "_")


def _hops(
    r: random.Random, w: dict, kind: str
) -> tuple[str, str, str, list[tuple[str, str, str, str]]]:
    """(question, answer, distractor answer, hops); a hop is (reasoning, query, url, page text)."""
    person, town = w["person"], w["town"]
    bio = _page(r, [f"{person} (born {w['born']}) was a {w['role']} from {town}."])
    town_page = _page(
        r,
        [
            f"{town} was founded in {w['founded']}.",
            f"{town} lies on {w['river']}, not far from where it meets {w['other_river']}.",
        ],
    )
    hops = [
        (
            f"First find out where {person} was born.",
            f"{person} {w['role']} birthplace",
            _url(person),
            bio,
        ),
        (
            f"{person} was from {town}. Now look up {town}.",
            f"{town} town history",
            _url(town),
            town_page,
        ),
    ]
    if kind == "founded":
        question = f"In what year was the hometown of the {w['role']} {person} founded?"
        return question, str(w["founded"]), str(w["founded"] + r.randint(10, 90)), hops
    river_page = _page(r, [f"{w['river'].capitalize()} is {w['length_km']} km long."])
    hops.append(
        (
            f"{town} lies on {w['river']}; its length should be on its own page.",
            f"{w['river']} length km",
            _url(w["river"]),
            river_page,
        )
    )
    question = f"How long, in kilometres, is the river that flows through the hometown of {person}?"
    return question, f"{w['length_km']} km", f"{w['other_length_km']} km", hops


def search_trajectory(rng: random.Random, n: int) -> list[dict]:
    """Two- and three-hop lookups (search, open page) over an invented world per record."""
    plan = plan_defects(rng, n, TRAJECTORY_DEFECTS)
    records = []
    for i in range(n):
        defect = plan.get(i)
        kind = rng.choice(("founded", "river_length"))
        world = _world(rng)
        question, answer, distractor, hops = _hops(rng, world, kind)
        messages: list[dict] = [{"role": "user", "content": question}]
        for reasoning, query, url, page in hops:
            results = [
                {
                    "title": url.rsplit("/", 1)[1].replace("_", " "),
                    "url": url,
                    "snippet": page[:120],
                }
            ]
            results.append(
                {
                    "title": "Unrelated",
                    "url": _url(_proper(rng, 3)),
                    "snippet": Prose(rng).sentence(),
                }
            )
            search = tool_call(rng, "search", {"query": query})
            fetch = tool_call(rng, "open_page", {"url": url})
            messages += [
                assistant("", reasoning_fields(rng, reasoning), tool_calls=[search]),
                tool_result(search, json.dumps(results, ensure_ascii=False)),
                assistant(
                    "",
                    reasoning_fields(rng, "The first result is the right page."),
                    tool_calls=[fetch],
                ),
                tool_result(fetch, page),
            ]
        final = distractor if defect == "tests_failed" else answer
        record = {"id": f"search_trajectory-{i:05d}", "question": question, "answer": answer}
        record.update(messages=messages, tools=TOOLS, finished=True, tests_passed=final == answer)
        if defect == "unfinished":
            record["messages"] = messages[:5]  # stopped after the first hop
            record.update(finished=False, tests_passed=False)
        else:
            messages.append(
                assistant(f"The answer is {final}.", reasoning_fields(rng, f"So: {final}."))
            )
        record.update(
            used_in=used_in(rng), meta={"topic": kind, "defect": defect, "hops": len(hops)}
        )
        if defect == "malformed_tool_call":
            record["meta"]["defect_detail"] = break_tool_call(rng, record)
        records.append(record)
    return records
