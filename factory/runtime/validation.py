"""Validation while training (``training.eval``): the held-out loss every ``interval`` steps
and at the end, as torchtitan's ``Validator`` and Megatron's ``eval_interval`` do.

:class:`Validation` runs :func:`~factory.runtime.evaluation.evaluate` on the run's
held-out sets (``RunOptions.heldout``) after every ``interval``-th step and after the
run's last step (before its checkpoints), and again at a resumed step that is a multiple of ``interval`` (TensorBoard dropped
what was written there when the run resumed; the numbers are the same, since the
checkpoint holds the weights they came from). Each evaluation's records
(:class:`~factory.runtime.metrics.HeldoutMetrics`, one per set and one overall) go to
every callback through the trainer (``metrics.jsonl``, the trackers).

An evaluation changes no bit of the training: it runs between steps, reads its own
copy of the held-out samples (the training loader's position is untouched), and
:func:`~factory.runtime.evaluation.training_kept` puts back the generators, the precision
runtime's state and every module's mode; MoE expert biases move only in the trainer's
step, never in a forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from factory.runtime.callbacks import Callback, HeldoutMetrics, TrainerView
from factory.runtime.evaluation import Evaluation, HeldoutLoss, evaluate, training_kept
from factory.runtime.history import StepRecord
from factory.runtime.step import StepOutcome
from factory.schemas.training import EvalConfig

__all__ = ["Validation", "heldout_records"]


def heldout_records(evaluation: Evaluation, update: int, step: int) -> list[HeldoutMetrics]:
    """An evaluation as ``metrics.jsonl`` records: each set's, then all sets' together."""

    def record(category: str | None, loss: HeldoutLoss) -> HeldoutMetrics:
        mtp = {str(depth): value for depth, value in enumerate(loss.mtp_losses, start=1)}
        return HeldoutMetrics(update, step, category, loss.loss, loss.perplexity, loss.tokens, mtp)

    records = [record(category, loss) for category, loss in evaluation.sets.items()]
    return [*records, record(None, evaluation.overall)]


class Validation(Callback):
    """The held-out loss of ``sets`` (category to built folder) as ``config`` says."""

    def __init__(self, config: EvalConfig, sets: Mapping[str, Path]) -> None:
        if not sets:
            raise ValueError("training.eval: no held-out sets to evaluate")
        self.config = config
        self.sets = dict(sets)

    def run(self, trainer: TrainerView) -> None:
        """Evaluate now, at ``trainer.position``, and hand the records on."""
        compiled, position = trainer.compiled, trainer.position
        micro = compiled.blueprint.parallelism.micro_batch_size
        with training_kept(compiled):
            evaluation = evaluate(
                compiled.model,
                self.sets,
                self.config.tokens,
                micro,
                compiled.blueprint.model.mtp_depth,
                trainer.ranks,
            )
        trainer.evaluated(heldout_records(evaluation, position.update, position.step))

    def pre_train(self, trainer: TrainerView) -> None:
        step = trainer.position.step
        if step and step % self.config.interval == 0:
            self.run(trainer)

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        step = trainer.position.step
        if step % self.config.interval == 0 or step == trainer.steps:
            self.run(trainer)
