"""Rules on the ``training`` section against the data, model and batch size.

Training length can be written as steps or tokens; one step consumes
``global_batch_size * seq_len`` tokens, so tokens convert to
``tokens // tokens_per_step`` steps (Megatron's floor, as for
``--train-samples``).
"""

from __future__ import annotations

from collections.abc import Iterator

from factory.checks.registry import Finding, rule
from factory.schemas.blueprint import Blueprint


@rule("training.length")
def length(bp: Blueprint) -> Iterator[Finding]:
    """Training length is given at most once: steps or tokens (neither: one pass over the data)."""
    train = bp.training
    if train.steps is not None and train.tokens is not None:
        yield Finding(
            "training.tokens",
            f"give exactly one of training.steps ({train.steps}) and training.tokens "
            f"({train.tokens}), not both",
        )


@rule("training.seq_len_fits_model")
def seq_len_fits_model(bp: Blueprint) -> Iterator[Finding]:
    """Packed training samples cannot be longer than the model's context."""
    if bp.data.seq_len > bp.model.max_seq_len:
        yield Finding(
            "data.seq_len",
            f"seq_len={bp.data.seq_len} exceeds model.max_seq_len ({bp.model.max_seq_len})",
        )


@rule("training.schedule_fractions")
def schedule_fractions(bp: Blueprint) -> Iterator[Finding]:
    """WSD warmup and decay phases fit inside the run."""
    sched = bp.training.schedule
    total = sched.warmup_fraction + sched.decay_fraction
    if sched.kind == "wsd" and total > 1:
        yield Finding(
            "training.schedule.decay_fraction",
            f"warmup_fraction + decay_fraction = {sched.warmup_fraction} + "
            f"{sched.decay_fraction} = {total:g} exceeds 1",
        )


@rule("training.min_lr")
def min_lr(bp: Blueprint) -> Iterator[Finding]:
    """The learning rate decays to min_lr, so min_lr cannot exceed the peak."""
    opt = bp.training.optimizer
    if opt.min_lr > opt.lr:
        yield Finding(
            "training.optimizer.min_lr", f"min_lr={opt.min_lr} exceeds the peak lr={opt.lr}"
        )


@rule("training.epochs")
def epochs(bp: Blueprint) -> Iterator[Finding]:
    """Training on more tokens than the mixture holds repeats data."""
    tokens = bp.training_tokens
    if tokens is not None and tokens > bp.data.tokens:
        path = "training.tokens" if bp.training.tokens is not None else "training.steps"
        yield Finding(
            path,
            f"training on {tokens} tokens is {tokens / bp.data.tokens:.2f} epochs of the "
            f"{bp.data.tokens}-token data mixture; data will repeat",
            "warning",
        )


@rule("training.at_least_one_step")
def at_least_one_step(bp: Blueprint) -> Iterator[Finding]:
    """Training tokens cover at least one step of global_batch_size * seq_len.

    A remainder is not reported: token budgets are round numbers and steps are
    not, so the run simply stops at the last whole step.
    """
    tokens, per_step = bp.training.tokens, bp.tokens_per_step
    if tokens is not None and tokens < per_step:
        yield Finding(
            "training.tokens",
            f"training.tokens={tokens} is less than one step (global_batch_size*seq_len = "
            f"{bp.parallelism.global_batch_size}*{bp.data.seq_len} = {per_step} tokens)",
        )


@rule("training.average_start")
def average_start(bp: Blueprint) -> Iterator[Finding]:
    """The weight average starts at a step the run takes."""
    average, steps = bp.training.average, bp.training_steps
    if average is not None and average.start >= steps:
        yield Finding(
            "training.average.start",
            f"start={average.start} is past the run's last step ({steps} steps: 0 to "
            f"{steps - 1}), so the average would never begin",
        )


@rule("training.eval_interval")
def eval_interval(bp: Blueprint) -> Iterator[Finding]:
    """An evaluation interval longer than the run would evaluate only at the end: a typo."""
    evaluation, steps = bp.training.eval, bp.training_steps
    if evaluation is not None and evaluation.interval > steps:
        yield Finding(
            "training.eval.interval",
            f"evaluation every {evaluation.interval} steps is past the run's {steps} steps "
            f"(training.steps or tokens / global_batch_size*seq_len); at most {steps}",
        )
