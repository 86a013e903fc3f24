"""What a run did: one record per optimizer step, the monitors' events, how it ended.

The trainer (``factory.runtime.trainer``) fills a :class:`RunHistory`; its
callbacks, ``train.json`` and the training job's result read it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunHistory", "StepRecord"]


@dataclass
class StepRecord:
    """What one optimizer step did (losses averaged over its micro-batches)."""

    step: int
    loss: float
    """The optimised loss: LM + scaled MTP + MoE aux."""
    lm_loss: float
    """Next-token cross-entropy alone, the number runs are compared on."""
    lr: float
    grad_norm: float
    """Global gradient norm before clipping."""
    seconds: float
    tokens_seen: int
    finite: bool
    switched_to_bf16: bool = False
    update: int = 0


@dataclass
class RunHistory:
    """What a run did: one record per applied step, the monitor events, how it ended."""

    records: list[StepRecord] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    """The :class:`~factory.runtime.callbacks.Event` s the callbacks raised."""
    end: str = "completed"
    """'completed', 'stopped' (a monitor's stop, or a rollback that could not happen),
    'diverged' (stopped at a non-finite loss or gradient) or 'interrupted' (a stop signal:
    ``signal`` says which)."""
    message: str = ""
    signal: int = 0
    """The signal that interrupted the run (0: none)."""

    @property
    def diverged(self) -> bool:
        return self.end == "diverged"

    @property
    def lm_losses(self) -> list[float]:
        return [r.lm_loss for r in self.records]
