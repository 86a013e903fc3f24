"""Train a compiled model on one process: the blueprint's AdamW, clipping, schedule and batch.

Why a loop of our own rather than Megatron's: the CPU proxy has one rank, so
tensor/pipeline/expert parallelism reduce to nothing, and what is left (the
optimizer, gradient accumulation from micro to global batch, the
aux-loss-free expert-bias step, the precision runtime's late switch to BF16)
fits on a page that tests can run. Every setting comes from the blueprint:

* AdamW with ``training.optimizer``'s lr, betas, eps and weight decay;
  weight decay on matrices and embeddings only (not on norms, biases or
  Mamba's A/D/dt vectors), as Megatron does. The expert bias is moved by
  :meth:`~factory.graph.model.HybridLM.update_expert_biases`, never by AdamW.
* fp32 master weights: parameters in fp32 (the CPU default) are their own
  masters; otherwise an fp32 copy is stepped and copied back after each step.
* ``global_batch_size / micro_batch_size`` micro-batches per step (one
  process plays every data-parallel rank). The token losses (LM and MTP) are
  averaged over the step's loss tokens, not per micro-batch (Megatron's
  per-token loss): each micro-batch's mean is weighted by its share of the
  step's target tokens, so a micro-batch that is all prompt or padding neither
  counts as a zero loss nor dilutes the others. The MoE aux loss, a per-batch
  statistic, is averaged over micro-batches.
* the global gradient norm clipped to ``grad_clip`` (the norm is always
  recorded, before clipping);
* :func:`factory.runtime.schedule.learning_rate` at every step, over the run's
  own length (``steps``), so a shortened run still warms up and decays;
* ``precision.on_tokens(tokens_seen)`` after every step (``switch_to_bf16``).

A non-finite loss or gradient norm stops the run before the optimizer step
that would spread it to the weights; the result says so (``diverged``).
Given the same compiled model, batches and seed, two runs are bit-identical.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from factory.graph.loss import language_model_loss
from factory.runtime.batches import MicroBatch
from factory.runtime.schedule import learning_rate
from factory.schemas.model import MTPConfig

if TYPE_CHECKING:
    from factory.graph.compile import Compiled

__all__ = ["StepRecord", "TrainResult", "train"]


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


@dataclass
class TrainResult:
    records: list[StepRecord] = field(default_factory=list)
    diverged: bool = False
    """True when the run stopped at a non-finite loss or gradient norm."""

    @property
    def lm_losses(self) -> list[float]:
        return [r.lm_loss for r in self.records]


class _MasterWeights:
    """fp32 copies of non-fp32 parameters; the optimizer only ever sees fp32 tensors."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
            for p in params
        ]

    def grads_to_masters(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                param.copy_(master)


def _optimizer(compiled: Compiled, masters: _MasterWeights) -> torch.optim.AdamW:
    opt = compiled.blueprint.training.optimizer
    decay = [m for m in masters.masters if m.ndim >= 2]
    no_decay = [m for m in masters.masters if m.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": opt.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opt.lr, betas=opt.betas, eps=opt.eps
    )


def _mtp_loss_scale(compiled: Compiled) -> float:
    cfg = compiled.blueprint.model
    if not cfg.mtp_depth:
        return 0.0
    return (cfg.mtp or MTPConfig()).loss_scale


def _progress_bar(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """A rich progress bar (imported only when asked for), or a context yielding None."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )


def _forward_backward(
    model: nn.Module, micro: list[MicroBatch], mtp_scale: float, load: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """Accumulate one step's gradients and its tokens per expert (into ``load``); return the
    step's (optimised loss, LM loss) as floats."""
    counts = [int(batch.target_mask.sum()) for batch in micro]
    total = lm = 0.0
    for batch, count in zip(micro, counts, strict=True):
        weight = count / max(1, sum(counts))
        output = model(batch.input_ids)
        for name, tokens in output.tokens_per_expert.items():
            load[name] = load[name] + tokens if name in load else tokens
        losses = language_model_loss(
            output, batch.input_ids, batch.loss_mask, mtp_loss_scale=mtp_scale
        )
        aux = losses.aux if losses.aux is not None else losses.total.new_zeros(())
        loss = weight * (losses.total - aux) + aux / len(micro)
        loss.backward()
        total += loss.item()
        lm += weight * losses.lm.item()
    return total, lm


def train(
    compiled: Compiled,
    batches: Iterable[MicroBatch],
    steps: int | None = None,
    log_every: int = 0,
    progress: bool = False,
    seed: int | None = None,
    description: str = "train",
) -> TrainResult:
    """Train ``compiled.model`` for ``steps`` optimizer steps (default: the blueprint's).

    ``batches`` yields micro-batches of the blueprint's micro batch size (see
    :class:`~factory.runtime.batches.MicroBatches`); each step takes
    ``global_batch_size // micro_batch_size`` of them. ``log_every`` > 0 prints
    a line every that many steps; ``progress`` shows a rich progress bar.
    ``seed`` (default ``training.seed``) seeds torch's global generator for
    anything random in the step; initialisation and stochastic rounding were
    already seeded by :func:`factory.compile`.
    """
    bp = compiled.blueprint
    steps = steps if steps is not None else bp.training_steps
    par = bp.parallelism
    if par.global_batch_size % par.micro_batch_size:
        raise ValueError(
            f"global_batch_size {par.global_batch_size} is not a multiple of "
            f"micro_batch_size {par.micro_batch_size}"
        )
    accumulation = par.global_batch_size // par.micro_batch_size
    torch.manual_seed(bp.training.seed if seed is None else seed)

    model = compiled.model
    model.train()
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    masters = _MasterWeights(params)
    optimizer = _optimizer(compiled, masters)
    clip = bp.training.optimizer.grad_clip
    mtp_scale = _mtp_loss_scale(compiled)
    stream = iter(batches)
    result = TrainResult()
    tokens_seen = 0

    with _progress_bar(progress) as bar:
        task = bar.add_task(description, total=steps, status="") if bar is not None else None
        for step in range(steps):
            start = time.perf_counter()
            lr = learning_rate(step, steps, bp.training)
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.zero_grad(set_to_none=True)
            optimizer.zero_grad(set_to_none=True)
            micro = [next(stream) for _ in range(accumulation)]
            load: dict[str, torch.Tensor] = {}
            total, lm = _forward_backward(model, micro, mtp_scale, load)
            tokens_seen += sum(batch.num_tokens for batch in micro)
            masters.grads_to_masters()
            norm_cap = clip if clip is not None else math.inf
            grad_norm = nn.utils.clip_grad_norm_(masters.masters, norm_cap).item()
            finite = math.isfinite(total) and math.isfinite(grad_norm)
            switched = False
            if finite:
                optimizer.step()
                masters.masters_to_params()
                model.update_expert_biases(load)
                if compiled.precision is not None:
                    switched = compiled.precision.on_tokens(tokens_seen)
            record = StepRecord(
                step=step,
                loss=total,
                lm_loss=lm,
                lr=lr,
                grad_norm=grad_norm,
                seconds=time.perf_counter() - start,
                tokens_seen=tokens_seen,
                finite=finite,
                switched_to_bf16=switched,
            )
            result.records.append(record)
            status = f"loss {lm:.4f} lr {lr:.2e} |g| {grad_norm:.3f}"
            if bar is not None:
                bar.update(task, advance=1, status=status)
            if log_every and ((step + 1) % log_every == 0 or not finite or switched):
                line = f"{description} step {step + 1}/{steps}: {status} {record.seconds:.2f} s"
                _say(bar, line + (" (switched to BF16)" if switched else ""))
            if not finite:
                result.diverged = True
                if bar is not None or log_every:
                    _say(bar, f"{description}: non-finite loss or gradient at step {step}; stopped")
                break
    return result


def _say(bar: Any, line: str) -> None:
    """Print above the progress bar when there is one, else plainly (nohup logs)."""
    if bar is not None:
        bar.console.print(line)
    else:
        print(line, flush=True)
