"""The default step counts of ``factory build``'s two training stages: constants only, so that
the CLI can offer them without loading the stages (which load the data, export and training
code). The stages themselves are the build folder's layout (:mod:`factory.report.build_folder`)."""

from __future__ import annotations

__all__ = ["DEFAULT_CHECK_STEPS", "DEFAULT_SMOKE_STEPS", "DEFAULT_STAGE_SMOKE_STEPS"]

DEFAULT_SMOKE_STEPS = 24
"""Optimizer steps of the proxy's smoke run: a few dozen, enough for the loss to fall clearly."""

DEFAULT_STAGE_SMOKE_STEPS = 8
"""For a program (a blueprint with ``stages``), the smoke run's steps per program stage: Nano's
four stages at 8 steps each train 32 steps in all, which keeps its whole build within the
5 minutes on 2 cores that 24 steps of one stage take (BENCHMARKS.md, "build")."""

DEFAULT_CHECK_STEPS = 4
"""The distributed check trains the first steps of the smoke run again, on 2 ranks."""
