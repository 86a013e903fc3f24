"""The ``swe_trajectory`` family: agent trajectories that fix a bug in a small repository.

Records are ``{"id", "instance_id", "repo", "messages", "tools", "patch",
"finished", "tests_passed", "test_results": {"passed", "failed"}, "used_in",
"meta": {"topic", "defect"}}``. A clean trajectory searches, views the file,
edits it, runs the tests (all pass) and summarises. About 11% are planted
failures for the trajectory filter: ``unfinished`` (cut off mid-run),
``tests_failed`` (a wrong fix) and ``malformed_tool_call``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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

__all__ = ["swe_trajectory"]

TOOLS = [
    tool_definition(
        "search_code",
        "Search the repository for a regular expression.",
        {"pattern": ("string", "Regular expression"), "path": ("string", "Directory to search")},
        ["pattern"],
    ),
    tool_definition(
        "view_file",
        "Show numbered lines of a file.",
        {
            "path": ("string", "File path"),
            "start_line": ("integer", "First line"),
            "end_line": ("integer", "Last line"),
        },
        ["path"],
    ),
    tool_definition(
        "str_replace",
        "Replace one exact occurrence of old_str with new_str in a file.",
        {
            "path": ("string", "File path"),
            "old_str": ("string", "Text to replace"),
            "new_str": ("string", "Replacement text"),
        },
        ["path", "old_str", "new_str"],
    ),
    tool_definition(
        "run_tests",
        "Run pytest on a path and return the summary.",
        {"path": ("string", "Test file or directory")},
        ["path"],
    ),
]
_ORGS = ("tidewater", "quillstack", "marrowlabs", "fernhollow", "copperline")
_PKGS = ("ledgerkit", "tramway", "hivelog", "loomcraft", "chartbook", "brinetools")
_NOUNS = ("order", "reading", "ticket", "segment", "booking", "parcel", "entry", "visit")
_FIELDS = ("weight", "price", "score", "duration", "capacity", "priority")

Bug = dict[str, str]


def _off_by_one(noun: str, field: str) -> Bug:
    return {
        "func": f"top_{noun}s",
        "kind": "off-by-one",
        "before": "    return ranked[: limit - 1]",
        "after": "    return ranked[:limit]",
        "wrong": "    return ranked[1 : limit + 1]",
        "body": f"def top_{noun}s({noun}s: list[dict], limit: int = 5) -> list[dict]:\n"
        f'    """The ``limit`` {noun}s with the highest {field}."""\n'
        f'    ranked = sorted({noun}s, key=lambda x: x["{field}"], reverse=True)\n',
        "check": f'assert len(top_{noun}s([{{"{field}": i}} for i in range(9)], limit=3)) == 3',
        "title": f"top_{noun}s returns one {noun} too few",
        "issue": f"Calling `top_{noun}s(items, limit=3)` returns only two {noun}s. "
        f"I expected the three with the highest {field}.",
    }


def _boundary(noun: str, field: str) -> Bug:
    return {
        "func": f"is_{field}_allowed",
        "kind": "boundary",
        "before": f'    return {noun}["{field}"] < maximum',
        "after": f'    return {noun}["{field}"] <= maximum',
        "wrong": f'    return {noun}["{field}"] > maximum',
        "body": f"def is_{field}_allowed({noun}: dict, maximum: float) -> bool:\n"
        f'    """Whether the {noun}\'s {field} is within the inclusive maximum."""\n',
        "check": f'assert is_{field}_allowed({{"{field}": 10}}, maximum=10)',
        "title": f"{field} equal to the maximum is rejected",
        "issue": f"The docs say the maximum {field} is inclusive, but a {noun} whose {field} "
        "is exactly the maximum is rejected.",
    }


def _none_name(noun: str, field: str) -> Bug:
    return {
        "func": f"{noun}_label",
        "kind": "none-handling",
        "before": f'    return {noun}["name"].strip().title()',
        "after": f'    return ({noun}.get("name") or "unnamed").strip().title()',
        "wrong": f'    return str({noun}["name"]).strip().title()',
        "body": f"def {noun}_label({noun}: dict) -> str:\n"
        f'    """A display label for a {noun}; {noun}s without a name are "Unnamed"."""\n',
        "check": f'assert {noun}_label({{"name": None}}) == "Unnamed"',
        "title": f"{noun}_label crashes on {noun}s without a name",
        "issue": f"`{noun}_label` raises `AttributeError: 'NoneType' object has no attribute "
        f"'strip'` when a {noun} has `name: null`, and `KeyError` when the key is missing.",
    }


def _mean_zero(noun: str, field: str) -> Bug:
    return {
        "func": f"mean_{field}",
        "kind": "zero-division",
        "before": f'    return sum(x["{field}"] for x in {noun}s) / len({noun}s)',
        "after": f'    return sum(x["{field}"] for x in {noun}s) / len({noun}s) if {noun}s else 0.0',
        "wrong": f'    return sum(x["{field}"] for x in {noun}s) / (len({noun}s) + 1)',
        "body": f"def mean_{field}({noun}s: list[dict]) -> float:\n"
        f'    """Mean {field} of the {noun}s; 0.0 for an empty list."""\n',
        "check": f"assert mean_{field}([]) == 0.0",
        "title": f"mean_{field} raises ZeroDivisionError on an empty list",
        "issue": f"The docstring says an empty list gives 0.0, but `mean_{field}([])` raises "
        "`ZeroDivisionError: division by zero`.",
    }


