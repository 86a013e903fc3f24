"""The build page: one self-contained HTML page over a ``factory build`` folder.

:func:`write_build_report` reads whatever the build's stages left in the folder
(``build.json``, ``plan.json``, ``precision.json``, ``data/manifest.json``,
``smoke/``, ``distributed.json`` ...) and writes ``report.html`` beside them, every
picture inline (SVG, or PNG as a data URI), every section in reading order. A stage
that was skipped or failed leaves a short note in its section instead. Torch-free;
matplotlib is imported only while drawing the plots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from factory.io import atomic_write_text
from factory.report.build_folder import BuildFolder
from factory.report.build_sections_evaluation import evaluation_section
from factory.report.build_sections_plan import (
    cost_section,
    flops_section,
    layers_section,
    memory_section,
)
from factory.report.build_sections_program import program_section
from factory.report.build_sections_run import data_section, run_section
from factory.report.build_sections_speed import speed_section
from factory.report.build_sections_stages import (
    artifacts_section,
    exports_section,
    model_section,
    precision_section,
    stages_section,
)
from factory.report.html_parts import STYLE, escape

__all__ = ["SECTIONS", "render_build_report", "write_build_report"]

REPORT = "report.html"
SECTIONS: tuple[tuple[str, str, Callable[[BuildFolder], str]], ...] = (
    ("stages", "Stages", stages_section),
    ("program", "Program", program_section),
    ("layers", "Layer stack", layers_section),
    ("memory", "Memory", memory_section),
    ("flops", "FLOPs", flops_section),
    ("speed", "Predicted speed", speed_section),
    ("cost", "Cost and failures", cost_section),
    ("model", "Model", model_section),
    ("precision", "Precision", precision_section),
    ("data", "Data", data_section),
    ("runs", "Smoke and distributed", run_section),
    ("evaluation", "Held-out loss and samples", evaluation_section),
    ("exports", "Exports", exports_section),
    ("artifacts", "Artifacts", artifacts_section),
)
"""(anchor, navigation label, renderer) in page order; a renderer with nothing to show (the
program section of a single-stage build) returns '' and has no link."""


def _title(folder: BuildFolder) -> str:
    meta = (folder.resolved or {}).get("meta") or {}
    description = str(meta.get("description") or "")
    return f"{folder.name}: {description}" if description else folder.name


def render_build_report(build_dir: Path) -> str:
    """The page for ``build_dir`` as HTML text; nothing in it is fetched from elsewhere."""
    folder = BuildFolder(Path(build_dir))
    title = _title(folder)
    drawn = [(anchor, label, render(folder)) for anchor, label, render in SECTIONS]
    shown = [(anchor, label, html) for anchor, label, html in drawn if html]
    nav = " ".join(f'<a href="#{anchor}">{escape(label)}</a>' for anchor, label, _ in shown)
    body = "".join(html for _, _, html in shown)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}: build report</title><style>{STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1><p>Build report of <code>{escape(folder.root)}</code>, "
        f"written {stamp}.</p><nav>{nav}</nav>{body}</body></html>\n"
    )


def write_build_report(build_dir: Path) -> Path:
    """Write ``build_dir/report.html`` atomically and return its path."""
    target = Path(build_dir) / REPORT
    atomic_write_text(target, render_build_report(Path(build_dir)))
    return target
