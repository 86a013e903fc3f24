"""What the model's forward pass returns: typed, with nothing riding on a tensor.

The training loop reads the losses from :class:`ModelOutput`, and the
stability monitors read the router statistics: tokens per expert for every
MoE layer, keyed by the layer's name in the graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DecodedStep", "ModelOutput", "RoutedOutput", "collect_routing"]


class RoutedOutput(NamedTuple):
    """A routing mixer's output, its load-balancing loss and how many (token, slot) pairs
    each expert received. A mixer that returns one also has ``update_expert_bias(load)``,
    which the optimizer step calls with the step's tokens per expert."""

    y: torch.Tensor
    aux_loss: torch.Tensor | None
    tokens_per_expert: torch.Tensor


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None
    """[B, S, V]: position i predicts token i+1. None when the model left the head to the
    fused loss (``head_inputs``)."""
    mtp_logits: tuple[torch.Tensor, ...]
    """One [B, S, V] tensor per MTP depth; depth k at position i predicts token i+k+1
    (empty when the head is left to the fused loss)."""
    aux_loss: torch.Tensor | None
    """Sum of the MoE layers' load-balancing losses (training mode only)."""
    tokens_per_expert: dict[str, torch.Tensor]
    """Per MoE layer (``backbone.layers.3``, ``mtp.layers.1``), the [experts] count of
    (token, slot) pairs routed to each expert in this pass; a repeated MTP block sums its
    depths."""
    hidden: torch.Tensor
    """The main stack's output before the final norm."""
    residual_rms: dict[str, torch.Tensor]
    """Per main-stack layer (``backbone.layers.3``), the RMS of the residual stream it
    outputs (a detached fp32 scalar): how the stream's scale grows with depth."""
    positions: torch.Tensor | None = None
    """Under context parallelism, the sequence position of each row of the outputs (this
    rank's chunks, ``factory.nn.sequence_split``); None: row i is position i."""
    head_inputs: tuple[torch.Tensor, ...] = ()
    """When the model leaves its head to the fused loss (``factory.graph.loss``): the head's
    [B, S, d] input, of the main head then of each MTP depth, instead of their logits."""
    head_weight: torch.Tensor | None = None
    """The [V, d] head weight that ``head_inputs`` are to be multiplied with."""

    @property
    def rows(self) -> torch.Size:
        """[B, S]: the positions this output predicts from (this rank's, under CP)."""
        head = self.logits if self.logits is not None else self.head_inputs[0]
        return head.shape[:2]


class DecodedStep(NamedTuple):
    """What one incremental decoding step of the main stack returns (``HybridLM.decode``)."""

    logits: torch.Tensor
    """[B, T, V]: the step's position t predicts the token after it."""
    hidden: torch.Tensor
    """[B, T, d]: the main stack's output before the final norm (what MTP depth 1 reads)."""


def collect_routing(
    routed: dict[str, torch.Tensor], aux: list[torch.Tensor], name: str, out: RoutedOutput | None
) -> None:
    """Add one block's routing statistics to the pass's totals."""
    if out is None:
        return
    previous = routed.get(name)
    routed[name] = out.tokens_per_expert if previous is None else previous + out.tokens_per_expert
    if out.aux_loss is not None:
        aux.append(out.aux_loss)
