"""The build report: one self-contained HTML page over a ``factory build`` folder.

:func:`write_build_report` reads whatever the build's stages left in the folder
(``build.json``, ``plan.json``, ``precision.json``, ``data/manifest.json``,
``smoke/``, ``distributed.json`` ...) and writes ``report.html`` beside them, every
picture inline (SVG, or PNG as a data URI). A stage that was skipped or failed
leaves a short note in its section instead. Torch-free; matplotlib is imported
only while drawing the plots.
"""

from __future__ import annotations

from factory.build_report.page import render_build_report, write_build_report

__all__ = ["render_build_report", "write_build_report"]
