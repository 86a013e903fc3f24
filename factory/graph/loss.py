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


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    mask = mask.flatten().to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1)


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
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()

    def targets(shift: int) -> torch.Tensor:
        kept = mask[:, shift:]
        return kept if document_ids is None else kept & same_document(document_ids, shift)

    lm = _shifted_ce(output.logits[:, :-1], input_ids[:, 1:], targets(1))
    mtp = []
    for depth, depth_logits in enumerate(output.mtp_logits, start=1):
        shift = depth + 1
        if input_ids.shape[1] > shift:
            mtp.append(_shifted_ce(depth_logits[:, :-shift], input_ids[:, shift:], targets(shift)))
    total = lm
    if mtp:
        total = total + mtp_loss_scale * torch.stack(mtp).mean()
    aux = output.aux_loss
    if aux is not None:
        total = total + aux
    return LossBreakdown(total=total, lm=lm, mtp=mtp, aux=aux)
