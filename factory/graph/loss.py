"""The training loss: next-token cross-entropy, the scaled MTP losses, and the MoE aux loss.

Each target carries a weight (``target_weights``) and each loss is the weighted sum over
the sum of the weights: 1 per target for the token average, 1 / (the targets of its
document) for the per-conversation average of ``training.objective.loss_average``.

The head and the cross-entropy are fused when the model leaves its head to the loss
(``ModelOutput.head_inputs``, what the training step asks for): each head's loss is
computed ``chunk_tokens_for(vocab)`` rows at a time (``factory.kernels.linear_cross_entropy``)
and the [tokens, vocab] logits never exist. The unfused path stays for models that return
logits: a vocab-parallel head (tensor parallelism gathers its logits over the ranks) and a
pipeline's last stage (the schedule's loss reads its output). The head is never quantized
(``factory.precision.policy.excluded_gemm_names``), so the fused GEMM is the head's own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from factory.kernels.choice import KernelChoice
from factory.kernels.linear_cross_entropy import chunk_tokens_for, linear_cross_entropy
from factory.nn.outputs import ModelOutput
from factory.nn.packed_documents import same_document
from factory.schemas.model import ModelConfig, MTPConfig
from factory.schemas.training import LossAverage

__all__ = [
    "LossBreakdown",
    "fused_head_problem",
    "language_model_loss",
    "loss_kernel",
    "micro_batch_share",
    "mtp_loss_scale",
    "target_weights",
]


LOSS_OP = "lm loss"
_VOCAB_SPLIT = "the head is vocab-parallel (tensor parallelism): its logits are gathered"
_PIPELINED = "pipeline parallelism: the schedule's loss reads the last stage's logits"


def _fused_problem(vocab_split: bool, pipelined: bool) -> str | None:
    """Why the fused head and loss cannot run (None: they can): the one test that both the
    model's head (``fused_head_problem``) and the kernel report (``loss_kernel``) ask."""
    if vocab_split:
        return _VOCAB_SPLIT
    return _PIPELINED if pipelined else None


def fused_head_problem(weight: torch.Tensor) -> str | None:
    """Why a head with ``weight`` must return logits instead of leaving itself to the fused
    loss; None when it need not. Tensor parallelism makes the head weight a DTensor (looked
    up only when loaded: importing ``torch.distributed.tensor`` imports sympy, which
    building a model must not)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    vocab_split = dtensor is not None and isinstance(weight, dtensor.DTensor)
    return _fused_problem(vocab_split, pipelined=False)


def loss_kernel(
    model: ModelConfig, device: str, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> KernelChoice:
    """How the LM loss of ``model`` is computed on ``device`` (the same PyTorch code on
    every device) under a layout with ``tensor_parallel`` and ``pipeline_parallel`` ranks."""
    problem = _fused_problem(tensor_parallel > 1, pipeline_parallel > 1)
    if problem is not None:
        return KernelChoice(LOSS_OP, "unfused linear + cross-entropy (fp32 logits)", problem)
    chunk = chunk_tokens_for(model.vocab_size)
    return KernelChoice(LOSS_OP, f"fused chunked linear + cross-entropy ({chunk}-token chunks)")


def mtp_loss_scale(cfg: ModelConfig) -> float:
    """The weight of the MTP depths' mean loss in the total (0 without MTP)."""
    return (cfg.mtp or MTPConfig()).loss_scale if cfg.mtp_depth else 0.0


@dataclass
class LossBreakdown:
    total: torch.Tensor
    lm: torch.Tensor
    mtp: list[torch.Tensor]
    aux: torch.Tensor | None


def _kept(mask: torch.Tensor, document_ids: torch.Tensor | None, shift: int) -> torch.Tensor:
    """[B, S - shift]: position i's target, the token ``shift`` ahead, counts."""
    kept = mask[:, shift:]
    return kept if document_ids is None else kept & same_document(document_ids, shift)


def _conversation_weights(
    kept: torch.Tensor, document_ids: torch.Tensor | None, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, S - shift] 1 / (kept targets of its document) at each kept target, else 0;
    how many documents have kept targets). Without ``document_ids`` a row is one document."""
    rows, width = kept.shape
    if kept.numel() == 0:
        return kept.to(torch.float32), kept.sum()
    if document_ids is None:
        documents = torch.zeros_like(kept, dtype=torch.int64)
    else:
        documents = document_ids[:, shift:].to(torch.int64)  # a kept target's own document
    row_index = torch.arange(rows, device=kept.device).unsqueeze(1)
    first, span = documents.min(), documents.max() - documents.min() + 1
    key = (row_index * span + documents - first).flatten()
    counts = torch.zeros(rows * int(span), dtype=torch.int64, device=kept.device)
    counts.scatter_add_(0, key, kept.flatten().to(torch.int64))
    per_target = counts[key].view(rows, width).clamp(min=1)
    weights = kept.to(torch.float32) / per_target.to(torch.float32)
    return weights, (counts > 0).sum()


def target_weights(
    mask: torch.Tensor,
    document_ids: torch.Tensor | None,
    shift: int,
    average: LossAverage = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, S - shift] weight of each target ``shift`` ahead, their denominator).

    ``token``: weight 1 per kept target (the bool mask itself), denominator the kept
    targets. ``conversation``: 1 / (kept targets of the target's document), denominator the
    documents with kept targets, so the weighted mean is the mean of per-document means.
    """
    kept = _kept(mask, document_ids, shift)
    if average == "token":
        return kept, kept.sum()
    return _conversation_weights(kept, document_ids, shift)


