"""A tiny benchmark of our own, and the planted leaks that decontamination must find.

``benchmarks.jsonl`` holds 50 question/answer items in two suites
(``factory-math-mini``, ``factory-stem-mini``). Their wording comes from
templates that no training family uses, so a 13-gram shared between a training
record and a benchmark item means a leak we planted with :func:`contaminate`
(``meta.defect == "contaminated"``, ``meta.benchmark_id``), and nothing else.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

__all__ = ["BENCHMARK_ITEMS", "benchmark_items", "contaminate"]

_ISLANDS = ("Skarra", "Velloch", "Brume", "Ithen", "Caskel", "Orrin", "Wendle", "Palgrave")


def _lamp(r: random.Random) -> tuple[str, str]:
    hours, k = r.choice((6, 8, 12)), r.randint(5, 40)
    day = (hours * (k - 1)) // 24 + 1
    q = (
        f"A lighthouse keeper on the island of {r.choice(_ISLANDS)} winds the clockwork lamp every "
        f"{hours} hours, beginning at midnight on the first day of the month; on which day of the "
        f"month is the lamp wound for the {k}th time?"
    )
    return q, str(day)


def _ferry(r: random.Random) -> tuple[str, str]:
    a, b = r.choice(((3, 4), (2, 5), (4, 6), (6, 9), (5, 10)))
    q = (
        f"Two ferries leave the harbor of {r.choice(_ISLANDS)} together at dawn, one returning every "
        f"{a} days and the other every {b} days; after how many days will both ferries next be "
        "moored in the harbor on the same morning?"
    )
    return q, str(a * b // _gcd(a, b))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _rope(r: random.Random) -> tuple[str, str]:
    total, piece = r.choice(((50, 7), (64, 9), (90, 11), (75, 8), (100, 13)))
    total += r.randint(0, 5)
    q = (
        f"A rope maker cuts a cord that is exactly {total} meters long into as many pieces of "
        f"{piece} meters as the cord allows, and keeps the leftover; how many meters of cord are left "
        "over at the end?"
    )
    return q, str(total % piece)


def _marbles(r: random.Random) -> tuple[str, str]:
    red, blue = r.randint(2, 9), r.randint(2, 9)
    p = Fraction(red * (red - 1), (red + blue) * (red + blue - 1))
    q = (
        f"An urn painted with seabirds holds {red} red marbles and {blue} blue marbles, and a child "
        "draws two marbles without looking and without putting the first one back; what is the "
        "probability that both marbles drawn are red?"
    )
    return q, f"{p.numerator}/{p.denominator}"


def _stairs(r: random.Random) -> tuple[str, str]:
    n = r.randint(5, 12)
    a, b = 1, 1
    for _ in range(n):
        a, b = b, a + b
    q = (
        f"A bell ringer climbs a tower staircase of {n} steps and on each stride goes up either "
        "one step or two steps at a time; in how many different ways can the bell ringer reach "
        "the top of the staircase?"
    )
    return q, str(a)


def _pendulum(r: random.Random) -> tuple[str, str]:
    factor = r.choice((4, 9, 16))
    q = (
        f"The length of a simple pendulum hanging in the old clock tower of {r.choice(_ISLANDS)} is "
        f"made {factor} times longer while the swing stays small; by what factor does the period "
        "of its swing change as a result?"
    )
    return q, str(int(factor**0.5))


def _brine(r: random.Random) -> tuple[str, str]:
    grams, liters = r.choice(((58, 2), (117, 4), (29, 1), (234, 8)))
    q = (
        f"A salt maker from {r.choice(_ISLANDS)} dissolves {grams} grams of sodium chloride, with a molar mass taken as 58.5 "
        f"grams per mole, in enough water to make {liters} liters of brine; what is the molarity of "
        "the brine to two decimal places?"
    )
    return q, f"{grams / 58.5 / liters:.2f}"


def _sled(r: random.Random) -> tuple[str, str]:
    mass, speed = r.choice(((20, 3), (40, 5), (10, 6), (60, 2)))
    q = (
        f"A sled of mass {mass} kilograms glides across the frictionless ice of {r.choice(_ISLANDS)} lake at {speed} meters "
        "per second before it strikes a snowbank and stops; how much kinetic energy in joules "
        "did the sled lose in the collision?"
    )
    return q, f"{0.5 * mass * speed**2:g}"


def _lens(r: random.Random) -> tuple[str, str]:
    f, d = r.choice(((10, 15), (20, 30), (12, 36), (5, 10)))
    image = Fraction(1, 1) / (Fraction(1, f) - Fraction(1, d))
    q = (
        f"A glassblower on {r.choice(_ISLANDS)} holds a thin converging lens with a focal length of {f} centimeters so that "
        f"a candle stands {d} centimeters in front of it; how far behind the lens, in centimeters, "
        "does the sharp image of the flame form?"
    )
    return q, f"{float(image):g}"


def _cells(r: random.Random) -> tuple[str, str]:
    hours, every = r.choice(((6, 2), (9, 3), (8, 2), (12, 4)))
    q = (
        f"A culture of yeast in a baker's starter from {r.choice(_ISLANDS)} doubles its cell count every {every} hours at "
        f"room temperature; if the starter holds one thousand cells now, how many cells will it "
        f"hold after {hours} hours?"
    )
    return q, str(1000 * 2 ** (hours // every))


_MATH: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _lamp,
    _ferry,
    _rope,
    _marbles,
    _stairs,
)
_STEM: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _pendulum,
    _brine,
    _sled,
    _lens,
    _cells,
)


def benchmark_items(seed: int = 0) -> list[dict]:
    """The 50 benchmark items, in a fixed order (30 math, 20 STEM; no repeated question)."""
    r = random.Random(f"benchmarks:{seed}")
    items: list[dict] = []
    seen: set[str] = set()
    for suite, makers, count in (
        ("factory-math-mini", _MATH, 30),
        ("factory-stem-mini", _STEM, 20),
    ):
        for attempt in range(100 * count):
            if sum(item["benchmark"] == suite for item in items) == count:
                break
            question, answer = makers[attempt % len(makers)](r)
            if question in seen:
                continue
            seen.add(question)
            items.append(
                {
                    "id": f"bench-{len(items):03d}",
                    "benchmark": suite,
                    "question": question,
                    "answer": answer,
                }
            )
    return items


BENCHMARK_ITEMS: list[dict] = benchmark_items()


def contaminate(rng: random.Random, suite: str) -> tuple[str, str]:
    """A passage quoting 15-22 consecutive words of one ``suite`` question; returns (passage, id)."""
    item = rng.choice([i for i in BENCHMARK_ITEMS if i["benchmark"] == suite])
    words = item["question"].split()
    length = rng.randint(15, min(22, len(words)))
    start = rng.randint(0, len(words) - length)
    span = " ".join(words[start : start + length])
    return f"A related exercise asks: {span}", item["id"]
