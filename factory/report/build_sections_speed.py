"""The build page's predicted-speed section: where one step's time goes, as the plan's
performance model predicts it (``docs/performance.md``)."""

from __future__ import annotations

from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import figure_svg, key_value_table, note, section
from factory.report.plan_text import flatten
from factory.report.step_bar import step_bar_svg

__all__ = ["speed_section"]


def speed_section(folder: BuildFolder) -> str:
    plan = folder.plan
    if plan is None:
        return section("speed", "Predicted speed", missing(folder, "plan", "plan.json"))
    perf = plan.get("performance")
    if not isinstance(perf, dict) or not perf:
        return section("speed", "Predicted speed", note("The plan has no performance estimate."))
    parts = [
        (name.replace(".", ": ").replace("_", " "), float(value))
        for name, value in flatten(perf["breakdown_seconds"])
    ]
    caption = (
        f"One optimizer step of {perf['step_seconds']:.3f} s on {perf['gpu']}, by component: "
        "compute per layer type, exposed communication per kind, pipeline bubble, recompute, "
        "optimizer step, per-block overhead (hover a part for its seconds)."
    )
    facts = [
        ("tokens/s per GPU", f"{perf['tokens_per_s_per_gpu']:,.0f}"),
        ("step time", f"{perf['step_seconds']:.3f} s"),
        ("MFU", f"{perf['mfu']:.1%} of dense {perf['peak_format'].upper()} peak"),
    ]
    body = figure_svg(step_bar_svg(parts), caption) + key_value_table(facts)
    return section("speed", "Predicted speed", body)