def micro_batch_share(
    loss_mask: torch.Tensor, document_ids: torch.Tensor | None, average: LossAverage = "token"
) -> int:
    """What one micro-batch adds to its step's loss denominator: the main head's
    denominator, its kept targets (``token``) or its documents with kept targets
    (``conversation``). A step weights each micro-batch's loss by its share over the step's
    sum (``factory.runtime.step``). A target across a document boundary is not kept, so it
    has no share (a packed document's first token, marked in its own mask, is one)."""
    return int(target_weights(loss_mask.bool(), document_ids, 1, average)[1])


def _shifted(
    head_rows: torch.Tensor,
    positions: torch.Tensor | None,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    document_ids: torch.Tensor | None,
    shift: int,
    average: LossAverage,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows of ``head_rows``, labels, the weight of each, the whole sequence's denominator)
    of the rows that predict the token ``shift`` ahead; ``head_rows`` [B, S, ...] are the
    logits, or the head's inputs for the fused loss. Under context parallelism a rank's
    mean is taken over the whole sequence's denominator (the weights are the whole
    sequence's too), so the ranks' means add up to the sequence's."""
    weights, denominator = target_weights(mask, document_ids, shift, average)
    if positions is None:
        return head_rows[:, :-shift], input_ids[:, shift:], weights, denominator
    rows = (positions < input_ids.shape[1] - shift).nonzero().flatten()
    here = positions[rows]
    return head_rows[:, rows], input_ids[:, here + shift], weights[:, here], denominator


def _weighted_mean(
    losses: torch.Tensor, weights: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    return (losses * weights.flatten().to(losses.dtype)).sum() / count.clamp(min=1)


def _shifted_ce(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    return _weighted_mean(losses, weights, count)


_HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _head_losses(
    output: ModelOutput, chunk_tokens: int | None
) -> list[tuple[torch.Tensor, _HeadLoss]]:
    """Per head (the main one, then each MTP depth): a function of (rows, labels, weights,
    denominator) giving its loss: the unfused cross-entropy of its logits, or the fused
    head and loss of its inputs."""
    if output.logits is not None:
        return [(logits, _shifted_ce) for logits in (output.logits, *output.mtp_logits)]
    weight = output.head_weight
    if weight is None:
        raise ValueError("a ModelOutput without logits must carry head_inputs and head_weight")
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])

    def fused(
        hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        losses = linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), chunk)
        return _weighted_mean(losses, weights, count)

    return [(hidden, fused) for hidden in output.head_inputs]


def language_model_loss(
    output: ModelOutput,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    mtp_loss_scale: float = 0.0,
    document_ids: torch.Tensor | None = None,
    loss_average: LossAverage = "token",
    chunk_tokens: int | None = None,
) -> LossBreakdown:
    """``lm + mtp_loss_scale * mean(mtp depths) + aux``.

    Position i of the main logits predicts token i+1; MTP depth k's position i
    predicts token i+k+1, so depth k drops its last k+1 positions. ``loss_mask``
    [B, S] marks the tokens that count as labels (1) or not (0), e.g. prompts. With
    ``document_ids`` (packed documents) no position predicts a token of another document.
    ``loss_average`` (``training.objective.loss_average``): ``token``, each loss is the mean
    over its targets; ``conversation``, the mean over documents of each document's mean
    (a row is one document without ``document_ids``); every MTP depth over its own targets.
    Under context parallelism (``output.positions``) the logits are this rank's rows of
    the whole sequence that ``input_ids`` holds, and the losses are over those rows.
    A model that left its head to the loss (``output.head_inputs``) gets the fused head and
    cross-entropy, ``chunk_tokens`` rows of logits at a time (None: ``chunk_tokens_for``).
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    (main, main_loss), *depths = _head_losses(output, chunk_tokens)
    lm = main_loss(
        *_shifted(main, output.positions, input_ids, mask, document_ids, 1, loss_average)
    )
    mtp = []
    for depth, (rows, depth_loss) in enumerate(depths, start=1):
        shift = depth + 1
        if input_ids.shape[1] > shift:
            pieces = _shifted(
                rows, output.positions, input_ids, mask, document_ids, shift, loss_average
            )
            mtp.append(depth_loss(*pieces))
    total = lm
    if mtp:
        total = total + mtp_loss_scale * torch.stack(mtp).mean()
    aux = output.aux_loss
    if aux is not None:
        total = total + aux
    return LossBreakdown(total=total, lm=lm, mtp=mtp, aux=aux)
