"""Cut a :class:`~factory.graph.hybrid_lm.HybridLM` into the pipeline stages of a layout.

Segment ``v * pp + r`` of the stack (the blueprint's ``|`` cuts, see
``factory.planner.layout``) is virtual stage ``v`` of pipeline rank ``r``. A
stage module keeps only its own blocks, plus the embedding on the first stage
and the final norm, head and MTP blocks on the last, under the full model's
names: the blocks sit in a ``ModuleDict`` keyed by their stack index, so block
5 is ``backbone.layers.5...`` on whichever rank runs it. Checkpoints (DCP) and
the optimizer's name-keyed state therefore move between layouts unchanged.

The one tensor two ranks hold is the embedding matrix when the last stage also
needs it (MTP embeds the shifted tokens; a tied head is the embedding): the
last stage keeps a copy under the same name, the
:class:`~factory.runtime.pipeline_schedule.PipelineRunner` sums the two copies'
gradients after every step (Megatron's embedding group), so they stay equal.

A stage's MoE aux loss cannot reach the loss function on the last rank, so
its gradient rides on the stage's output activation
(:class:`AttachAuxLoss`, Megatron's ``MoEAuxLossAutoScaler``); its value and
the routing and residual statistics are recorded on the stage for the step's
:class:`~factory.runtime.step.StepOutcome`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from factory.graph.blocks import Block
from factory.graph.hybrid_lm import HybridLM
from factory.nn.outputs import collect_routing
from factory.planner.layout import Layout

__all__ = [
    "AttachAuxLoss",
    "PipelineStageModule",
    "StageForward",
    "segment_bounds",
    "split_stages",
    "stage_named_parameters",
]


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; the backward pass gives ``aux`` the constant gradient ``scale``.

    The aux loss enters the step's loss as ``aux / micro_batches`` (``factory.runtime.step``),
    so its gradient is that constant whatever flows back into ``x``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_like = aux.detach()
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full_like(ctx.aux_like, ctx.scale), None


class StageForward(NamedTuple):
    """What one forward pass of a stage measured (all detached)."""

    tokens_per_expert: dict[str, torch.Tensor]
    aux_loss: torch.Tensor | None
    residual_rms: dict[str, torch.Tensor]


class _StageBackbone(nn.Module):
    """``backbone.*`` of one stage: its blocks keyed by stack index; embedding / final norm
    only where the stage runs them (None elsewhere, so they hold no state)."""

    def __init__(
        self, embeddings: nn.Module | None, layers: dict[int, Block], norm_f: nn.Module | None
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleDict({str(i): block for i, block in sorted(layers.items())})
        self.norm_f = norm_f


class PipelineStageModule(nn.Module):
    """One virtual stage: ``forward(x, input_ids, document_ids)``.

    ``x`` is the token ids on the first stage and the previous stage's hidden state
    elsewhere; ``input_ids`` and ``document_ids`` reach every stage as keyword arguments
    (document masking in every mixer, the shifted tokens of MTP). A middle stage returns
    the hidden state [B, S, d]; the last returns ``(logits, *mtp_logits)``.
    """

    def __init__(
        self,
        model: HybridLM,
        stage_index: int,
        num_stages: int,
        layers: dict[int, Block],
    ) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.cfg = model.cfg
        self.hidden_dtype = model.backbone.embeddings.weight.dtype
        """The dtype of the activations sent between stages (the model's compute dtype)."""
        needs_embedding = self.is_first or (self.is_last and model.mtp is not None)
        self.backbone = _StageBackbone(
            model.backbone.embeddings if needs_embedding else None,
            layers,
            model.backbone.norm_f if self.is_last else None,
        )
        self.lm_head = model.lm_head if self.is_last else None
        self.mtp = model.mtp if self.is_last else None
        self.aux_scale = 1.0
        """Gradient of this stage's aux loss in the step's loss: 1 / micro-batches."""
        self.records: list[StageForward] = []

    @property
    def shared_embedding(self) -> nn.Parameter | None:
        """The embedding matrix this stage uses, if it is the first stage or a last stage
        that needs it (MTP, tied head): the parameter whose gradient the two ranks sum."""
        if self.is_first or (self.is_last and self.backbone.embeddings is not None):
            return self.backbone.embeddings.weight
        if self.is_last and self.cfg.tie_embeddings:
            return self.lm_head.weight
        return None

    def example_io(
        self, batch: int, seq: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Example input and outputs on the meta device (no memory), which ``PipelineStage``
        takes instead of running a forward pass to learn them; ``dtype`` is the activations'."""
        d, vocab = self.cfg.hidden_size, self.cfg.vocab_size
        hidden = torch.empty(batch, seq, d, dtype=dtype, device="meta", requires_grad=True)
        ids = torch.empty(batch, seq, dtype=torch.int64, device="meta")
        inputs = ids if self.is_first else hidden
        if not self.is_last:
            return inputs, (hidden,)
        logits = torch.empty(batch, seq, vocab, dtype=dtype, device="meta", requires_grad=True)
        return inputs, (logits,) * (1 + self.cfg.mtp_depth)

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        hidden = self.backbone.embeddings(x) if self.is_first else x
        routed: dict[str, torch.Tensor] = {}
        aux: list[torch.Tensor] = []
        rms: dict[str, torch.Tensor] = {}
        for layer in self.backbone.layers.values():
            hidden, out = layer(hidden, document_ids)
            collect_routing(routed, aux, layer.path, out)
            rms[layer.path] = hidden.detach().float().square().mean().sqrt()
        if not self.is_last:
            return self._finish(hidden, routed, aux, rms)
        logits = self.lm_head(self.backbone.norm_f(hidden))
        mtp_logits: tuple[torch.Tensor, ...] = ()
        if self.mtp is not None:
            if input_ids is None:
                raise ValueError("the last stage runs MTP and needs input_ids")
            # Fresh, empty containers: FSDP2's pre-forward rebuilds every argument container
            # holding tensors that require grad, so appends to ``aux`` itself would be lost.
            mtp_routed: dict[str, torch.Tensor] = {}
            mtp_aux: list[torch.Tensor] = []
            mtp_logits = self.mtp(
                hidden,
                input_ids,
                self.backbone.embeddings,
                self.lm_head,
                mtp_routed,
                mtp_aux,
                document_ids,
            )
            routed.update(mtp_routed)
            aux.extend(mtp_aux)
        return (self._finish(logits, routed, aux, rms), *mtp_logits)

    def _finish(
        self,
        out: torch.Tensor,
        routed: dict[str, torch.Tensor],
        aux: list[torch.Tensor],
        rms: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        total = torch.stack(aux).sum() if aux else None
        detached = {name: tokens.detach() for name, tokens in routed.items()}
        self.records.append(StageForward(detached, None if total is None else total.detach(), rms))
        if total is None or not torch.is_grad_enabled():
            return out
        return AttachAuxLoss.apply(out, total, self.aux_scale)


def segment_bounds(layout: Layout, num_layers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` in the main stack of every global stage ``v * pp + r``."""
    bounds, start = [], 0
    for stage in range(layout.pp * layout.vpp):
        virtual, rank = divmod(stage, layout.pp)
        length = len(layout.stage_patterns[rank][virtual])
        bounds.append((start, start + length))
        start += length
    if start != num_layers:
        raise ValueError(
            f"the layout's {layout.pp * layout.vpp} pipeline stages hold {start} layers but the "
            f"model has {num_layers}: the pattern's '|' segments must be a multiple of pp "
            "(run `factory validate`)"
        )
    return bounds


def split_stages(model: HybridLM, layout: Layout, pp_rank: int) -> list[PipelineStageModule]:
    """The stage modules pipeline rank ``pp_rank`` runs, one per virtual stage, in order.

    ``model`` is consumed: its modules move into the stages (no copy) and it is left
    empty, so the layers of other ranks are freed as soon as nothing else holds them.
    """
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} is outside the layout's {layout.pp} pipeline ranks")
    blocks = list(model.backbone.layers)
    bounds = segment_bounds(layout, len(blocks))
    num_stages = layout.pp * layout.vpp
    stages = []
    for virtual in range(layout.vpp):
        index = virtual * layout.pp + pp_rank
        start, stop = bounds[index]
        pattern = "".join(block.symbol for block in blocks[start:stop])
        expected = layout.stage_patterns[pp_rank][virtual]
        if pattern != expected:
            raise ValueError(
                f"stage {index} should run {expected!r} but the model's layers "
                f"{start}..{stop - 1} are {pattern!r}: the layout is not this model's"
            )
        layers = {i: blocks[i] for i in range(start, stop)}
        stages.append(PipelineStageModule(model, index, num_stages, layers))
    # Empty the model: what no stage of this rank references is freed with it.
    model.backbone = None
    model.lm_head = None
    model.mtp = None
    return stages


def stage_named_parameters(stages: list[nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's parameters by full-model name, each once (with pp == 1 the first and last
    stage are one rank's and share the embedding)."""
    named: dict[str, nn.Parameter] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            named.setdefault(name, param)
    return named
