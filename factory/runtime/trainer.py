"""The trainer: one loop for one process or many, checkpointed, watched and resumable.

Why a trainer of our own rather than Megatron's: a blueprint's numerics (NVFP4
against BF16, Hadamard, stochastic rounding) and its layout must be checked by
real runs on a CPU, with the blueprint's optimizer and data. What the step
needs (the optimizer, gradient accumulation from micro to global batch, the
aux-loss-free expert-bias step, the precision runtime's late switch to BF16,
checkpoints, rollbacks) fits in this module and a few small ones. Every setting
comes from the blueprint:

* AdamW over fp32 masters (``factory.runtime.optimizer``);
* ``global_batch_size / micro_batch_size`` micro-batches per step, this rank's
  data-parallel share of them, token-weighted (``factory.runtime.step``);
* the global gradient norm clipped to ``grad_clip`` (recorded before clipping);
* :func:`factory.runtime.schedule.learning_rate` over the run's own length, and
  after a rollback the annealing ``training.stability.rollback`` names;
* ``precision.on_tokens(tokens_seen)`` after every step (``switch_to_bf16``).

A run on several ranks is the same code: :class:`~factory.runtime.ranks.Ranks`
answers the collective questions (one process answers them itself), and a
laid-out model (``factory.runtime.placement``) looks like the whole model to
the trainer. Everything else happens in callbacks (``factory.runtime.callbacks``):
the stability monitors (``warn`` logs, ``stop`` checkpoints and ends the run,
``rollback`` returns to the last checkpoint before the trouble began, skips the
data that led there and anneals the learning rate), ``metrics.jsonl``, the
progress display and periodic checkpoints. The trainer imports none of them:
``factory.runtime.fit`` chooses the standard set.

With ``stop_on_signals`` a SIGTERM or SIGINT (``factory.runtime.stop_signals``)
ends the run at the next step boundary, on every rank at the same step: the
step in flight finishes, a checkpoint is written and waited for, and the run
ends ``interrupted``. A resume starts from the newest checkpoint that can be
read, saying which newer ones could not and why.

A non-finite loss or gradient norm never reaches the weights. Given the same
compiled model, batches and seed, two runs are bit-identical, and a run resumed
from a checkpoint continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from factory.compilation import Compiled, compile_for_training
from factory.graph.loss import mtp_loss_scale
from factory.runtime.batches import MicroBatch
from factory.runtime.callbacks import Callback, HeldoutMetrics, Rollback, StepStats, Verdict
from factory.runtime.checkpoint import (
    CheckpointDamaged,
    Checkpointer,
    CheckpointError,
    complete_checkpoints,
    set_aside,
)
from factory.runtime.gradients import clip_to_norm, norm_masters
from factory.runtime.history import RunHistory, StepRecord
from factory.runtime.optimizer import MasterOptimizer
from factory.runtime.run_options import RunOptions, StageStart
from factory.runtime.run_state import Anneal, Position, restore, restore_boundary, snapshot
from factory.runtime.schedule import annealed_rate, learning_rate
from factory.runtime.step import StepOutcome, forward_backward
from factory.runtime.stop_signals import StopSignals, catching_stop_signals

__all__ = ["BatchSource", "Trainer", "learning_rate_at"]


class BatchSource(Protocol):
    """Micro-batches in a deterministic order that can restart at any sample
    (:class:`~factory.runtime.loader.ShardLoader`)."""

    def __iter__(self) -> Iterator[MicroBatch]: ...

    @property
    def position(self) -> int:
        """Samples of the stream consumed so far."""

    def seek(self, consumed: int) -> None:
        """Make the next micro-batch start after the first ``consumed`` samples."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume a saved position; refuse one from another order."""


def learning_rate_at(position: Position, steps: int, compiled: Compiled) -> float:
    """The rate of a ``steps``-step schedule at ``position`` (its ``schedule_offset`` steps
    in, where earlier stages of a program took those), capped by a rollback's annealing."""
    training = compiled.blueprint.training
    rate = learning_rate(position.schedule_offset + position.step, steps, training)
    a = position.anneal
    if a is not None:
        shape = training.stability.rollback.anneal_shape
        floor = training.optimizer.min_lr
        rate = min(rate, annealed_rate(position.step, a.start, a.rate, a.steps, shape, floor))
    return rate


