"""``factory.build``: plan a blueprint and write its build folder, curated data included.

The folder appears whole or not at all (it is assembled in a staging folder
and renamed into place)::

    resolved.yaml   the blueprint with every fragment and override applied
    plan.json       exact parameters, FLOPs per token, memory per rank, layout
    report.md       the plan as a readable report
    report.html     the same, with the layer pattern per pipeline rank and the
                    peak rank's memory drawn as SVG
    data/           the blueprint's data recipe, packed to its data.seq_len

``factory train`` trains what it describes. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from factory.io import staged_directory
from factory.jobs.progress import Progress, silent
from factory.planner.report import markdown_report
from factory.planner.report_html import html_report

if TYPE_CHECKING:
    from factory.planner.plan import Plan
    from factory.schemas.blueprint import Blueprint

__all__ = ["BuildResult", "build"]


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build` wrote, and the numbers in it."""

    out: Path
    """The build folder (absolute)."""
    plan: Plan
    """The plan written to plan.json and the reports."""
    manifest: dict[str, Any]
    """``data/manifest.json``: counts per source and step, packing, shard hashes."""


def build(
    blueprint: Blueprint,
    *,
    out: Path | None = None,
    source: str | Path | None = None,
    workers: int = 1,
    progress: Progress | None = None,
) -> BuildResult:
    """Plan ``blueprint`` and write its build folder at ``out`` (default ``build/NAME``).

    ``blueprint`` is validated already (:func:`factory.load_blueprint`).
    ``source``, where it was loaded from, is named in resolved.yaml's header.
    ``workers`` processes curate the data; ``progress`` gets ``plan``,
    ``report`` and the data build's stages. An existing folder is replaced
    only when the whole build succeeds.
    """
    from factory.data.pipeline import build as build_data
    from factory.planner.plan import plan as make_plan

    report = progress or silent
    destination = (out or Path("build") / blueprint.meta.name).resolve()
    report("plan", 0, 1)
    plan = make_plan(blueprint)
    report("plan", 1, 1)
    with staged_directory(destination) as staging:
        report("report", 0, 1)
        _write_reports(blueprint, plan, source, staging)
        report("report", 1, 1)
        manifest = build_data(
            blueprint.data.recipe,
            staging / "data",
            workers=workers,
            seq_len=blueprint.data.seq_len,
            progress=progress,
            keep_work=False,  # intermediates serve resuming, which a staged build never does
        )
    return BuildResult(out=destination, plan=plan, manifest=manifest)


def _write_reports(
    blueprint: Blueprint, plan: Plan, source: str | Path | None, folder: Path
) -> None:
    """resolved.yaml, plan.json, report.md and report.html into ``folder``."""
    import yaml

    from factory.schemas.parallelism import GPU_SPECS

    resolved = yaml.safe_dump(blueprint.model_dump(mode="json"), sort_keys=False)
    origin = f" from {source}" if source is not None else ""
    header = f"# Resolved{origin}; every fragment and override applied.\n"
    (folder / "resolved.yaml").write_text(header + resolved, encoding="utf-8")
    summary = plan.to_dict()
    (folder / "plan.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    title = f"{blueprint.meta.name}: {blueprint.meta.description}".rstrip(": ")
    (folder / "report.md").write_text(markdown_report(summary, title), encoding="utf-8")
    capacity = GPU_SPECS[blueprint.parallelism.gpu].memory_bytes
    page = html_report(summary, title, blueprint.model.mtp_pattern, capacity)
    (folder / "report.html").write_text(page, encoding="utf-8")
