"""Train a compiled model on one process, checkpointed, watched, and resumable.

Why a loop of our own rather than Megatron's: the CPU proxy has one rank, and
what is left (the optimizer, gradient accumulation from micro to global batch,
the aux-loss-free expert-bias step, the precision runtime's late switch to
BF16, checkpoints and stability monitors) fits in a few small modules that
tests can run. Every setting comes from the blueprint:

* AdamW over fp32 masters (``factory.runtime.optimizer``);
* ``global_batch_size / micro_batch_size`` micro-batches per step, token-weighted
  (``factory.runtime.step``);
* the global gradient norm clipped to ``grad_clip`` (recorded before clipping);
* :func:`factory.runtime.schedule.learning_rate` over the run's own length, and
  after a rollback the annealing ``training.stability.rollback`` names;
* ``precision.on_tokens(tokens_seen)`` after every step (``switch_to_bf16``);
* the monitors of ``training.stability`` before every optimizer step
  (``factory.runtime.monitors``): ``warn`` logs, ``stop`` checkpoints and ends the
  run, ``rollback`` returns to the last checkpoint before the trouble began,
  skips the data that led there and anneals the learning rate;
* with a run folder: ``metrics.jsonl`` as it goes, checkpoints every
  ``checkpoint_interval`` steps and at the end (``factory.runtime.checkpoint``),
  and ``resume`` continues from the latest complete one exactly as the
  uninterrupted run would have.

A non-finite loss or gradient norm never reaches the weights. Given the same
compiled model, batches and seed, two runs are bit-identical.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from factory.compilation import Compiled, compile_for_training
from factory.layers.model_spec import model_spec
from factory.runtime import checkpoint
from factory.runtime.batches import MicroBatch
from factory.runtime.gradients import clip_to_norm, norm_masters
from factory.runtime.metrics import MetricsLog, StepDisplay, metrics_path
from factory.runtime.monitors import Event, Monitors, StepStats, verdict
from factory.runtime.optimizer import MasterOptimizer
from factory.runtime.ranks import Ranks, SingleProcess
from factory.runtime.run_state import Anneal, Position, restore, snapshot
from factory.runtime.schedule import annealed_rate, learning_rate
from factory.runtime.step import StepOutcome, forward_backward
from factory.schemas.model import MTPConfig

__all__ = ["BatchSource", "RunOptions", "StepRecord", "TrainResult", "train"]


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


@dataclass
class RunOptions:
    """How a run is driven (the blueprint says what is trained)."""

    run_dir: Path | None = None
    """Where ``checkpoints/`` and ``metrics.jsonl`` go; None writes neither."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (default: ``training.checkpoint_interval``)."""
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    resume: bool = False
    """Continue from the latest complete checkpoint in ``run_dir`` (an error if none)."""
    seed: int | None = None
    """Seeds torch's global generator (default ``training.seed``)."""
    progress: bool = False
    log_every: int = 0
    description: str = "train"
    on_step: Callable[[int], None] | None = None
    """Called with the number of steps done after each optimizer step (progress reports)."""
    ranks: Ranks = field(default_factory=SingleProcess)
    """The other processes of a distributed run (``factory.distributed``); this rank's batches
    are its data-parallel share. Rank 0 writes ``metrics.jsonl`` and shows progress; every
    other rank writes ``ranks/rank_NNNNN.jsonl``."""


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
class TrainResult:
    records: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    end: str = "completed"
    """'completed', 'stopped' (a monitor's stop, or a rollback that could not happen) or
    'diverged' (stopped at a non-finite loss or gradient)."""
    message: str = ""

    @property
    def diverged(self) -> bool:
        return self.end == "diverged"

    @property
    def lm_losses(self) -> list[float]:
        return [r.lm_loss for r in self.records]


def mtp_loss_scale(compiled: Compiled) -> float:
    cfg = compiled.blueprint.model
    return (cfg.mtp or MTPConfig()).loss_scale if cfg.mtp_depth else 0.0


def _lr(position: Position, steps: int, compiled: Compiled) -> float:
    training = compiled.blueprint.training
    rate = learning_rate(position.step, steps, training)
    a = position.anneal
    if a is not None:
        shape = training.stability.rollback.anneal_shape
        floor = training.optimizer.min_lr
        rate = min(rate, annealed_rate(position.step, a.start, a.rate, a.steps, shape, floor))
    return rate


