"""The rule registry: every cross-field check, by name.

A rule is a function from a validated :class:`Blueprint` to the findings it
makes. Rules register themselves with :func:`rule`, so adding one never
touches a central switch, and ``factory validate --rules`` can list them.
Each finding names its rule and the numbers involved. The rule modules are
listed in ``factory/checks/__init__.py``, which imports them all: importing any
module of ``factory.checks`` registers every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from factory.schemas.blueprint import Blueprint

__all__ = ["RULES", "Finding", "Rule", "rule", "run_rules"]


@dataclass(frozen=True)
class Finding:
    """A rule's verdict on one value."""

    path: str
    message: str
    severity: Literal["error", "warning"] = "error"


RuleFn = Callable[[Blueprint], Iterator[Finding]]


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    check: RuleFn


RULES: dict[str, Rule] = {}


def rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register a check under ``name``; its docstring's first line is its summary."""

    def register(fn: RuleFn) -> RuleFn:
        if name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        RULES[name] = Rule(name=name, summary=summary, check=fn)
        return fn

    return register


def run_rules(bp: Blueprint) -> list[tuple[Rule, Finding]]:
    """Run every registered rule; findings come back in registration order.

    Every rule is registered by then: Python runs ``factory/checks/__init__.py``,
    which imports every rule module, before this module.
    """
    return [(r, finding) for r in RULES.values() for finding in r.check(bp)]
