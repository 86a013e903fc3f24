"""Stability monitors: per step, what the run watches and what it does about it (torch-free).

:class:`Monitors` is the trainer's callback for ``training.stability``: it sees
one :class:`~factory.runtime.callbacks.StepStats` per optimizer step, before
that step is applied, and answers with the events it raised, each carrying its
configured action. A trouble *episode* starts at the first event of any monitor
and ends after ``rollback.clean_steps`` steps without one: a rollback goes back
to the last checkpoint taken before that first sign. ``docs/stability.md``
explains each statistic and its default threshold.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from factory.runtime.callbacks import Callback, Event, StepStats, TrainerView, Verdict
from factory.schemas.stability import StabilityConfig

__all__ = ["Monitors"]

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_RELATIVE_FLOOR = 0.01
"""A spread below 1% of the median never counts: a flat window (a loss at min_lr, a clipped
gradient norm) would otherwise make any wobble a spike."""


class _Baseline:
    """A running median and MAD of accepted values; spikes are not let into it."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def z(self, value: float) -> float | None:
        """Robust z-score of ``value``, or None until the window is full."""
        if len(self.values) < (self.values.maxlen or 0):
            return None
        median = statistics.median(self.values)
        mad = statistics.median(abs(v - median) for v in self.values)
        scale = max(_MAD_TO_SIGMA * mad, _RELATIVE_FLOOR * abs(median), 1e-12)
        return (value - median) / scale


class Monitors(Callback):
    """All monitors of one run, with their state (patience counters, baselines, episode)."""

    state_key = "monitors"

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self.loss = _Baseline(config.loss_spike.window)
        self.grad = _Baseline(config.grad_spike.window)
        self.streaks: dict[str, int] = {}
        self.first_sign_step: int | None = None
        self.clean = 0

    def observe(self, stats: StepStats) -> list[Event]:
        """The events of one step; updates baselines, streaks and the trouble episode."""
        events = self._non_finite(stats)
        if not events:
            events = [
                *self._spikes(stats),
                *self._max_vio(stats),
                *self._residual(stats),
            ]
        self._track_episode(stats, events)
        return events

    def check_step(self, trainer: TrainerView, stats: StepStats) -> Verdict:
        """The step's events; a rollback goes back to before the episode's first sign."""
        return Verdict(tuple(self.observe(stats)), self.first_sign_step)

    def _track_episode(self, stats: StepStats, events: list[Event]) -> None:
        if events or self._any_streak():
            if self.first_sign_step is None:
                self.first_sign_step = stats.step
            self.clean = 0
            return
        self.clean += 1
        if self.clean >= self.config.rollback.clean_steps:
            self.first_sign_step = None

    def _any_streak(self) -> bool:
        return any(count > 0 for count in self.streaks.values())

    def _streak(self, key: str, hit: bool, patience: int) -> bool:
        """Count consecutive hits of ``key``; True when the patience is reached."""
        self.streaks[key] = self.streaks.get(key, 0) + 1 if hit else 0
        if not hit:
            del self.streaks[key]
        return hit and self.streaks.get(key, 0) >= patience

    def _non_finite(self, s: StepStats) -> list[Event]:
        if s.finite and math.isfinite(s.loss) and math.isfinite(s.grad_norm):
            return []
        action = self.config.non_finite.action
        message = f"non-finite loss ({s.loss}) or gradient norm ({s.grad_norm}) at step {s.step}"
        return [Event(s.update, s.step, "non_finite", action, message)]

    def _spikes(self, s: StepStats) -> list[Event]:
        out = []
        checks = (
            ("loss_spike", self.config.loss_spike, self.loss, s.loss, "loss"),
            ("grad_spike", self.config.grad_spike, self.grad, s.grad_norm, "gradient norm"),
        )
        for name, cfg, baseline, value, what in checks:
            z = baseline.z(value) if s.step >= cfg.after_step else None
            hit = z is not None and z > cfg.threshold
            if not hit:
                baseline.values.append(value)
            if self._streak(name, hit, cfg.patience):
                assert z is not None
                message = (
                    f"{what} {value:.4g} is {z:.1f} robust standard deviations above its "
                    f"running median (threshold {cfg.threshold})"
                )
                out.append(Event(s.update, s.step, name, cfg.action, message, value, cfg.threshold))
        return out

    def _max_vio(self, s: StepStats) -> list[Event]:
        cfg = self.config.max_vio
        out = []
        for layer, value in s.max_vio.items():
            hit = s.step >= cfg.after_step and value > cfg.threshold
            if self._streak(f"max_vio:{layer}", hit, cfg.patience):
                message = (
                    f"{layer}: MaxVio {value:.2f} (busiest expert at {value + 1:.1f}x the mean "
                    f"load) over {cfg.threshold} for {cfg.patience} step(s)"
                )
                out.append(Event(s.update, s.step, "max_vio", cfg.action, message, value,
                                 cfg.threshold, layer))  # fmt: skip
        return out

    def _residual(self, s: StepStats) -> list[Event]:
        cfg = self.config.residual_rms
        values = [v for v in s.residual_rms.values() if v > 0]
        if not values:
            return []
        spread = max(values) / min(values)
        hit = s.step >= cfg.after_step and spread > cfg.threshold
        if not self._streak("residual_rms", hit, cfg.patience):
            return []
        top = max(s.residual_rms, key=s.residual_rms.__getitem__)
        message = (
            f"residual-stream RMS spans {spread:.3g}x across layers (largest at {top}), "
            f"over {cfg.threshold:g}x"
        )
        return [Event(s.update, s.step, "residual_rms", cfg.action, message, spread,
                      cfg.threshold, top)]  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": list(self.loss.values),
            "grad": list(self.grad.values),
            "streaks": dict(self.streaks),
            "first_sign_step": self.first_sign_step,
            "clean": self.clean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.values.clear()
        self.loss.values.extend(state["loss"])
        self.grad.values.clear()
        self.grad.values.extend(state["grad"])
        self.streaks = dict(state["streaks"])
        self.first_sign_step = state["first_sign_step"]
        self.clean = state["clean"]
