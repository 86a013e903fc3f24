"""The stages of ``factory build`` and its default step counts: names only, so that the CLI
can offer them without loading the stages (which load the data, export and training code)."""

from __future__ import annotations

__all__ = ["DEFAULT_CHECK_STEPS", "DEFAULT_SMOKE_STEPS", "STAGES"]

STAGES = (
    "validate",
    "plan",
    "model",
    "precision",
    "export",
    "data",
    "smoke",
    "distributed",
    "report",
)
"""In the order they run; ``--skip`` takes these names."""

DEFAULT_SMOKE_STEPS = 24
"""Optimizer steps of the proxy's smoke run: a few dozen, enough for the loss to fall clearly."""

DEFAULT_CHECK_STEPS = 4
"""The distributed check trains the first steps of the smoke run again, on 2 ranks."""