@dataclass
class _Run:
    """The state of one training run and the operations on it."""

    compiled: Compiled
    batches: BatchSource
    steps: int
    options: RunOptions
    optimizer: MasterOptimizer = field(init=False)
    monitors: Monitors = field(init=False)
    position: Position = field(default_factory=Position)
    ckpt: checkpoint.Checkpointer | None = None
    metrics: MetricsLog = field(init=False)
    stream: Iterator[MicroBatch] = field(init=False)
    result: TrainResult = field(default_factory=TrainResult)

    def __post_init__(self) -> None:
        bp, o = self.compiled.blueprint, self.options
        self.optimizer = MasterOptimizer(self.compiled.model, bp.training.optimizer)
        self.monitors = Monitors(bp.training.stability)
        if o.run_dir is not None:
            self.ckpt = checkpoint.Checkpointer(
                o.run_dir / "checkpoints", o.keep_checkpoints, o.async_checkpoint, o.ranks
            )
        if o.resume:
            self._resume()
        else:
            self.batches.seek(0)
        self.metrics = MetricsLog(metrics_path(o.run_dir, o.ranks))
        self.stream = iter(self.batches)

    def _resume(self) -> None:
        latest = self.ckpt.latest() if self.ckpt is not None else None
        if latest is None:
            where = self.options.run_dir or "a run without a run folder"
            raise checkpoint.CheckpointError(f"{where}: no complete checkpoint to resume from")
        self.position, data_state = restore(
            latest, self.compiled, self.optimizer, self.monitors, self.options.ranks.rank
        )
        try:
            self.batches.load_state_dict(data_state)
        except ValueError as exc:
            message = f"{latest}: its data position does not fit this data: {exc}"
            raise checkpoint.CheckpointError(message) from exc

    def next_micro_batches(self, count: int) -> list[MicroBatch]:
        micro = [next(self.stream) for _ in range(count)]
        self.position.consumed = self.batches.position
        return micro

    def save(self) -> None:
        if self.ckpt is None:
            return
        self.ckpt.poll()
        data_state = {**self.batches.state_dict(), "consumed": self.position.consumed}
        state, local, meta = snapshot(
            self.compiled, self.optimizer, self.monitors, self.position, data_state
        )
        started = time.perf_counter()
        path = self.ckpt.save(self.position.step, state, local, meta)
        self.metrics.write(
            "checkpoint",
            update=self.position.update,
            step=self.position.step,
            path=str(path),
            seconds=time.perf_counter() - started,
            **{"async": self.options.async_checkpoint},
        )


def _stats(run: _Run, outcome: StepOutcome, grad_norm: float) -> StepStats:
    finite = math.isfinite(outcome.loss) and math.isfinite(grad_norm)
    return StepStats(
        update=run.position.update,
        step=run.position.step,
        loss=outcome.loss,
        grad_norm=grad_norm,
        finite=finite,
        max_vio=outcome.max_vio(),
        residual_rms=outcome.residual_rms,
    )


def _apply(run: _Run, outcome: StepOutcome, lr: float, grad_norm: float, seconds: float) -> None:
    """Take the optimizer step and record it."""
    model: nn.Module = run.compiled.model
    run.optimizer.step()
    if run.compiled.precision is not None:
        run.compiled.precision.weights_updated()
    model.update_expert_biases(outcome.tokens_per_expert)
    p = run.position
    p.tokens_seen += outcome.tokens
    switched = run.compiled.precision.on_tokens(p.tokens_seen) if run.compiled.precision else False
    record = StepRecord(
        p.step, outcome.loss, outcome.lm_loss, lr, grad_norm, seconds, p.tokens_seen, True,
        switched, p.update,
    )  # fmt: skip
    run.result.records.append(record)
    run.metrics.write(
        "step",
        update=p.update,
        step=p.step,
        loss=outcome.loss,
        lm_loss=outcome.lm_loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens_seen=p.tokens_seen,
        tokens_per_s=outcome.tokens / max(seconds, 1e-9),
        seconds=seconds,
        finite=True,
        max_vio=outcome.max_vio(),
        residual_rms=outcome.residual_rms,
        switched_to_bf16=switched,
    )
    p.step += 1
    p.update += 1


def _rollback(run: _Run, display: StepDisplay) -> bool:
    """Go back to the last checkpoint before the trouble began; False when impossible."""
    cfg = run.compiled.blueprint.training.stability.rollback
    p = run.position
    first = run.monitors.first_sign_step if run.monitors.first_sign_step is not None else p.step
    target = run.ckpt.latest(before_step=first + 1) if run.ckpt is not None else None
    if target is None or p.rollbacks >= cfg.max_rollbacks:
        why = "no checkpoint from before it" if target is None else f"{p.rollbacks} rollbacks"
        run.result.message = f"rollback needed at step {p.step} but impossible: {why}"
        return False
    run.ckpt.wait()
    consumed, update, rollbacks, from_step = p.consumed, p.update, p.rollbacks, p.step
    position, _ = restore(target, run.compiled, run.optimizer, run.monitors, run.options.ranks.rank)
    skipped = consumed - position.consumed  # the window that led to the trouble
    # The refused attempt keeps its update number: updates count attempts, monotonically.
    position.consumed, position.update, position.rollbacks = consumed, update + 1, rollbacks + 1
    anneal_steps = max(1, round(cfg.anneal_fraction * run.steps))
    rate = _lr(position, run.steps, run.compiled)
    position.anneal = Anneal(start=position.step, rate=rate, steps=anneal_steps)
    run.position = position
    run.batches.seek(consumed)  # the window that led to the trouble is skipped
    run.metrics.write(
        "rollback", update=update, from_step=from_step, to_step=position.step,
        skipped_samples=skipped, anneal_steps=anneal_steps,
    )  # fmt: skip
    display.say(f"rollback: step {from_step} -> {position.step}, {skipped} samples skipped")
    return True


