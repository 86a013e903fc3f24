"""The default step counts of ``factory build``'s two training stages: constants only, so that
the CLI can offer them without loading the stages (which load the data, export and training
code). The stages themselves are the build folder's layout (:mod:`factory.report.build_folder`)."""

from __future__ import annotations

__all__ = ["DEFAULT_CHECK_STEPS", "DEFAULT_SMOKE_STEPS"]

DEFAULT_SMOKE_STEPS = 24
"""Optimizer steps of the proxy's smoke run: a few dozen, enough for the loss to fall clearly."""

DEFAULT_CHECK_STEPS = 4
"""The distributed check trains the first steps of the smoke run again, on 2 ranks."""
