"""English prose from templates: sentences, paragraphs, titles and junk.

A template is a string with ``{SLOT}`` markers; every marker is filled with a
fresh random choice from the topic's vocabulary, so two sentences from the same
template rarely share more than a few words. That keeps exact-line and MinHash
near-duplicate detection honest: only the duplicates we plant are duplicates.
"""

from __future__ import annotations

import random
import re

from factory.data.samples.words import (
    CONNECTORS,
    FIRST_NAMES,
    LAST_NAMES,
    PLACES,
    TOPICS,
    Topic,
    wordlist,
)

__all__ = ["Prose", "junk_text", "plural", "sentence_case"]

_SENTENCES: tuple[str, ...] = (
    "The {A} {N} {V} the {N} {ADV}.",
    "{C} the {N} {V} more {Ns} than most {Rs} expected.",
    "According to {NM}, {aR} from {P}, the {Ns} of the region {Vd} {NUMW} {Ns} in {Y}.",
    "Most {Ns} near {P} are {A}, but a few {Vb} the {N} during the {SEASON}.",
    "It is worth noting that {AN} rarely {V} without {AN}.",
    "{NM} once described the {N} as {A} and {A}, a view that many {Rs} still share.",
    "When the {N} {V} the {N}, the result is usually {A}.",
    "There are at least {NUMW} reasons why {Ns} matter to {Rs} in {P}.",
    "Why does the {N} {Vb} so {ADV}? The short answer is that {Ns} are more {A} than they look.",
    "In {Y}, the {Rs} of {P} {Vd} {AN} and {Vd} the {N} for the first time.",
    "{aR} who {V} {Ns} every {SEASON} will tell you that the {N} is {A}.",
    "{C} {NM} {Vd} the {A} {N} and wrote a long note about it.",
    "Each {N} {V} in its own way, so no two {Ns} are quite alike.",
    "The records show {NUM} {Ns} and {NUM} {Ns}, a ratio that surprised the {Rs}.",
    "{C} nobody in {P} {Vd} the {N} until {NM} arrived.",
    "If the {N} is {A}, the {Rs} usually {Vb} it before the {SEASON} ends.",
    "Few {Rs} agree on how to {Vb} {AN}, and the debate continues.",
    "The {N} that {NM} {Vd} still sits beside the {A} {N} in {P}.",
    "What makes {AN} useful is not its size but the way it {V} the {N}.",
    "{C} the old {Ns} {Vd} {ADV}, and the new ones {Vb} {ADV}.",
    "Visitors to {P} often ask about the {A} {Ns}, which {Vb} the {N} each {SEASON}.",
    "Over {NUMW} decades, the {Rs} counted {NUM} {Ns} along the {A} {N}.",
    'One {R} put it simply: "{AN} {V} the {N} better than any {N} I know."',
    "The {N} is more {A} than the {N}, at least in {P}.",
    "{NM} and {NM} spent {NUMW} {PERIOD} trying to {Vb} the {N}.",
    "Nothing about the {N} is {A} once you learn to {Vb} it.",
    "As the {Ns} {Vb} the {N}, the {Rs} keep careful notes.",
    "Some {Rs} prefer to {Vb} the {N} by hand, while others rely on {AN}.",
    "{C} the story of the {N} in {P} is really a story about {Ns}.",
    "In short, {Ns} {Vb} {Ns}, and {Ns} {Vb} almost everything else.",
    "A survey from {Y} lists {NUM} {A} {Ns}, most of them close to {P}.",
    "{C} the {Rs} learned to {Vb} the {N} long before anyone wrote about it.",
)
_TITLES: tuple[str, ...] = (
    "The {A} {Ns} of {P}",
    "Notes on the {N}",
    "How {Rs} {Vb} the {N}",
    "A Short History of the {A} {N}",
    "{P} and Its {Ns}",
    "Why the {N} Matters",
)
_ADVERBS = wordlist(
    "slowly quickly quietly steadily carefully unevenly rarely often gradually suddenly"
)
_SEASONS = wordlist("spring summer autumn winter harvest wet-season")
_PERIODS = wordlist("weeks months summers winters years")
_NUMBER_WORDS = wordlist("two three four five six seven several")
_MINOR_WORDS = frozenset({"a", "an", "and", "of", "on", "the"})
_SLOT = re.compile(r"\{(\w+)\}")