_LOOK = (
    "I need to find where {func} is defined.",
    "First, locate {func} in the source tree.",
    "Let me search for the definition of {func}.",
)
_REPRO = (
    "Reproduce the failure first.",
    "Run the tests to confirm the bug before changing anything.",
)
_FIX = (
    "This is a {kind} bug on the last line; I'll fix it.",
    "The last line of {func} is wrong ({kind}). Minimal fix:",
    "Found it: a {kind} problem. Editing the return statement.",
)
_BUGS: tuple[Callable[[str, str], Bug], ...] = (_off_by_one, _boundary, _none_name, _mean_zero)


def _listing(lines: list[str], first: int) -> str:
    return "\n".join(f"{first + i:4d}  {line}" for i, line in enumerate(lines))


def _pytest(passed: int, failed: int, test: str = "", error: str = "") -> str:
    if failed:
        head = f"FAILED {test} - {error}\n"
        return (
            f"{head}========== {failed} failed, {passed} passed in 0.{passed + 11:02d}s =========="
        )
    return f"========== {passed} passed in 0.{passed + 11:02d}s =========="


def _trajectory(
    r: random.Random, make_bug: Callable[[str, str], Bug], noun: str, field: str, wrong_fix: bool
) -> dict:
    org, pkg = r.choice(_ORGS), r.choice(_PKGS)
    bug = make_bug(noun, field)
    module = f"src/{pkg}/{noun}s.py"
    test_file = f"tests/test_{noun}s.py"
    test = f"{test_file}::test_{bug['func']}_{bug['kind'].replace('-', '_')}"
    start = r.randint(12, 140)
    code = [*bug["body"].rstrip("\n").split("\n"), bug["before"]]
    total = r.randint(8, 40)
    messages: list[dict] = [
        {
            "role": "system",
            "content": f"You are a software engineering agent working in /workspace/{pkg}. "
            "Use the tools to resolve the issue, then summarise your change.",
        },
        {"role": "user", "content": f"Issue: {bug['title']}\n\n{bug['issue']}\n\nPlease fix it."},
    ]

    def step(reasoning: str, name: str, args: dict, result: str) -> None:
        call = tool_call(r, name, args)
        messages.append(assistant("", reasoning_fields(r, reasoning), tool_calls=[call]))
        messages.append(tool_result(call, result))

    step(
        r.choice(_LOOK).format(func=bug["func"]),
        "search_code",
        {"pattern": f"def {bug['func']}", "path": "src"},
        f"{module}:{start}: def {bug['func']}(",
    )
    step(
        "Let me read the function.",
        "view_file",
        {"path": module, "start_line": start, "end_line": start + len(code) - 1},
        _listing(code, start),
    )
    if r.random() < 0.4:
        test_code = [f"def {test.split('::')[1]}() -> None:", f"    {bug['check']}"]
        step(
            "Check what the test expects.",
            "view_file",
            {"path": test_file},
            _listing(test_code, r.randint(5, 90)),
        )
    if r.random() < 0.5:
        step(
            r.choice(_REPRO),
            "run_tests",
            {"path": test_file},
            _pytest(total - 1, 1, test, f"AssertionError ({bug['kind']})"),
        )
    after = bug["wrong"] if wrong_fix else bug["after"]
    step(
        r.choice(_FIX).format(kind=bug["kind"], func=bug["func"]),
        "str_replace",
        {"path": module, "old_str": bug["before"], "new_str": after},
        f"Edited {module}.",
    )
    failed = 1 if wrong_fix else 0
    step(
        "Now run the tests.",
        "run_tests",
        {"path": test_file},
        _pytest(total - failed, failed, test, f"AssertionError ({bug['kind']})"),
    )
    summary = (
        f"Fixed the {bug['kind']} bug in `{bug['func']}` ({module}); all {total} tests pass."
        if not wrong_fix
        else f"I changed `{bug['func']}` in {module}, but one test still fails."
    )
    messages.append(assistant(summary, reasoning_fields(r, "Summarise the fix for the user.")))
    line = start + len(code) - 1
    patch = (
        f"--- a/{module}\n+++ b/{module}\n@@ -{line},1 +{line},1 @@\n-{bug['before']}\n+{after}\n"
    )
    return {
        "instance_id": f"{org}__{pkg}-{r.randint(100, 2999)}",
        "repo": f"{org}/{pkg}",
        "messages": messages,
        "tools": TOOLS,
        "patch": patch,
        "finished": True,
        "tests_passed": not wrong_fix,
        "test_results": {"passed": total - failed, "failed": failed},
        "meta": {"topic": bug["kind"], "defect": "tests_failed" if wrong_fix else None},
    }


def swe_trajectory(rng: random.Random, n: int) -> list[dict]:
    """Bug-fix trajectories; ~4% unfinished, ~4% with failing tests, ~3% with a malformed call."""
    plan = plan_defects(rng, n, TRAJECTORY_DEFECTS)
    # Distinct (bug, noun, field) per record while they last, so no two trajectories are near-duplicates.
    combos = [(b, noun, f) for b in _BUGS for noun in _NOUNS for f in _FIELDS]
    rng.shuffle(combos)
    records = []
    for i in range(n):
        defect = plan.get(i)
        bug, noun, field = combos[i % len(combos)]
        record = {
            "id": f"swe_trajectory-{i:05d}",
            **_trajectory(rng, bug, noun, field, defect == "tests_failed"),
        }
        if defect == "unfinished":  # cut after the edit's tool result: no test run, no summary
            edit = next(
                j
                for j, m in enumerate(record["messages"])
                if m.get("content", "").startswith("Edited ")
            )
            record["messages"] = record["messages"][: edit + 1]
            record.update(
                finished=False, tests_passed=False, test_results={"passed": 0, "failed": 0}
            )
            record["meta"]["defect"] = "unfinished"
        elif defect == "malformed_tool_call":
            record["meta"].update(defect=defect, defect_detail=break_tool_call(rng, record))
        record["used_in"] = used_in(rng)
        records.append(record)
    return records
