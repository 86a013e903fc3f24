"""Helpers shared by the sample families: planted defects, chat messages and tool definitions.

Every record carries ``meta.defect``: ``None`` for a clean record, otherwise the
name of the flaw we planted (``short``, ``repetitive``, ``symbols``,
``duplicate``, ``near_duplicate``, ``contaminated``, ``unfinished``,
``tests_failed``, ``malformed_tool_call``, ``unverified``, ``slower``). Curation
tests use it to check that each filter removes what it should and nothing else.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = [
    "JUNK_KINDS",
    "TRAJECTORY_DEFECTS",
    "assistant",
    "break_tool_call",
    "call_id",
    "plan_defects",
    "reasoning_fields",
    "tool_call",
    "tool_definition",
    "tool_result",
    "used_in",
]

JUNK_KINDS: tuple[str, ...] = ("short", "repetitive", "symbols")
TRAJECTORY_DEFECTS: dict[str, float] = {
    "unfinished": 0.04,
    "tests_failed": 0.04,
    "malformed_tool_call": 0.03,
}
"""The planted failures of every agent-trajectory family (SWE, terminal, search), ~11%."""
_USED_IN: tuple[tuple[str, ...], ...] = (
    ("nano_v3",),
    ("nano_v3", "super_v3"),
    ("super_v3",),
    ("nano_v3", "super_v3", "ultra_v3"),
)


def plan_defects(rng: random.Random, n: int, rates: dict[str, float]) -> dict[int, str]:
    """Choose disjoint record indices for each planted defect.

    Each defect with a positive rate gets ``max(1, round(rate * n))`` records, so
    a sample of a few dozen has at least one of each; a sample too small for that
    (defects would be over half of it) gets ``round(rate * n)``, often none.
    Index 0 is never chosen: a duplicate needs an earlier original to copy.
    """
    wanted = {kind: max(1, round(rate * n)) for kind, rate in rates.items() if rate > 0}
    if sum(wanted.values()) > (n - 1) // 2:
        wanted = {kind: round(rate * n) for kind, rate in rates.items()}
    chosen = rng.sample(range(1, n), min(sum(wanted.values()), max(n - 1, 0)))
    plan: dict[int, str] = {}
    for kind, count in wanted.items():
        for index in chosen[:count]:
            plan[index] = kind
        chosen = chosen[count:]
    return plan


def used_in(rng: random.Random) -> list[str]:
    """Which model recipes use a record (the ``used_in`` filter of the open SFT recipes)."""
    return list(rng.choice(_USED_IN))


def reasoning_fields(rng: random.Random, reasoning: str) -> dict[str, str]:
    """``reasoning_content`` on ~70% of turns, empty on ~10%, absent (reasoning off) on ~20%."""
    draw = rng.random()
    if draw < 0.7:
        return {"reasoning_content": reasoning}
    if draw < 0.8:
        return {"reasoning_content": ""}
    return {}


def assistant(content: str, reasoning: dict[str, str] | None = None, **extra: Any) -> dict:
    """An assistant message; ``reasoning`` is what :func:`reasoning_fields` returned."""
    return {"role": "assistant", "content": content, **(reasoning or {}), **extra}


def call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))


def tool_call(rng: random.Random, name: str, arguments: dict[str, Any] | str) -> dict:
    """An OpenAI-style tool call; ``arguments`` is a JSON string (a str is passed as is)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(rng), "type": "function", "function": {"name": name, "arguments": args}}


def tool_result(call: dict, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def tool_definition(
    name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]
) -> dict:
    """A function tool with a JSON-schema ``parameters`` object; ``params`` maps name to (type, description)."""
    properties = {p: {"type": kind, "description": desc} for p, (kind, desc) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def break_tool_call(rng: random.Random, record: dict) -> str:
    """Make one tool call of a trajectory malformed; returns how (``meta.defect_detail``)."""
    calls = [c for m in record["messages"] for c in m.get("tool_calls", [])]
    how = rng.choice(("bad_json", "unknown_tool", "missing_tools"))
    call = rng.choice(calls)["function"]
    if how == "bad_json":
        call["arguments"] = call["arguments"][: max(1, len(call["arguments"]) // 2)]
    elif how == "unknown_tool":
        call["name"] = call["name"] + "_v2"
    else:
        del record["tools"]
    return how
