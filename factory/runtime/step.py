"""One optimizer step's forward and backward passes over its micro-batches, and their statistics.

The token losses (LM and MTP) are averaged over the step's loss tokens, not per
micro-batch (Megatron's per-token loss): each micro-batch's mean is weighted
by its share of the step's target tokens, so a micro-batch that is all prompt
or padding neither counts as a zero loss nor dilutes the others. The MoE aux
loss, a per-batch statistic, is averaged over micro-batches. Packed documents
stay apart whenever a micro-batch carries their ``document_ids``.

With ``loss_average="conversation"`` (``training.objective``) the same holds with
documents for tokens: each target weighs 1 / (the targets of its document), a
micro-batch's share is its documents with targets, so the step's loss is the mean
over the step's documents of each document's mean (``factory.graph.loss``).

With data parallelism each rank runs its own share of the step's micro-batches
and the weights above are shares of the *global* step: every rank divides by
the target tokens of all replicas and by the micro-batches of all replicas, so
the gradients summed over the replicas (``factory.distributed.data_parallel``)
are those of the whole step on one process. Under context parallelism the ranks
of a replica read the same micro-batches and each computes its chunks of every
sequence: its token losses are divided by the whole sequence's target count
(``factory.graph.loss``), so summed over those ranks they are the sequence's, and
its aux loss (over its share of the tokens) enters divided by the CP size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from factory.graph.loss import language_model_loss, micro_batch_share
from factory.runtime.batches import MicroBatch
from factory.runtime.ranks import Ranks, SingleProcess
from factory.schemas.training import LossAverage

__all__ = ["StepOutcome", "forward_backward", "max_violation"]


def max_violation(tokens_per_expert: list[float]) -> float:
    """MaxVio of one MoE layer: max over experts of load / mean load - 1 (0 when balanced)."""
    return float(_max_violation(torch.tensor(tokens_per_expert, dtype=torch.float64)))


@dataclass
class StepOutcome:
    """What the micro-batches of one step produced (gradients are left on the parameters)."""

    loss: float = 0.0
    """The optimised loss: LM + scaled MTP + MoE aux."""
    lm_loss: float = 0.0
    tokens: int = 0
    tokens_per_expert: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per MoE layer, summed over the micro-batches: what the expert-bias update and MaxVio
    read."""
    residual_rms: dict[str, float] = field(default_factory=dict)
    """Per main-stack layer, averaged over the micro-batches."""

    def max_vio(self) -> dict[str, float]:
        """MaxVio of every MoE layer, computed on the loads' device and read to the host in
        one transfer, after the step's backward: nothing in the forward reads them."""
        if not self.tokens_per_expert:
            return {}
        loads = list(self.tokens_per_expert.values())
        device = loads[0].device
        values = torch.stack([_max_violation(load.to(device)) for load in loads]).tolist()
        return dict(zip(self.tokens_per_expert, values, strict=True))


def _max_violation(load: torch.Tensor) -> torch.Tensor:
    """:func:`max_violation` of one layer's [E] load, as a scalar on its device (fp64), so a
    step reads every layer's in one transfer."""
    load = load.double()
    mean = load.mean()
    return torch.where(mean > 0, load.max() / mean.clamp_min(1e-300) - 1, 0.0)


def forward_backward(
    model: nn.Module,
    micro: list[MicroBatch],
    mtp_scale: float,
    ranks: Ranks | None = None,
    loss_average: LossAverage = "token",
) -> StepOutcome:
    """Accumulate one step's gradients over ``micro`` (this rank's share of the step); return
    the step's statistics, global over the ranks. ``loss_average`` is
    ``training.objective.loss_average``."""
    ranks = ranks or SingleProcess()
    pipelined = getattr(model, "forward_backward", None)
    if pipelined is not None:  # a pipeline stage's model runs the step through its schedule
        return pipelined(micro, mtp_scale, ranks, loss_average)
    counts = [
        micro_batch_share(batch.loss_mask, batch.document_ids, loss_average) for batch in micro
    ]
    step_targets = int(ranks.sum_over_data(torch.tensor(sum(counts))).item())
    # A context-parallel rank's aux loss is over its share of the tokens: the ranks' mean.
    aux_share = 1.0 / (len(micro) * ranks.data_size * ranks.context_size)
    outcome = StepOutcome()
    rms: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64)
    lm_sum = torch.zeros((), dtype=torch.float64)
    for batch, count in zip(micro, counts, strict=True):
        weight = count / max(1, step_targets)
        output = model(batch.input_ids, batch.document_ids, logits=False)  # the fused loss
        for name, tokens in output.tokens_per_expert.items():
            previous = outcome.tokens_per_expert.get(name)
            outcome.tokens_per_expert[name] = tokens if previous is None else previous + tokens
        for name, value in output.residual_rms.items():
            rms[name] = rms[name] + value if name in rms else value
        losses = language_model_loss(
            output,
            batch.input_ids,
            batch.loss_mask,
            mtp_loss_scale=mtp_scale,
            document_ids=batch.document_ids,
            loss_average=loss_average,
        )
        aux = losses.aux if losses.aux is not None else losses.total.new_zeros(())
        loss = weight * (losses.total - aux) + aux * aux_share
        loss.backward()
        loss_sum += loss.item()
        lm_sum += weight * losses.lm.item()
        outcome.tokens += output.rows.numel()  # this rank's positions
    totals = ranks.sum_over_tokens(
        torch.stack([loss_sum, lm_sum, torch.tensor(outcome.tokens).double()])
    )
    outcome.loss, outcome.lm_loss, tokens = totals.tolist()
    outcome.tokens = int(tokens)
    outcome.tokens_per_expert = ranks.sum_over_routing(outcome.tokens_per_expert)
    outcome.residual_rms = ranks.mean_over_tokens(
        {name: float(total) / len(micro) for name, total in rms.items()}
    )
    return outcome
