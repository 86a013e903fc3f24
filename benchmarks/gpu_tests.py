"""Section 1: every test that skips without CUDA, run on the device.

The selection is read from the test sources, not kept by hand: a test function skipped
where a condition naming CUDA is false (``@pytest.mark.skipif(not torch.cuda.is_available(),
...)``, the same in a module's ``pytestmark``, or ``if not ...cuda...: pytest.skip(...)``
in its body). The
selection runs in a ``python -m pytest -rs`` subprocess writing a JUnit XML report, which
gives the passed, failed and skipped counts and the failures' names. In a dry run the same
selection runs on CPU, where every test in it must be skipped: that proves the selection
and the report reading, so the GPU run cannot find them broken.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from benchmarks.gpu_common import SectionContext, table

TITLE = "Tests that skip without CUDA"
BUDGET_S = 240
"""On an H100: pytest's start (torch, CUDA) and a few tests of a second or two each."""

REPO = Path(__file__).resolve().parent.parent


def _without_cuda(condition: ast.expr) -> bool:
    """``not <something naming cuda>``: true where there is no CUDA (a test skipped *with*
    CUDA, ``skipif(torch.cuda.is_available())``, is not one of them)."""
    return (
        isinstance(condition, ast.UnaryOp)
        and isinstance(condition.op, ast.Not)
        and "cuda" in ast.unparse(condition.operand).lower()
    )


def _skips_without_cuda(decorator: ast.expr) -> bool:
    """``@pytest.mark.skipif(not <...cuda...>, ...)``."""
    return (
        isinstance(decorator, ast.Call)
        and ast.unparse(decorator.func).endswith("skipif")
        and bool(decorator.args)
        and _without_cuda(decorator.args[0])
    )


def _body_skips_without_cuda(function: ast.FunctionDef) -> bool:
    """``if not <...cuda...>: pytest.skip(...)`` in the test's body."""
    for node in ast.walk(function):
        if isinstance(node, ast.If) and _without_cuda(node.test):
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
            if any(ast.unparse(c.func).endswith("skip") for c in calls):
                return True
    return False


def cuda_only_tests(source: str, path: str) -> list[str]:
    """The pytest node ids (``path::name``) of the tests in ``source`` that skip without CUDA."""
    tree = ast.parse(source)
    module_wide = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and any(_skips_without_cuda(call) for call in ast.walk(node.value))
        for node in tree.body
    )
    ids = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            marked = any(_skips_without_cuda(d) for d in node.decorator_list)
            if module_wide or marked or _body_skips_without_cuda(node):
                ids.append(f"{path}::{node.name}")
    return ids


def select(tests: Path = REPO / "tests") -> list[str]:
    """Every CUDA-only test of the suite, as node ids relative to the repository."""
    ids = []
    for path in sorted(tests.glob("test_*.py")):
        relative = path.relative_to(tests.parent).as_posix()
        ids += cuda_only_tests(path.read_text(encoding="utf-8"), relative)
    return ids


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and the failed and skipped tests' names (with the skip reasons) of a JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skipped.append(f"{name}: {skip.get('message', '')}")
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed, "skipped_tests": skipped}


def run(ctx: SectionContext) -> None:
    selection = select()
    ctx.record("selection", selection)
    if not selection:
        ctx.fail("no test of the suite skips without CUDA: the selection found nothing")
        return
    report = ctx.path.with_suffix(".junit.xml")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", *selection],
        cwd=REPO, env=env, capture_output=True, text=True,
        timeout=100 if ctx.dry_run else BUDGET_S - 5,  # inside the section's budget
    )  # fmt: skip
    ctx.record("pytest_exit_status", done.returncode)
    ctx.record("pytest_tail", done.stdout[-2000:])
    if not report.is_file():
        ctx.fail(f"pytest wrote no report (exit status {done.returncode})")
        return
    outcome = read_junit(report)
    ctx.record("outcome", outcome)
    if outcome["failed"]:
        ctx.fail(f"{outcome['failed']} CUDA test(s) failed: {', '.join(outcome['failed_tests'])}")
    if ctx.dry_run and outcome["passed"]:
        ctx.fail("a test selected as CUDA-only ran without CUDA: the selection is wrong")
    if not ctx.dry_run and outcome["skipped"]:
        ctx.fail(f"{outcome['skipped']} CUDA test(s) still skipped on the device")


def markdown(results: dict[str, Any]) -> str:
    outcome = results.get("outcome")
    if outcome is None:
        return "No outcome recorded.\n"
    rows = [[len(results["selection"]), outcome["passed"], outcome["failed"], outcome["skipped"]]]
    text = table(["selected", "passed", "failed", "skipped"], rows)
    for name in outcome["failed_tests"]:
        text += f"\n- failed: `{name}`"
    return text + ("\n" if outcome["failed_tests"] else "")
