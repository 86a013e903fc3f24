"""The training loss: next-token cross-entropy, the scaled MTP losses, and the MoE aux loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from factory.nn.outputs import ModelOutput
from factory.nn.packed_documents import same_document
from factory.schemas.model import ModelConfig, MTPConfig

__all__ = ["LossBreakdown", "language_model_loss", "mtp_loss_scale"]


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


def _shifted(
    logits: torch.Tensor,
    positions: torch.Tensor | None,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    document_ids: torch.Tensor | None,
    shift: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, labels, which count, how many count in the whole sequence) of the rows that
    predict the token ``shift`` ahead. Under context parallelism a rank's mean is taken over
    the whole sequence's targets, so the ranks' means add up to the sequence's."""
    kept = _kept(mask, document_ids, shift)
    if positions is None:
        return logits[:, :-shift], input_ids[:, shift:], kept, kept.sum()
    rows = (positions < input_ids.shape[1] - shift).nonzero().flatten()
    here = positions[rows]
    return logits[:, rows], input_ids[:, here + shift], kept[:, here], kept.sum()


def _shifted_ce(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    mask = mask.flatten().to(losses.dtype)
    return (losses * mask).sum() / count.clamp(min=1)


def language_model_loss(
    output: ModelOutput,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    mtp_loss_scale: float = 0.0,
    document_ids: torch.Tensor | None = None,
) -> LossBreakdown:
    """``lm + mtp_loss_scale * mean(mtp depths) + aux``.

    Position i of the main logits predicts token i+1; MTP depth k's position i
    predicts token i+k+1, so depth k drops its last k+1 positions. ``loss_mask``
    [B, S] marks the tokens that count as labels (1) or not (0), e.g. prompts. With
    ``document_ids`` (packed documents) no position predicts a token of another document.
    Under context parallelism (``output.positions``) the logits are this rank's rows of
    the whole sequence that ``input_ids`` holds, and the losses are over those rows.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    lm = _shifted_ce(*_shifted(output.logits, output.positions, input_ids, mask, document_ids, 1))
    mtp = []
    for depth, depth_logits in enumerate(output.mtp_logits, start=1):
        shift = depth + 1
        if input_ids.shape[1] > shift:
            pieces = _shifted(depth_logits, output.positions, input_ids, mask, document_ids, shift)
            mtp.append(_shifted_ce(*pieces))
    total = lm
    if mtp:
        total = total + mtp_loss_scale * torch.stack(mtp).mean()
    aux = output.aux_loss
    if aux is not None:
        total = total + aux
    return LossBreakdown(total=total, lm=lm, mtp=mtp, aux=aux)
