"""The ``training.stability`` section: what the run watches, and what it does when it sees it.

Consumed by ``factory.runtime.monitors``. Each monitor has a threshold and an
action: ``warn`` logs the event; ``stop`` writes a checkpoint and ends the run
cleanly with the reason; ``rollback`` returns to the last checkpoint taken
before the first sign of trouble, skips the data window that led there and
starts annealing the learning rate (``rollback``), which is how the Nemotron 3
Ultra team recovered from its two divergences (``docs/stability.md`` gives the
reasoning behind every default).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from factory.schemas.base import Section

__all__ = [
    "GradSpikeMonitor",
    "LossSpikeMonitor",
    "MaxVioMonitor",
    "NonFiniteMonitor",
    "ResidualRMSMonitor",
    "RollbackConfig",
    "StabilityConfig",
]

Action = Literal["warn", "stop", "rollback"]

_MAX_WINDOW = 100_000
_MAX_STEPS = 2**40


class _Monitor(Section):
    """What every thresholded monitor has: its action, when it starts judging, how many
    consecutive steps over the threshold it waits for."""

    action: Action = "warn"
    after_step: int = Field(default=0, ge=0, le=_MAX_STEPS)
    """Steps not judged at the start of the run."""
    patience: int = Field(default=1, ge=1, le=_MAX_WINDOW)
    """Consecutive steps over the threshold before acting."""


class MaxVioMonitor(_Monitor):
    """MoE load imbalance per layer: MaxVio = max over experts of load / mean load - 1."""

    threshold: float = Field(default=10.0, gt=0)
    """Act when a layer's MaxVio exceeds this (10: its busiest expert gets 11x the mean;
    the Ultra divergence showed 12x in the first MoE layer)."""
    after_step: int = Field(default=100, ge=0, le=_MAX_STEPS)
    """A freshly initialised router is unbalanced by construction: the first steps are not
    judged."""
    patience: int = Field(default=5, ge=1, le=_MAX_WINDOW)


class ResidualRMSMonitor(_Monitor):
    """Spread of the residual stream across depth: max over layers of RMS / min over layers."""

    threshold: float = Field(default=1e3, gt=1)
    """Act when the largest per-layer RMS exceeds the smallest by this factor (the Ultra
    divergence showed four orders of magnitude)."""


class _SpikeMonitor(_Monitor):
    window: int = Field(default=50, ge=5, le=_MAX_WINDOW)
    """Steps in the running baseline (median and MAD); no verdict until it is full."""


class LossSpikeMonitor(_SpikeMonitor):
    """The loss against its running median: a robust z-score (``docs/stability.md``)."""

    threshold: float = Field(default=8.0, gt=0)
    """Act when (loss - median) / (1.4826 * MAD) of the window exceeds this."""
    action: Action = "rollback"
    patience: int = Field(default=2, ge=1, le=_MAX_WINDOW)
    """One noisy batch is not a divergence."""


class GradSpikeMonitor(_SpikeMonitor):
    """The global gradient norm against its running median, likewise."""

    threshold: float = Field(default=10.0, gt=0)


class NonFiniteMonitor(Section):
    """A NaN or infinity in the loss, the gradients or the parameters. Always acts at once:
    the optimizer step that would spread it to the weights is never taken."""

    action: Literal["stop", "rollback"] = "rollback"


class RollbackConfig(Section):
    """Where a rollback goes and how the learning rate anneals afterwards."""

    anneal_shape: Literal["linear", "cosine", "minus_sqrt"] = "minus_sqrt"
    """Shape of the decay from the rate at the rolled-back step down to min_lr."""
    anneal_fraction: float = Field(default=0.2, gt=0, le=1)
    """Length of that decay as a fraction of the run's steps (WSD's decay phase by default)."""
    max_rollbacks: int = Field(default=3, ge=0, le=1000)
    """After this many rollbacks the next rollback action stops the run instead."""
    clean_steps: int = Field(default=20, ge=1, le=_MAX_WINDOW)
    """Steps without any event that end a trouble episode (its first sign is forgotten)."""


class StabilityConfig(Section):
    """Monitors of a training run (``factory.runtime.monitors``)."""

    max_vio: MaxVioMonitor = MaxVioMonitor()
    residual_rms: ResidualRMSMonitor = ResidualRMSMonitor()
    loss_spike: LossSpikeMonitor = LossSpikeMonitor()
    grad_spike: GradSpikeMonitor = GradSpikeMonitor()
    non_finite: NonFiniteMonitor = NonFiniteMonitor()
    rollback: RollbackConfig = RollbackConfig()
