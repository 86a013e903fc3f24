"""The learning rate at a step, from a blueprint's ``training.optimizer`` and ``training.schedule``.

Torch-free, so plans and reports can draw the schedule without importing torch.

Steps are 0-based: ``learning_rate(s, ...)`` is the rate used by the ``s``-th
optimizer step. Phases, with ``W = round(warmup_fraction * steps)``:

* **warmup** (``s < W``): linear from ``lr / W`` up to ``lr`` at ``s = W - 1``.
  Megatron starts warmup at 0, which spends the first step at lr 0; on a
  300-step proxy that is a wasted step, so the ramp ends rather than starts on
  a whole step.
* **wsd**: ``lr`` until the last ``D = max(1, round(decay_fraction * steps))``
  steps, then ``min_lr + (lr - min_lr) * f(r)`` with ``r = (s - (steps - D) + 1) / D``
  running from ``1/D`` to 1, so the last step is taken at ``min_lr``.
  ``f`` is Megatron's ``lr_wsd_decay_style``: ``linear`` 1 - r, ``cosine``
  (1 + cos(pi r)) / 2, ``minus_sqrt`` 1 - sqrt(r) (Hägele et al. 2024).
* **cosine**: after warmup, ``min_lr + (lr - min_lr) * (1 + cos(pi r)) / 2``
  with ``r`` running from 0 to 1 over the remaining steps.
* **constant**: ``lr`` after warmup.

A warmup that overlaps the decay (possible only on very short runs) is
resolved by taking the smaller of the two rates.
"""

from __future__ import annotations

import math

from factory.schemas.training import TrainingConfig

__all__ = ["annealed_rate", "learning_rate"]


def _decay(shape: str, r: float) -> float:
    """The fraction of (lr - min_lr) left after a fraction ``r`` of the decay."""
    if shape == "linear":
        return 1.0 - r
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * r))
    if shape == "minus_sqrt":
        return 1.0 - math.sqrt(r)
    raise ValueError(f"unknown decay shape {shape!r}")


def learning_rate(step: int, steps: int, training: TrainingConfig) -> float:
    """The learning rate of 0-based optimizer step ``step`` of a ``steps``-step run."""
    if not 0 <= step < steps:
        raise ValueError(f"step {step} outside a {steps}-step run")
    opt, sched = training.optimizer, training.schedule
    peak, floor = opt.lr, opt.min_lr
    warmup = round(sched.warmup_fraction * steps)
    rate = peak * (step + 1) / warmup if step < warmup else peak
    if sched.kind == "wsd":
        decay = max(1, round(sched.decay_fraction * steps))
        start = steps - decay
        if step >= start:
            r = (step - start + 1) / decay
            rate = min(rate, floor + (peak - floor) * _decay(sched.decay_shape, r))
    elif sched.kind == "cosine" and step >= warmup:
        span = max(1, steps - 1 - warmup)
        r = min(1.0, (step - warmup) / span)
        rate = floor + (peak - floor) * _decay("cosine", r)
    return rate


def annealed_rate(
    step: int, start: int, rate: float, steps: int, shape: str, min_lr: float
) -> float:
    """The rate of ``step`` during an annealing started at ``start`` from ``rate``: it decays
    to ``min_lr`` over ``steps`` steps with ``shape`` (as the WSD decay), then stays there."""
    r = min(1.0, max(0, step - start + 1) / steps)
    return min_lr + (rate - min_lr) * _decay(shape, r)
