"""The build page's predicted-speed section: where one step's time goes, as the plan's
performance model predicts it, and the fastest layouts the search found for the same GPUs
(``docs/performance.md``)."""

from __future__ import annotations

from typing import Any

from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import escape, figure_svg, key_value_table, note, section, table
from factory.report.plan_text import flatten
from factory.report.step_bar import step_bar_svg
from factory.report.units import human_bytes, human_duration, percent

__all__ = ["speed_section"]


def speed_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("speed", "Predicted speed", missing(folder, "plan", "plan.json"))
    perf = plan.get("performance")
    if not isinstance(perf, dict) or not perf:
        return section("speed", "Predicted speed", note("The plan has no performance estimate."))
    parts = [
        (name, name.replace(".", ": ").replace("_", " "), float(value))
        for name, value in flatten(perf["breakdown_seconds"])
    ]
    caption = (
        f"One optimizer step of {human_duration(perf['step_seconds'])} on {perf['gpu']}, by "
        "component: compute per layer type, exposed communication per kind, pipeline bubble, "
        "recompute, optimizer step, per-block overhead (hover a part for its seconds)."
    )
    facts = [
        ("tokens/s per GPU", f"{perf['tokens_per_s_per_gpu']:,.0f}"),
        ("step time", human_duration(perf["step_seconds"])),
        ("MFU", f"{percent(perf['mfu'])} of dense {perf['peak_format'].upper()} peak"),
    ]
    body = figure_svg(step_bar_svg(parts), caption) + key_value_table(facts)
    return section("speed", "Predicted speed", body + _search(folder, perf))


def _search(folder: BuildFolder, perf: dict[str, Any]) -> str:
    """The search's fastest layouts on the blueprint's GPUs, against the blueprint's own."""
    found = folder.search
    if not isinstance(found, dict) or not found.get("layouts"):
        return note("No layout search in this build (search.json).")
    layouts = found["layouts"]
    rows = [
        (
            str(rank),
            entry["layout"],
            f"{entry['performance']['tokens_per_s_per_gpu']:,.0f}",
            percent(entry["performance"]["mfu"]),
            human_bytes(entry["memory_per_rank_bytes"]),
            entry["dominant_cost"],
        )
        for rank, entry in enumerate(layouts, 1)
    ]
    header = ("#", "layout", "tokens/s per GPU", "MFU", "memory per rank", "dominant cost")
    best = layouts[0]["performance"]["tokens_per_s_per_gpu"]
    gain = best / perf["tokens_per_s_per_gpu"] - 1
    caption = (
        f"The fastest layouts on {found['gpus']:,} x {found['gpu']} that validate and fit "
        f"(factory plan --search --gpus {found['gpus']}); the best is predicted "
        f"{percent(gain)} {'faster than' if gain > 0 else 'as fast as'} the blueprint's. Its "
        f"overrides: {' '.join('--set ' + o for o in layouts[0]['overrides']) or 'none'}."
    )
    listing = table(header, rows, css="search")
    return (
        f"<h3>Fastest layouts on the same GPUs</h3>"
        f"<figure>{listing}<figcaption>{escape(caption)}</figcaption></figure>"
    )