class Trainer:
    """Trains ``compiled.model`` on ``batches`` until schedule step ``steps``.

    Callbacks see it as a :class:`~factory.runtime.callbacks.TrainerView`: its
    ``compiled`` model, ``steps``, ``position``, ``ranks``, ``options`` and ``history``,
    and :meth:`save`.
    """

    def __init__(
        self,
        compiled: Compiled,
        batches: BatchSource,
        steps: int,
        options: RunOptions,
        callbacks: Sequence[Callback],
    ) -> None:
        self.compiled, self.batches, self.steps, self.options = compiled, batches, steps, options
        self.ranks = options.ranks
        self.callbacks = list(callbacks)
        self.position = Position()
        self.history = RunHistory()
        self.optimizer: MasterOptimizer | None = None
        self.checkpointer: Checkpointer | None = None
        self._stream: Iterator[MicroBatch] = iter(())

    def fit(self) -> RunHistory:
        """Run to ``steps`` (or until a callback stops it); the history of the run."""
        bp = self.compiled.blueprint
        self._check_batch_split()
        torch.manual_seed(bp.training.seed if self.options.seed is None else self.options.seed)
        self.compiled.model.train()
        if bp.training.compile:
            compile_for_training(self.compiled)
        self.optimizer = MasterOptimizer(
            self.compiled.model, bp.training.optimizer, bp.training.average
        )
        o = self.options
        if o.run_dir is not None:
            root = o.run_dir / "checkpoints"
            self.checkpointer = Checkpointer(root, o.keep_checkpoints, o.async_checkpoint, o.ranks)
        if o.resume:
            self._resume()
        elif o.start_from is not None:
            self._start_from(o.start_from)
        else:
            self.batches.seek(0)
        self.position.schedule_offset = o.schedule_offset
        self._stream = iter(self.batches)
        try:
            for callback in self.callbacks:
                callback.pre_train(self)
            with catching_stop_signals(o.stop_on_signals) as stop:
                self._train(stop)
            if self.checkpointer is not None:
                if self.history.end == "completed" and not self._saved_this_step():
                    self.save()
                self.checkpointer.wait()
            for callback in self.callbacks:
                callback.post_train(self, self.history)
        finally:
            for callback in self.callbacks:
                callback.close(self)
        return self.history

    def _train(self, stop: StopSignals) -> None:
        """Steps until the last, a callback's stop, or a stop signal on any rank."""
        agree = self.options.stop_on_signals  # else nothing is caught: spare the all-reduce
        while self.position.step < self.steps:
            signum = self.ranks.highest(stop.received) if agree else 0  # one step for all
            if signum:
                self._interrupt(signum)
                return
            if not self._step():
                return

    def _interrupt(self, signum: int) -> None:
        """End the run between steps: checkpoint where it stands and wait for the write."""
        self.history.end, self.history.signal = "interrupted", signum
        name, step = signal.Signals(signum).name, self.position.step
        self.history.message = f"stopped by {name} at step {step}"
        if self.checkpointer is not None:
            self.checkpointer.wait()
            if not self._saved_this_step():
                self.save()
            path = self.checkpointer.wait() or self.checkpointer.root / f"step_{step:08d}"
            self.history.message += f"; checkpoint {path}"

    def _saved_this_step(self) -> bool:
        """Whether the newest complete checkpoint is of this step (a periodic save, or the
        one a resume started from): writing it again would only spend time (a stop signal's
        grace period), and replacing it leaves a moment with no checkpoint of this step."""
        assert self.checkpointer is not None
        self.checkpointer.wait()
        newest = complete_checkpoints(self.checkpointer.root)[-1:]
        return bool(self.ranks.agree(bool(newest) and newest[0][0] == self.position.step))

    @property
    def schedule_steps(self) -> int:
        """The length of the learning-rate schedule this run is part of."""
        return self.options.schedule_steps or self.steps

    def _check_batch_split(self) -> None:
        par = self.compiled.blueprint.parallelism
        if par.global_batch_size % par.micro_batch_size:
            raise ValueError(
                f"global_batch_size {par.global_batch_size} is not a multiple of "
                f"micro_batch_size {par.micro_batch_size}"
            )
        if (par.global_batch_size // par.micro_batch_size) % self.ranks.data_size:
            raise ValueError(
                f"global_batch_size {par.global_batch_size} is not a multiple of "
                f"micro_batch_size {par.micro_batch_size} x {self.ranks.data_size} "
                "data-parallel replicas"
            )

    # --- one step --------------------------------------------------------------------------

    def _step(self) -> bool:
        """Run, check and apply one optimizer step; False when the run ends here."""
        assert self.optimizer is not None
        bp, model, p = self.compiled.blueprint, self.compiled.model, self.position
        start = time.perf_counter()
        lr = learning_rate_at(p, self.schedule_steps, self.compiled)
        self.optimizer.set_lr(lr)
        self.optimizer.zero_grad()
        consumed_before = p.consumed
        micro_per_step = bp.parallelism.global_batch_size // bp.parallelism.micro_batch_size
        micro = self._next_micro_batches(micro_per_step // self.ranks.data_size)
        outcome = forward_backward(
            model, micro, mtp_loss_scale(bp.model), self.ranks, bp.training.objective.loss_average
        )
        self.optimizer.grads_to_masters()
        grad_norm = float(self.ranks.grad_norm(norm_masters(model, self.optimizer)))
        clip = bp.training.optimizer.grad_clip
        if clip is not None:
            clip_to_norm(self.optimizer.masters, clip, grad_norm)
        verdict = self._verdict(self._stats(outcome, grad_norm))
        action = self.ranks.agree(verdict.action)  # the same on every rank by construction
        if action == "rollback" and self._rollback(verdict.rollback_before):
            return True
        if action != "continue":
            self._stop(verdict, consumed_before)
            return False
        record = self._apply(outcome, lr, grad_norm, time.perf_counter() - start)
        for callback in self.callbacks:
            callback.post_step(self, record, outcome)
        if self.checkpointer is not None:
            self.checkpointer.poll()
        return True

    def _next_micro_batches(self, count: int) -> list[MicroBatch]:
        micro = [next(self._stream) for _ in range(count)]
        self.position.consumed = self.batches.position
        return micro

    def _stats(self, outcome: StepOutcome, grad_norm: float) -> StepStats:
        return StepStats(
            update=self.position.update,
            step=self.position.step,
            loss=outcome.loss,
            grad_norm=grad_norm,
            finite=math.isfinite(outcome.loss) and math.isfinite(grad_norm),
            max_vio=outcome.max_vio(),
            residual_rms=outcome.residual_rms,
        )

    def _verdict(self, stats: StepStats) -> Verdict:
        """Every callback's verdict on the step, merged; its events recorded and announced."""
        merged = Verdict()
        for callback in self.callbacks:
            merged = merged.merged(callback.check_step(self, stats))
        for event in merged.events:
            self.history.events.append(event)
            for callback in self.callbacks:
                callback.on_event(self, event)
        return merged

    def _apply(
        self, outcome: StepOutcome, lr: float, grad_norm: float, seconds: float
    ) -> StepRecord:
        """Take the optimizer step, move the expert biases and the token count; its record."""
        assert self.optimizer is not None
        precision, p = self.compiled.precision, self.position
        self.optimizer.step()
        self.optimizer.update_average(p.step)
        if precision is not None:
            precision.weights_updated()
        self.compiled.model.update_expert_biases(outcome.tokens_per_expert)
        p.tokens_seen += outcome.tokens
        switched = precision.on_tokens(p.tokens_seen) if precision is not None else False
        record = StepRecord(
            p.step, outcome.loss, outcome.lm_loss, lr, grad_norm, seconds, p.tokens_seen, True,
            switched, p.update,
        )  # fmt: skip
        self.history.records.append(record)
        p.step += 1
        p.update += 1
        return record

    def _stop(self, verdict: Verdict, consumed_before: int) -> None:
        """End the run at a refused step: checkpoint it so that a resume re-runs it."""
        non_finite = any(e.monitor == "non_finite" for e in verdict.events)
        self.history.end = "diverged" if non_finite else "stopped"
        self.history.message = self.history.message or "; ".join(e.message for e in verdict.events)
        self.position.consumed = consumed_before
        self.save()
        self.batches.seek(consumed_before)

    def evaluated(self, records: list[HeldoutMetrics]) -> None:
        """Hand an evaluation's records to every callback (``metrics.jsonl``, the trackers)."""
        for callback in self.callbacks:
            callback.on_evaluation(self, records)

    # --- checkpoints -------------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint the run as it stands (nothing without a run folder)."""
        if self.checkpointer is None:
            return
        assert self.optimizer is not None
        self.checkpointer.poll()
        data_state = {**self.batches.state_dict(), "consumed": self.position.consumed}
        states = {c.state_key: c.state_dict() for c in self.callbacks if c.state_key}
        state, local, meta = snapshot(
            self.compiled, self.optimizer, states, self.position, data_state
        )
        started = time.perf_counter()
        path = self.checkpointer.save(self.position.step, state, local, meta)
        seconds = time.perf_counter() - started
        for callback in self.callbacks:
            callback.on_checkpoint(self, path, seconds)

    def _restore(self, path: Path) -> tuple[Position, dict[str, Any]]:
        """Load checkpoint ``path`` into the run and its callbacks; its position and data
        state."""
        assert self.optimizer is not None
        position, data_state, meta = restore(path, self.compiled, self.optimizer, self.ranks.rank)
        for callback in self.callbacks:
            if callback.state_key and callback.state_key in meta:
                callback.load_state_dict(meta[callback.state_key])
        return position, data_state

    def _resume(self) -> None:
        """Continue from the newest checkpoint every rank can read; the damaged newer ones
        are passed over with a notice, and none readable is an error naming each."""
        ckpt = self.checkpointer
        found = [path for _, path in complete_checkpoints(ckpt.root)] if ckpt else []
        candidates = self.ranks.agree(found[::-1])  # newest first, as rank 0 sees them
        if not candidates:
            where = self.options.run_dir or "a run without a run folder"
            raise CheckpointError(f"{where}: no complete checkpoint to resume from")
        damaged: list[tuple[Path, str]] = []
        for path in candidates:
            problem = self._try_restore(path)
            if problem is None:
                # Out of the way of the next resume and of pruning; none is moved while no
                # checkpoint loads, so a rerun never quietly starts over.
                for newer, line in damaged if self.ranks.is_main else ():
                    aside = set_aside(newer).name
                    self.options.notice(f"{line}; moved to {aside}; resuming from {path.name}")
                return
            damaged.append((path, problem))
        lines = "; ".join(line for _, line in damaged)
        raise CheckpointDamaged(f"{lines}; no checkpoint left to resume from")

    def _start_from(self, start: StageStart) -> None:
        """Begin a program's stage at the boundary of the stage before: its weights (read
        onto this stage's layout), its optimizer state and data position as ``start`` says.
        The position, RNG, precision runtime and callbacks start afresh, as in a new run, so
        a stage begins the same whether its predecessor ran in this process or not."""
        assert self.optimizer is not None
        data_state = restore_boundary(
            start.checkpoint, self.compiled, self.optimizer, start.optimizer
        )
        if not start.data_position:
            self.batches.seek(0)
            return
        try:
            self.batches.load_state_dict(data_state)
        except ValueError as exc:
            message = f"{start.checkpoint}: its data position does not fit this stage's data: {exc}"
            raise CheckpointError(message) from exc
        self.position.consumed = self.batches.position

    def _try_restore(self, path: Path) -> str | None:
        """Restore ``path`` and its data position; why it cannot be read (on any rank), or
        None. Another model's checkpoint, or another data order, is an error, not damage."""
        try:
            self.position, data_state = self._restore(path)
            problem = None
        except CheckpointDamaged as exc:
            problem = str(exc)
        if self.ranks.highest(int(problem is not None)):
            return problem or f"{path}: cannot be read on another rank"
        try:
            self.batches.load_state_dict(data_state)
        except ValueError as exc:
            message = f"{path}: its data position does not fit this data: {exc}"
            raise CheckpointError(message) from exc
        return None

    def _rollback(self, trouble_began: int | None) -> bool:
        """Go back to the last checkpoint before the trouble began; False when impossible."""
        cfg = self.compiled.blueprint.training.stability.rollback
        p = self.position
        first = trouble_began if trouble_began is not None else p.step
        ckpt = self.checkpointer
        target = ckpt.latest(before_step=first + 1) if ckpt is not None else None
        if ckpt is None or target is None or p.rollbacks >= cfg.max_rollbacks:
            why = "no checkpoint from before it" if target is None else f"{p.rollbacks} rollbacks"
            self.history.message = f"rollback needed at step {p.step} but impossible: {why}"
            return False
        ckpt.wait()
        consumed, update, rollbacks, from_step = p.consumed, p.update, p.rollbacks, p.step
        position, _ = self._restore(target)
        skipped = consumed - position.consumed  # the window that led to the trouble
        # The refused attempt keeps its update number: updates count attempts, monotonically.
        position.consumed, position.update, position.rollbacks = consumed, update + 1, rollbacks + 1
        anneal_steps = max(1, round(cfg.anneal_fraction * self.steps))
        rate = learning_rate_at(position, self.schedule_steps, self.compiled)
        position.anneal = Anneal(start=position.step, rate=rate, steps=anneal_steps)
        self.position = position
        self.batches.seek(consumed)  # the window that led to the trouble is skipped
        rollback = Rollback(update, from_step, position.step, skipped, anneal_steps)
        for callback in self.callbacks:
            callback.on_rollback(self, rollback)
        return True
