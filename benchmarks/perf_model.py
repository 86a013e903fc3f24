"""``python -m benchmarks perf_model [--fit]``: the performance model against published runs.

Without ``--fit``: the shipped constants' error on every usable row of
``benchmarks/data/training_throughput_published.csv``. With ``--fit``: fit the constants
on every usable row (``benchmarks.perf_fit``), write them to
``factory/planner/perf_constants.json``, and report the error fitted, leaving each model
out of the fit, and leaving each family out (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.machine import describe
from benchmarks.perf_fit import abs_error, fit, median
from benchmarks.perf_rows import Row, published_rows
from factory.planner.perf_constants import PerfConstants, perf_constants

CONSTANTS_FILE = Path(__file__).parents[1] / "factory" / "planner" / "perf_constants.json"


def constants_json(constants: PerfConstants, rows: int) -> str:
    """The file the planner reads: the constants and what they were fitted on."""
    data = {**constants.to_dict(), "fitted_on_rows": rows}
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _held_out(rows: Sequence[Row], key: Callable[[Row], str]) -> dict[int, float]:
    """Each row's error when every row sharing its key is left out of the fit."""
    errors: dict[int, float] = {}
    for group in sorted({key(row) for row in rows}):
        rest = [row for row in rows if key(row) != group]
        constants = fit(rest).constants
        for i, row in enumerate(rows):
            if key(row) == group:
                errors[i] = abs_error(row, constants)
    return errors


def same_layout_spread(rows: Sequence[Row]) -> dict[int, float]:
    """For each row published more than once with the same model, GPU, count, precision and
    layout: the |error| of the median of its siblings as its prediction. No model whose
    inputs are the layout can do better on such rows (the runs differ in settings the table
    does not give: containers, CUDA graphs, kernels), so this is the error floor."""
    by_label: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_label[row.label].append(row.tokens_per_s_per_gpu)
    spread = {}
    for i, row in enumerate(rows):
        siblings = list(by_label[row.label])
        siblings.remove(row.tokens_per_s_per_gpu)
        if siblings:
            spread[i] = abs(median(siblings) / row.tokens_per_s_per_gpu - 1)
    return spread


def _table(rows: Sequence[Row], columns: dict[str, dict[int, float]]) -> list[str]:
    """Markdown: n, median and worst |error| per family, per family and GPU, and overall (a
    column that has no value for some rows counts those it has)."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[(row.family, "all GPUs")].append(i)
        groups[(row.family, row.gpu)].append(i)
        groups[("all", "all GPUs")].append(i)
    head = "| family | GPU | rows | " + " | ".join(f"{c}: median / worst" for c in columns) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(columns)]
    for (family, gpu), members in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        cells = []
        for errors in columns.values():
            values = [errors[i] for i in members if i in errors]
            whole = len(values) == len(members)
            cells.append("n/a" if not values else f"{median(values):.1%} / {max(values):.1%}"
                         + ("" if whole else f" ({len(values)} rows)"))  # fmt: skip
        lines.append(f"| {family} | {gpu} | {len(members)} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks perf_model")
    parser.add_argument("--fit", action="store_true", help="refit and write the constants")
    args = parser.parse_args(argv)
    table = published_rows()
    rows = table.used
    print(f"# perf_model{' --fit' if args.fit else ''}: {describe()}, {datetime.now(UTC):%Y-%m-%d}")
    print(f"\n{len(rows)} rows used; dropped:")
    for reason, count in table.dropped.most_common():
        print(f"- {count}: {reason}")
    constants = perf_constants()
    columns: dict[str, dict[int, float]] = {}
    if args.fit:
        fitted = fit(rows)
        constants = fitted.constants
        CONSTANTS_FILE.write_text(constants_json(constants, len(rows)))
        print(f"\nwrote {CONSTANTS_FILE.name}: {json.dumps(constants.to_dict())}")
    columns["fitted"] = {i: abs_error(row, constants) for i, row in enumerate(rows)}
    if args.fit:
        columns["model held out"] = _held_out(rows, lambda row: row.model)
        columns["family held out"] = _held_out(rows, lambda row: row.family)
    columns["same layout, other runs"] = same_layout_spread(rows)
    print("\n|error| of tokens/s per GPU\n")
    print("\n".join(_table(rows, columns)))
    return 0
