"""The ``math`` family: worked problems usable as plain text or as chat with reasoning.

Records are ``{"id", "text", "messages", "answer", "used_in", "meta": {"topic",
"defect"}}``: ``text`` is "Problem: ... Solution: ... The answer is N." for
pretraining; ``messages`` is the same problem as a user turn and an assistant
turn with ``reasoning_content`` (on most records) and a ``\\boxed{}`` answer.
Every answer is computed, so the records are correct as well as well-formed.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from fractions import Fraction

from factory.data.samples.benchmarks import contaminate
from factory.data.samples.common import assistant, reasoning_fields, used_in
from factory.data.samples.prose import Prose
from factory.data.samples.text import plant_text_defects
from factory.data.samples.words import FIRST_NAMES, PLACES

__all__ = ["math_problems"]

Problem = tuple[str, list[str], str]  # (statement, solution steps, answer)


def _linear(r: random.Random) -> Problem:
    a, x, b = r.randint(2, 12), r.randint(-15, 25), r.randint(-40, 40)
    c = a * x + b
    return (
        f"Solve for x in the equation {a}x + {b} = {c}, and check the solution by substitution.",
        [
            f"Subtract {b} from both sides to isolate the term with x: {a}x = {c} - {b} = {c - b}.",
            f"Divide both sides by {a}: x = {c - b} / {a} = {x}.",
            f"Check: {a} times {x} is {a * x}, and adding {b} gives {c}, which matches.",
        ],
        str(x),
    )


def _change(r: random.Random) -> Problem:
    name, n, price = r.choice(FIRST_NAMES), r.randint(2, 9), r.randint(3, 24)
    bill = next(b for b in (20, 50, 100, 200, 500) if b > n * price)  # n * price <= 216
    item = r.choice(
        ("notebooks", "jars of honey", "loaves of bread", "tram tickets", "spools of yarn")
    )
    return (
        f"{name} buys {n} {item} at {price} coins each at the market in {r.choice(PLACES)} and pays "
        f"with a {bill}-coin note. How much change should {name} receive?",
        [
            f"The total cost is the number of items times the price: {n} x {price} = {n * price} coins.",
            f"The change is the amount paid minus the cost: {bill} - {n * price} = {bill - n * price} coins.",
        ],
        str(bill - n * price),
    )


def _percent(r: random.Random) -> Problem:
    price, pct = r.randint(4, 60) * 5, r.choice((10, 15, 20, 25, 30, 40))
    new = Fraction(price * (100 - pct), 100)
    return (
        f"A shop lowers the price of a lantern from {price} coins by {pct} percent for the winter "
        "sale. What is the sale price of the lantern?",
        [
            f"A discount of {pct} percent leaves {100 - pct} percent of the original price.",
            f"So the sale price is {price} x {100 - pct}/100 = {float(new):g} coins.",
        ],
        f"{float(new):g}",
    )


def _series(r: random.Random) -> Problem:
    a1, d, n = r.randint(1, 20), r.randint(2, 9), r.randint(8, 30)
    last = a1 + (n - 1) * d
    total = n * (a1 + last) // 2
    return (
        f"Find the sum of the first {n} terms of the arithmetic sequence {a1}, {a1 + d}, "
        f"{a1 + 2 * d}, and so on.",
        [
            f"The common difference is {d}, so the {n}th term is {a1} + ({n} - 1) x {d} = {last}.",
            "The sum of an arithmetic sequence is the number of terms times the mean of the first "
            "and last terms.",
            f"So the sum is {n} x ({a1} + {last}) / 2 = {total}.",
        ],
        str(total),
    )


def _gcd_lcm(r: random.Random) -> Problem:
    g = r.randint(2, 12)
    a, b = g * r.randint(2, 15), g * r.randint(2, 15)
    gcd, lcm = math.gcd(a, b), a * b // math.gcd(a, b)
    return (
        f"Find the greatest common divisor and the least common multiple of {a} and {b}, and "
        "report their sum.",
        [
            f"Using the Euclidean algorithm, the greatest common divisor of {a} and {b} is {gcd}.",
            f"The least common multiple is {a} x {b} / {gcd} = {lcm}.",
            f"Their sum is {gcd} + {lcm} = {gcd + lcm}.",
        ],
        str(gcd + lcm),
    )


def _quadratic(r: random.Random) -> Problem:
    p, q = sorted(r.sample(range(-9, 13), 2))
    s, prod = p + q, p * q
    return (
        f"Find both roots of the quadratic equation x^2 - ({s})x + ({prod}) = 0 and give the "
        "larger one.",
        [
            f"We look for two numbers whose sum is {s} and whose product is {prod}.",
            f"The numbers {p} and {q} work, since {p} + {q} = {s} and {p} x {q} = {prod}.",
            f"So the equation factors as (x - ({p}))(x - ({q})) = 0, with roots {p} and {q}.",
        ],
        str(q),
    )


def _dice(r: random.Random) -> Problem:
    k = r.randint(3, 11)
    ways = sum(1 for a in range(1, 7) for b in range(1, 7) if a + b == k)
    p = Fraction(ways, 36)
    return (
        f"Two fair six-sided dice are rolled once. What is the probability that the two numbers "
        f"showing add up to exactly {k}?",
        [
            "There are 6 x 6 = 36 equally likely outcomes.",
            f"Counting the ordered pairs with sum {k} gives {ways} outcomes.",
            f"So the probability is {ways}/36, which simplifies to {p.numerator}/{p.denominator}.",
        ],
        f"{p.numerator}/{p.denominator}",
    )


def _committee(r: random.Random) -> Problem:
    n, k = r.randint(6, 14), r.randint(2, 5)
    return (
        f"The weavers' guild of {r.choice(PLACES)} has {n} members and must choose a committee of "
        f"{k}. In how many ways can the committee be chosen if the order does not matter?",
        [
            f"Choosing {k} of {n} without regard to order counts combinations: C({n}, {k}).",
            f"C({n}, {k}) = {n}! / ({k}! x {n - k}!) = {math.comb(n, k)}.",
        ],
        str(math.comb(n, k)),
    )


_FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "algebra": _linear,
    "arithmetic": _change,
    "percent": _percent,
    "sequences": _series,
    "number_theory": _gcd_lcm,
    "quadratics": _quadratic,
    "probability": _dice,
    "combinatorics": _committee,
}


def _reasoning(r: random.Random, steps: list[str], answer: str) -> str:
    opener = r.choice(
        (
            "Let me work through this carefully.",
            "Okay, let me restate what is being asked before computing anything.",
            "I should set this up step by step.",
        )
    )
    middle = " ".join(
        f"{r.choice(('First,', 'Next,', 'Then', 'Now'))} {s[0].lower()}{s[1:]}" for s in steps
    )
    check = r.choice(("Let me double-check the arithmetic.", "Does that make sense? Yes."))
    return f"{opener} {middle} {check} So the answer is {answer}."


def _text(statement: str, steps: list[str], answer: str) -> str:
    return f"Problem: {statement}\n\nSolution: {' '.join(steps)}\n\nThe answer is {answer}."


def _messages(r: random.Random, statement: str, steps: list[str], answer: str) -> list[dict]:
    content = "\n".join([*steps, f"\nThe answer is \\boxed{{{answer}}}."])
    return [
        {"role": "user", "content": statement},
        assistant(content, reasoning_fields(r, _reasoning(r, steps, answer))),
    ]


def _set_text(record: dict, text: str, source: dict | None) -> None:
    """Planted defects: junk replaces the problem, (near-)duplicates copy the source."""
    record["text"] = text
    if source is None:
        record["messages"] = [{"role": "user", "content": text}, assistant("I cannot solve this.")]
    else:
        record["messages"] = copy.deepcopy(source["messages"])
        record["messages"][0]["content"] = text.split("\n\nSolution:", 1)[0].removeprefix(
            "Problem: "
        )
        record["answer"] = source["answer"]


def math_problems(rng: random.Random, n: int) -> list[dict]:
    """Competition-style word problems with computed answers (8 families)."""
    records: list[dict] = []
    seen: set[str] = set()
    while len(records) < n:
        i = len(records)
        topic = rng.choice(sorted(_FAMILIES))
        statement, steps, answer = _FAMILIES[topic](rng)
        if statement in seen:  # templates repeat; only planted duplicates may
            continue
        seen.add(statement)
        # Scene-setting prose, as in synthetic word problems; it also keeps two problems
        # from one template (only the numbers differ) below near-duplicate similarity.
        prose = Prose(rng)
        statement = " ".join([*(prose.sentence() for _ in range(rng.randint(1, 2))), statement])
        records.append(
            {
                "id": f"math-{i:05d}",
                "text": _text(statement, steps, answer),
                "messages": _messages(rng, statement, steps, answer),
                "answer": answer,
                "used_in": used_in(rng),
                "meta": {"topic": topic, "defect": None},
            }
        )
    plant_text_defects(rng, records, set_text=_set_text)
    plant_contamination(rng, records, "factory-math-mini")
    return records


def plant_contamination(
    rng: random.Random, records: list[dict], suite: str, rate: float = 0.01
) -> None:
    """Append a quoted benchmark span to the user turn (and text) of ~1% of clean records."""
    clean = [rec for rec in records if rec["meta"]["defect"] is None]
    for record in rng.sample(clean, min(len(clean), max(1, round(rate * len(records))))):
        passage, item_id = contaminate(rng, suite)
        user = next(m for m in record["messages"] if m["role"] == "user")
        user["content"] = f"{user['content']}\n\n{passage}"
        if "text" in record:
            problem, rest = record["text"].split("\n\nSolution:", 1)
            record["text"] = f"{problem}\n\n{passage}\n\nSolution:{rest}"
        record["meta"].update(defect="contaminated", benchmark_id=item_id)