def train(
    compiled: Compiled,
    batches: BatchSource,
    steps: int | None = None,
    options: RunOptions | None = None,
) -> TrainResult:
    """Train ``compiled.model`` until schedule step ``steps`` (default: the blueprint's)."""
    o = options or RunOptions()
    bp = compiled.blueprint
    total = steps if steps is not None else bp.training_steps
    par = bp.parallelism
    if par.global_batch_size % par.micro_batch_size:
        raise ValueError(
            f"global_batch_size {par.global_batch_size} is not a multiple of "
            f"micro_batch_size {par.micro_batch_size}"
        )
    if (par.global_batch_size // par.micro_batch_size) % o.ranks.data_size:
        raise ValueError(
            f"global_batch_size {par.global_batch_size} is not a multiple of micro_batch_size "
            f"{par.micro_batch_size} x {o.ranks.data_size} data-parallel replicas"
        )
    torch.manual_seed(bp.training.seed if o.seed is None else o.seed)
    compiled.model.train()
    if bp.training.compile:
        compile_for_training(compiled)
    run = _Run(compiled, batches, total, o)
    layers = [layer.prefix for layer in model_spec(bp.model).layers]
    run.metrics.write("run", name=bp.meta.name, steps=total, seq_len=bp.data.seq_len,
                      global_batch_size=par.global_batch_size, layers=layers,
                      resumed_at=run.position.step,
                      started=time.strftime("%Y-%m-%dT%H:%M:%S"))  # fmt: skip
    shown = o.ranks.is_main
    display = StepDisplay(
        o.progress and shown, total, run.position.step, o.description, o.log_every if shown else 0
    )
    with display:
        _loop(run, display)
    if run.ckpt is not None:
        if run.result.end == "completed":
            run.save()
        run.ckpt.wait()
    run.metrics.write("end", update=run.position.update, step=run.position.step,
                      reason=run.result.end, message=run.result.message)  # fmt: skip
    run.metrics.close()
    return run.result


def _loop(run: _Run, display: StepDisplay) -> None:
    o, bp = run.options, run.compiled.blueprint
    every = o.checkpoint_every or bp.training.checkpoint_interval
    micro_per_step = bp.parallelism.global_batch_size // bp.parallelism.micro_batch_size
    accumulation = micro_per_step // o.ranks.data_size
    clip = bp.training.optimizer.grad_clip
    mtp_scale = mtp_loss_scale(run.compiled)
    while run.position.step < run.steps:
        start = time.perf_counter()
        lr = _lr(run.position, run.steps, run.compiled)
        run.optimizer.set_lr(lr)
        run.optimizer.zero_grad()
        consumed_before = run.position.consumed
        outcome = forward_backward(
            run.compiled.model, run.next_micro_batches(accumulation), mtp_scale, o.ranks
        )
        run.optimizer.grads_to_masters()
        grad_norm = float(o.ranks.grad_norm(norm_masters(run.compiled.model, run.optimizer)))
        if clip is not None:
            clip_to_norm(run.optimizer.masters, clip, grad_norm)
        events = run.monitors.observe(_stats(run, outcome, grad_norm))
        for event in events:
            run.result.events.append(event)
            run.metrics.write(**event.to_dict())
            display.say(f"[{event.action}] {event.monitor}: {event.message}")
        action = o.ranks.agree(verdict(events))  # the same on every rank by construction
        if action == "rollback" and _rollback(run, display):
            continue
        if action != "continue":
            non_finite = any(e.monitor == "non_finite" for e in events)
            run.result.end = "diverged" if non_finite else "stopped"
            run.result.message = run.result.message or "; ".join(e.message for e in events)
            run.position.consumed = consumed_before  # resuming re-runs the refused step
            run.save()
            run.batches.seek(consumed_before)
            display.say(
                f"{o.description}: stopped at step {run.position.step}: {run.result.message}"
            )
            return
        seconds = time.perf_counter() - start
        _apply(run, outcome, lr, grad_norm, seconds)
        tokens_per_s = outcome.tokens / max(seconds, 1e-9)
        display.step(run.position.step, outcome.lm_loss, lr, grad_norm, tokens_per_s)
        if o.on_step is not None:
            o.on_step(run.position.step)
        if run.position.step % every == 0 and run.position.step < run.steps:
            run.save()
        if run.ckpt is not None:
            run.ckpt.poll()
