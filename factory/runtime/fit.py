"""``fit``: the trainer with the callbacks every run has.

The trainer (``factory.runtime.trainer``) runs steps and calls whatever
callbacks it is given; this module chooses them: ``metrics.jsonl`` and the
other ``training.loggers``, the stability monitors, the progress display, the
held-out loss (``training.eval``, ``factory.runtime.validation``) and periodic
checkpoints. It is the one module that knows every callback, so the
trainer knows none and the callbacks see it only as
:class:`~factory.runtime.callbacks.TrainerView`.
"""

from __future__ import annotations

from collections.abc import Sequence

from factory.compilation import Compiled
from factory.runtime.callbacks import Callback, PeriodicCheckpoint
from factory.runtime.display import StepDisplay
from factory.runtime.history import RunHistory
from factory.runtime.loggers import run_loggers
from factory.runtime.monitors import Monitors
from factory.runtime.run_options import RunOptions
from factory.runtime.trainer import BatchSource, Trainer
from factory.runtime.validation import Validation

__all__ = ["fit", "standard_callbacks"]


def standard_callbacks(
    compiled: Compiled, options: RunOptions, on_step: Sequence[Callback] = ()
) -> list[Callback]:
    """The callbacks every run has, in the order they run: with a run folder ``metrics.jsonl``
    and the other ``training.loggers`` (``factory.runtime.loggers``), the stability monitors,
    the display, ``on_step``, with ``training.eval`` the held-out loss of ``options.heldout``
    (``factory.runtime.validation``), periodic checkpoints."""
    training = compiled.blueprint.training
    callbacks: list[Callback] = []
    if options.run_dir is not None:
        callbacks.extend(run_loggers(training.loggers, options.run_dir, options.ranks))
    callbacks.append(Monitors(training.stability))
    callbacks.append(
        StepDisplay(options.progress, options.log_every, options.description, options.log_every_s)
    )
    callbacks.extend(on_step)
    if training.eval is not None:
        callbacks.append(Validation(training.eval, options.heldout))
    if options.run_dir is not None:
        every = options.checkpoint_every or training.checkpoint_interval
        callbacks.append(PeriodicCheckpoint(every))
    return callbacks


def fit(
    compiled: Compiled,
    batches: BatchSource,
    steps: int | None = None,
    options: RunOptions | None = None,
    on_step: Sequence[Callback] = (),
) -> RunHistory:
    """Train ``compiled.model`` until schedule step ``steps`` (default: the blueprint's) with
    the :func:`standard_callbacks` (``on_step`` among them, after the display)."""
    o = options or RunOptions()
    total = steps if steps is not None else compiled.blueprint.training_steps
    callbacks = standard_callbacks(compiled, o, on_step)
    return Trainer(compiled, batches, total, o, callbacks).fit()
