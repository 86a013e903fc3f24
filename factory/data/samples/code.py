"""The ``code`` family: small Python modules assembled from function templates.

Records are ``{"id", "text", "path", "meta": {"lang", "topic", "defect"}}``, with
the same planted junk and duplicates as the prose families. Identifiers are
drawn per module, so two modules built from the same templates still differ.
"""

from __future__ import annotations

import random
from string import Template

from factory.data.samples.prose import plural
from factory.data.samples.text import plant_text_defects
from factory.data.samples.words import PLACES, wordlist

__all__ = ["code"]

_NOUNS = wordlist(
    "order record sensor reading invoice ticket route sample entry shipment parcel "
    "station booking meter batch segment voucher visit"
)
_FIELDS = wordlist("weight price score duration distance priority capacity rating volume")
_KEYS = wordlist("region status owner category carrier channel")
_VERBS = wordlist("select keep filter pick retain choose")
_SYSTEMS = wordlist("inventory dispatch billing monitoring scheduling archive")
_ADJS = wordlist("heavy urgent stale valid late costly")

_FUNCTIONS: dict[str, str] = {
    "filter": '''def ${verb}_${nouns}(${nouns}: list[dict], min_${field}: float = ${num}) -> list[dict]:
    """Return the ${nouns} whose ${field} is at least ``min_${field}``, in input order."""
    kept = []
    for ${noun} in ${nouns}:
        if ${noun}.get("${field}", 0) >= min_${field}:
            kept.append(${noun})
    return kept
''',
    "count": '''def count_${nouns}_by_${key}(${nouns}: Iterable[dict]) -> dict[str, int]:
    """Count ${nouns} per ${key}; a ${noun} without one is counted under "unknown"."""
    counts: dict[str, int] = {}
    for ${noun} in ${nouns}:
        name = ${noun}.get("${key}") or "unknown"
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
''',
    "parse": '''def parse_${noun}_line(line: str) -> tuple[str, int]:
    """Split a "name${sep} quantity" line from the ${system} export into its two parts."""
    name, _, quantity = line.partition("${sep}")
    if not quantity.strip():
        raise ValueError(f"no quantity in {line!r}")
    return name.strip(), int(quantity)
''',
    "moving": '''def moving_${field}(values: Sequence[float], window: int = ${small}) -> list[float]:
    """Mean ${field} over each run of ``window`` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    if len(values) < window:
        return []
    total = sum(values[:window])
    means = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        means.append(total / window)
    return means
''',
    "search": '''def find_${noun}(sorted_${nouns}: list[int], target: int) -> int:
    """Binary search: the index of ``target`` in ``sorted_${nouns}``, or -1 when absent."""
    lo, hi = 0, len(sorted_${nouns}) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if sorted_${nouns}[mid] == target:
            return mid
        if sorted_${nouns}[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
    "load": '''def load_${nouns}(path: Path) -> list[dict]:
    """Read ${nouns} from a JSON-lines file, skipping blank lines."""
    ${nouns} = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                ${nouns}.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: {err}") from err
    return ${nouns}
''',
    "total": '''def total_${field}(${nouns}: Iterable[dict], ${key}: str | None = None) -> float:
    """Sum the ${field} of all ${nouns}, or only of those with the given ${key}."""
    return sum(
        ${noun}["${field}"]
        for ${noun} in ${nouns}
        if ${key} is None or ${noun}.get("${key}") == ${key}
    )
''',
    "class": '''@dataclass
class ${Noun}:
    """One ${noun} in the ${place} ${system} system."""

    name: str
    ${field}: float = ${num}
    tags: list[str] = field(default_factory=list)

    def is_${adj}(self) -> bool:
        """Whether the ${field} is above the ${adj} threshold of ${small}."""
        return self.${field} > ${small}

    def label(self) -> str:
        return f"{self.name} ({self.${field}:.1f})"
''',
}
_IMPORTS = {
    "count": "from collections.abc import Iterable",
    "total": "from collections.abc import Iterable",
    "moving": "from collections.abc import Sequence",
    "load": "import json\nfrom pathlib import Path",
    "class": "from dataclasses import dataclass, field",
}
_TEST = """

def test_count_${nouns}_by_${key}() -> None:
    ${nouns} = [{"${key}": "a"}, {"${key}": "b"}, {"${key}": "a"}, {}]
    assert count_${nouns}_by_${key}(${nouns}) == {"a": 2, "b": 1, "unknown": 1}
"""


def _module(rng: random.Random) -> tuple[str, str, str]:
    """One module: docstring, imports, 3-5 functions and, sometimes, a test."""
    noun = rng.choice(_NOUNS)
    values = {
        "noun": noun,
        "nouns": plural(noun),
        "Noun": noun.capitalize(),
        "field": rng.choice(_FIELDS),
        "key": rng.choice(_KEYS),
        "verb": rng.choice(_VERBS),
        "system": rng.choice(_SYSTEMS),
        "adj": rng.choice(_ADJS),
        "place": rng.choice(PLACES),
        "sep": rng.choice((",", ";", "|", ":")),
        "num": f"{rng.randint(1, 90)}.{rng.randint(0, 9)}",
        "small": str(rng.randint(2, 12)),
    }
    names = rng.sample(sorted(_FUNCTIONS), rng.randint(3, 5))
    lines = {line for n in names if n in _IMPORTS for line in _IMPORTS[n].split("\n")}
    imports = sorted(lines, key=lambda line: (line.startswith("from"), line))
    future = "from __future__ import annotations"
    header = (
        f'"""Helpers for {values["nouns"]} in the {values["place"]} {values["system"]} system."""'
    )
    head = "\n".join([header, "", future, "", *imports]) if imports else f"{header}\n\n{future}"
    body = [Template(_FUNCTIONS[n]).substitute(values).rstrip("\n") for n in names]
    text = "\n\n\n".join([head, *body]) + "\n"
    if "count" in names and rng.random() < 0.5:
        text += Template(_TEST).substitute(values)
    return text, f"{values['system']}/{noun}_utils.py", values["system"]


def code(rng: random.Random, n: int) -> list[dict]:
    """Python source files of 30-120 lines."""
    records = []
    for i in range(n):
        text, path, system = _module(rng)
        records.append(
            {
                "id": f"code-{i:05d}",
                "text": text,
                "path": path,
                "meta": {"lang": "python", "topic": system, "defect": None},
            }
        )
    plant_text_defects(rng, records)
    return records
