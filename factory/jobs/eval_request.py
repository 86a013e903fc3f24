"""What ``factory eval`` evaluates and what it found (``factory.jobs.evaluate`` checks a request;
``factory.jobs.evaluate_model`` runs it). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.runtime.callbacks import HeldoutMetrics
from factory.schemas.blueprint import Blueprint

__all__ = ["HF_MICRO_BATCH", "EvalRefused", "EvalRequest", "EvalResult"]

HF_MICRO_BATCH = 4
"""Samples per forward pass for an HF folder, which has no batch size of its own (the
loss does not depend on it: sums over targets, divided once)."""


class EvalRefused(ValueError):
    """Bad input to ``factory eval``; ``where`` is the argument or flag at fault."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass(frozen=True)
class EvalRequest:
    """What :func:`run_eval` evaluates, checked."""

    kind: str
    """``run`` (a run folder's checkpoint) or ``hf`` (an exported HF folder)."""
    model: Path
    """The run's (stage's) folder, or the HF folder."""
    sets: dict[str, Path]
    """Category to built folder."""
    tokens: int
    """Positions read from each set."""
    blueprint: Blueprint | None = None
    """The run's blueprint (None for an HF folder: its config.json says)."""
    precision: str = "off"
    checkpoint: Path | None = None
    step: int = 0
    """The checkpoint's step (0 for an HF folder)."""


@dataclass(frozen=True)
class EvalResult:
    """Each set's numbers and all sets' together (``category`` None), as ``metrics.jsonl``'s
    ``eval`` records; ``step`` is the checkpoint's (0 for an HF folder)."""

    request: EvalRequest
    records: tuple[HeldoutMetrics, ...]

    def as_json(self) -> dict[str, Any]:
        r = self.request
        return {
            "model": str(r.model),
            "kind": r.kind,
            "step": r.step,
            "tokens_per_set": r.tokens,
            "sets": {c: str(folder) for c, folder in r.sets.items()},
            "results": [
                {
                    "category": record.category,
                    "loss": record.loss,
                    "perplexity": record.perplexity,
                    "tokens": record.tokens,
                    "mtp_losses": record.mtp_losses,
                }
                for record in self.records
            ],
        }