def plural(noun: str) -> str:
    """English plural; ``noun:plural`` entries carry their own irregular plural."""
    if ":" in noun:
        return noun.split(":", 1)[1]
    if noun.endswith("man"):
        return noun[:-3] + "men"
    if noun.endswith(("s", "x", "ch", "sh", "z")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def singular(noun: str) -> str:
    return noun.split(":", 1)[0]


def _past(verb: str) -> str:
    if ":" in verb:
        return verb.split(":", 1)[1]
    base = verb
    if base.endswith("e"):
        return base + "d"
    if base.endswith("y") and base[-2] not in "aeiou":
        return base[:-1] + "ied"
    return base + "ed"


def _third(verb: str) -> str:
    base = verb.split(":", 1)[0]
    if base.endswith(("s", "x", "ch", "sh", "z", "o")):
        return base + "es"
    if base.endswith("y") and base[-2] not in "aeiou":
        return base[:-1] + "ies"
    return base + "s"


def article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:]


class Prose:
    """Random English text about one topic (or a changing mix of topics)."""

    def __init__(self, rng: random.Random, topic: Topic | None = None) -> None:
        self.rng = rng
        self.topic = topic or rng.choice(TOPICS)

    def name(self) -> str:
        return f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(LAST_NAMES)}"

    def fill(self, template: str) -> str:
        """Fill every ``{SLOT}`` of ``template`` with a fresh random word."""
        return _SLOT.sub(lambda m: self._slot(m.group(1)), template)

    def _slot(self, kind: str) -> str:
        r, t = self.rng, self.topic
        fillers = {
            "N": lambda: singular(r.choice(t.nouns)),
            "Ns": lambda: plural(r.choice(t.nouns)),
            "A": lambda: r.choice(t.adjectives),
            "AN": lambda: article(f"{r.choice(t.adjectives)} {singular(r.choice(t.nouns))}"),
            "V": lambda: _third(r.choice(t.verbs)),
            "Vb": lambda: r.choice(t.verbs).split(":", 1)[0],
            "Vd": lambda: _past(r.choice(t.verbs)),
            "R": lambda: r.choice(t.roles),
            "aR": lambda: article(r.choice(t.roles)),
            "Rs": lambda: plural(r.choice(t.roles)),
            "P": lambda: r.choice(PLACES),
            "NM": self.name,
            "C": lambda: r.choice(CONNECTORS),
            "ADV": lambda: r.choice(_ADVERBS),
            "SEASON": lambda: r.choice(_SEASONS),
            "PERIOD": lambda: r.choice(_PERIODS),
            "NUMW": lambda: r.choice(_NUMBER_WORDS),
            "NUM": lambda: str(r.randint(3, 480)),
            "Y": lambda: str(r.randint(1690, 2021)),
        }
        return fillers[kind]()

    def sentence(self) -> str:
        text = self.fill(self.rng.choice(_SENTENCES))
        # "{C} the ..." leaves a lowercase word after the comma; fix the first letter only.
        return sentence_case(text)

    def paragraph(self, lo: int = 3, hi: int = 7) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(lo, hi)))

    def title(self) -> str:
        words = self.fill(self.rng.choice(_TITLES)).split()
        return " ".join(
            w if i and w in _MINOR_WORDS else w[:1].upper() + w[1:] for i, w in enumerate(words)
        )

    def document(self, paragraphs: tuple[int, int] = (3, 7)) -> str:
        """A titled article: a title line and a few paragraphs separated by blank lines."""
        body = [self.paragraph() for _ in range(self.rng.randint(*paragraphs))]
        return "\n\n".join([self.title(), *body])


_BOILERPLATE = (
    "Click here to subscribe.",
    "Page not found.",
    "Loading...",
    "Accept all cookies",
    "Share this post",
    "Read more",
)
_SYMBOLS = "#$%&*@^~|<>{}[]=+_/\\"


def junk_text(rng: random.Random, kind: str) -> str:
    """Text that heuristic filters must drop: ``short``, ``repetitive`` or ``symbols``."""
    if kind == "short":
        return f"{' '.join(rng.sample(_BOILERPLATE, 2))} ({rng.randint(1, 9999)})"
    if kind == "repetitive":
        line = rng.choice(_BOILERPLATE)
        return "\n".join([line] * rng.randint(20, 40))
    if kind == "symbols":
        lines = (
            "".join(rng.choice(_SYMBOLS) for _ in range(rng.randint(20, 60)))
            for _ in range(rng.randint(10, 20))
        )
        return "\n".join(lines)
    raise ValueError(f"unknown junk kind {kind!r}")


def mutate_one_word(rng: random.Random, text: str) -> str:
    """A near-duplicate: ``text`` with one word (not the first) replaced."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if i > 0 and w.isalpha() and len(w) > 3]
    i = rng.choice(candidates)
    replacement = rng.choice(
        [w for w in ("harbor", "orchard", "ledger", "lantern") if w != words[i]]
    )
    words[i] = replacement
    return " ".join(words)
