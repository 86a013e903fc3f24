"""The held-out loss of a model: per category and overall, with the MTP losses.

One function, :func:`evaluate`, serves validation while training
(``factory.runtime.validation``) and ``factory eval`` (``factory.jobs.evaluate``). It
reads the first samples of each held-out set (a built folder,
``factory.data.shards.heldout``) in its manifest's order, up to ``tokens`` positions, so
every evaluation reads the same tokens, and runs the model forward as the training step
does (``model(input_ids, document_ids, logits=False)`` and
:func:`~factory.graph.loss.language_model_loss`), in eval mode and without gradients.

The loss is training's next-token cross-entropy over the loss-masked targets of each
packed document (no position predicts another document's token), averaged per token over
all the set's targets: each micro-batch's mean times its target count, summed, over the
summed counts. MTP depth ``k`` is averaged likewise over its own targets (the token
``k + 1`` ahead). The overall numbers weigh every set's targets alike.

On several processes the set's micro-batches are dealt out to the data-parallel replicas
in turn (micro-batch ``j`` to replica ``j % dp``), the same micro-batches as on one
process, and the sums and counts are summed over the ranks holding distinct tokens
(``Ranks.sum_over_tokens``: the replicas and the context-parallel ranks), so one and
several processes give the same number up to the order of a sum. Every rank runs the
same number of forward passes (a sharded model's forward is a collective): a replica
with no micro-batch left runs the first one with no target counted.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from factory.compilation import Compiled
from factory.data.shards.shard_reader import Sample, list_shards, read_shard_samples
from factory.graph.loss import language_model_loss, target_weights
from factory.runtime.batches import MicroBatch, collate
from factory.runtime.ranks import Ranks, SingleProcess

__all__ = ["Evaluation", "HeldoutLoss", "evaluate", "heldout_micro_batches", "training_kept"]


@dataclass(frozen=True)
class HeldoutLoss:
    """One held-out set's numbers (or all sets together)."""

    loss: float
    """Mean next-token cross-entropy over the loss-masked targets (nats)."""
    tokens: int
    """The targets averaged over."""
    mtp_losses: tuple[float, ...] = ()
    """MTP depth 1, 2, ...: each depth's mean cross-entropy over its own targets."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


@dataclass(frozen=True)
class Evaluation:
    """:func:`evaluate`'s result: each set's numbers by category, and all sets together."""

    sets: dict[str, HeldoutLoss]
    overall: HeldoutLoss


def heldout_micro_batches(folder: Path, tokens: int, micro_batch_size: int) -> list[MicroBatch]:
    """The first samples of the built folder ``folder``, in its manifest's order, covering
    ``tokens`` positions (whole samples; the folder whole if it holds fewer), as
    micro-batches of ``micro_batch_size`` samples, the last one filled up with copies of
    the first sample whose loss mask counts nothing. Only the shards these samples live in
    are read."""
    if tokens < 1 or micro_batch_size < 1:
        raise ValueError("tokens and micro_batch_size must be at least 1")
    samples = []
    for shard in list_shards(Path(folder)):
        decoded = read_shard_samples(shard)
        for sample in decoded:
            samples.append(sample)
            if len(samples) * len(sample.tokens) >= tokens:
                break
        else:
            continue
        break
    # The last micro-batch is filled up with a sample that counts no target, so every
    # forward pass has the training's shape: a new shape would make torch.compile's kernels
    # (FlexAttention's, compiled blocks) recompile for dynamic shapes, and the training's
    # next steps would then run those, rounding differently.
    short = -len(samples) % micro_batch_size
    filler = Sample(samples[0].tokens, np.zeros_like(samples[0].loss_mask), samples[0].cu_seqlens)
    samples.extend([filler] * short)
    return [
        collate(samples[start : start + micro_batch_size])
        for start in range(0, len(samples), micro_batch_size)
    ]


def _batch_sums(model: nn.Module, batch: MicroBatch, depths: int, context: int) -> torch.Tensor:
    """[2 * (1 + depths)] float64: (summed cross-entropy, targets) of the main head, then of
    each MTP depth, over this rank's rows of ``batch``; ``context`` ranks share each
    sequence (context parallelism), each counting its share of the targets."""
    output = model(batch.input_ids, batch.document_ids, logits=False)
    losses = language_model_loss(
        output, batch.input_ids, batch.loss_mask, document_ids=batch.document_ids
    )
    mask = batch.loss_mask.bool()
    sums = torch.zeros(2 * (1 + depths), dtype=torch.float64, device=batch.input_ids.device)
    for depth, loss in enumerate([losses.lm, *losses.mtp]):
        # The loss is a mean over the whole sequence's targets (also a context-parallel
        # rank's share of them): times their count it is the rows' summed cross-entropy.
        count = target_weights(mask, batch.document_ids, depth + 1)[1]
        sums[2 * depth] = loss.double() * count
        sums[2 * depth + 1] = count / context  # the ranks' shares add up to the count
    return sums


def _loss_of(sums: torch.Tensor) -> HeldoutLoss:
    values = sums.tolist()
    pairs = range(0, len(values), 2)
    means = [values[i] / values[i + 1] if values[i + 1] else math.nan for i in pairs]
    return HeldoutLoss(means[0], int(values[1]), tuple(means[1:]))


def _to(batch: MicroBatch, device: torch.device) -> MicroBatch:
    docs = batch.document_ids
    return MicroBatch(
        batch.input_ids.to(device),
        batch.loss_mask.to(device),
        None if docs is None else docs.to(device),
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    sets: Mapping[str, Path],
    tokens: int,
    micro_batch_size: int,
    mtp_depth: int = 0,
    ranks: Ranks | None = None,
) -> Evaluation:
    """The held-out loss of ``model`` (a compiled graph, laid out or not) on each built
    folder of ``sets`` (category to folder), reading ``tokens`` positions of each, and of
    all of them together; the same on every rank. ``mtp_depth`` is the model's
    (``model.mtp_depth``). The model is left in the mode it was in."""
    if not hasattr(model, "forward") or type(model).forward is nn.Module.forward:
        raise ValueError(
            "evaluation runs the model's forward pass; a pipeline-parallel model runs its "
            "stages through a schedule, which evaluation does not drive yet"
        )
    ranks = ranks or SingleProcess()
    device = ranks.device
    per_set: dict[str, torch.Tensor] = {}
    with _mode(model, training=False):
        for category, folder in sets.items():
            batches = heldout_micro_batches(folder, tokens, micro_batch_size)
            rounds = -(-len(batches) // ranks.data_size)
            sums = torch.zeros(2 * (1 + mtp_depth), dtype=torch.float64, device=device)
            for turn in range(rounds):
                index = turn * ranks.data_size + ranks.data_rank
                batch = _to(batches[index if index < len(batches) else 0], device)
                found = _batch_sums(model, batch, mtp_depth, ranks.context_size)
                if index < len(batches):  # else a stand-in that keeps the ranks in step
                    sums += found
            per_set[category] = ranks.sum_over_tokens(sums).cpu()
    total = sum(per_set.values(), torch.zeros(2 * (1 + mtp_depth), dtype=torch.float64))
    return Evaluation({c: _loss_of(s) for c, s in per_set.items()}, _loss_of(total))


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module in ``training`` mode inside, back to its own mode after."""
    modes = [(module, module.training) for _, module in model.named_modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def training_kept(compiled: Compiled) -> Iterator[None]:
    """Whatever runs inside leaves training as it found it: torch's CPU and CUDA generators,
    the precision runtime's state (stochastic-rounding generators, amax histories,
    counters) and every module's mode are put back, so an evaluation between two steps
    changes no bit of the run."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    precision = compiled.precision
    state = copy.deepcopy(precision.state_dict()) if precision is not None else None
    with _mode(compiled.model, compiled.model.training):
        try:
            yield
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            if precision is not None and state is not None:
                precision.load_state_dict(state)
