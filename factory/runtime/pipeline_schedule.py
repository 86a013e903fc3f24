"""Pipeline parallelism on ``torch.distributed.pipelining``, cut at the blueprint's ``|``.

:func:`~factory.distributed.pipeline_stages.split_stages` gives each pipeline
rank its stage modules; :class:`PipelineRunner` wraps them in
``PipelineStage``s and runs one optimizer step's micro-batches through
``Schedule1F1B`` (one stage per rank) or ``ScheduleInterleaved1F1B`` (``vpp``
virtual stages per rank, Megatron's round-robin placement).

The loss is exactly the single-process step's (``factory.runtime.step``): each
micro-batch's token loss is weighted by its share of the step's target tokens
(or documents, for the per-conversation average) on the last stage, and every stage's MoE aux loss enters as ``aux / micro``
through its activation. After :meth:`PipelineRunner.step` the gradients on a
rank's parameters are what :func:`~factory.runtime.step.forward_backward`
leaves on the same parameters of the whole model.

Every rank of a pipeline needs the step's micro-batches (the same ones): the
first stage embeds the tokens, every stage masks documents, the last stage
runs MTP and the loss. Stage shapes are static (known from the micro-batch
shape), so ``torch.distributed.pipelining`` runs no extra forward pass to
infer them; a new micro-batch shape builds a new schedule.

The trainer, the optimizer and the checkpointer ask a model for its named
parameters, its ``state_dict`` (DCP fills it in place), ``train()``, and the
expert-bias step. :class:`PipelinedModel` answers for the stages this rank runs,
under the full model's names, and runs a step through the schedule instead of
a forward call. The stages are not registered as submodules: their parameter
names would get a prefix, and checkpoints would no longer be those of the
whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule

from factory.distributed.pipeline_stages import PipelineStageModule, stage_named_parameters
from factory.graph.loss import language_model_loss, micro_batch_share
from factory.nn.outputs import ModelOutput
from factory.planner.layout import Layout
from factory.runtime.batches import MicroBatch
from factory.runtime.ranks import Ranks
from factory.runtime.step import StepOutcome
from factory.schemas.model import ModelConfig
from factory.schemas.training import LossAverage

__all__ = ["PipelineRunner", "PipelinedModel", "check_microbatch_count"]


def check_microbatch_count(layout: Layout, count: int) -> None:
    """Refuse a micro-batch count the layout's schedule cannot run."""
    if count < layout.pp:
        raise ValueError(
            f"{count} micro-batches cannot fill a {layout.pp}-stage pipeline: 1F1B needs at "
            f"least pp = {layout.pp} (raise global_batch_size or lower micro_batch_size)"
        )
    if layout.vpp > 1 and count % layout.pp:
        raise ValueError(
            f"interleaved 1F1B (vpp = {layout.vpp}) needs the micro-batch count to be a "
            f"multiple of pp = {layout.pp}, got {count}"
        )


def _concat(micro: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's token and document ids stacked on dim 0, which the schedule splits back."""
    shapes = {tuple(batch.input_ids.shape) for batch in micro}
    if len(shapes) != 1:
        raise ValueError(f"the micro-batches of one pipelined step differ in shape: {shapes}")
    with_docs = {batch.document_ids is not None for batch in micro}
    if len(with_docs) != 1:
        raise ValueError("some micro-batches carry document_ids and others do not")
    ids = torch.cat([batch.input_ids for batch in micro])
    if not with_docs.pop():
        return ids, None
    return ids, torch.cat([batch.document_ids for batch in micro])


class PipelineRunner:
    """Runs one optimizer step's micro-batches through this rank's pipeline stages.

    ``stages`` are this rank's :func:`split_stages` modules, in virtual-stage order,
    possibly wrapped in place by FSDP (``fully_shard``); ``pp_mesh`` is the 1-D pipeline
    sub-mesh (``meshes.dense["pp"]``). Every rank of the pipeline calls :meth:`step`
    with the same micro-batches. ``activation_dtype`` is what the stages compute in and
    send each other: the parameters' dtype unless FSDP casts them (its mixed-precision
    ``param_dtype``, e.g. bf16 on CUDA).
    """

    def __init__(
        self,
        stages: list[PipelineStageModule],
        layout: Layout,
        pp_mesh: DeviceMesh,
        mtp_scale: float,
        device: torch.device | str = "cpu",
        activation_dtype: torch.dtype | None = None,
    ) -> None:
        if layout.pp < 2:
            raise ValueError("a pipeline needs pp >= 2; with pp = 1 use forward_backward")
        if pp_mesh.ndim != 1 or pp_mesh.size() != layout.pp:
            raise ValueError(f"pp_mesh must be the 1-D pipeline mesh of {layout.pp} ranks")
        if len(stages) != layout.vpp:
            raise ValueError(f"{len(stages)} stage modules for vpp = {layout.vpp}")
        check_microbatch_count(layout, layout.num_microbatches)
        self.layout = layout
        self.stages = stages
        self.group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.mtp_scale = mtp_scale
        self.device = torch.device(device)
        self.activation_dtype = activation_dtype or stages[0].hidden_dtype
        expected = [v * layout.pp + self.pp_rank for v in range(layout.vpp)]
        if [stage.stage_index for stage in stages] != expected:
            raise ValueError(f"pipeline rank {self.pp_rank} runs stages {expected}")
        cfg = stages[0].cfg
        # The last stage holds a copy of the embedding when MTP or a tied head needs it.
        self._embedding_shared = cfg.mtp_depth > 0 or cfg.tie_embeddings
        self._schedules: dict[tuple[int, int, int], _PipelineSchedule] = {}
        self._micro: list[MicroBatch] = []
        self._loss_average: LossAverage = "token"
        self._weights: list[float] = []
        self._token_loss: list[torch.Tensor | None] = []
        self._lm_loss: list[torch.Tensor | None] = []

    # --- what the training loop reads besides step() -------------------------------------

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by full-model name (what the optimizer steps)."""
        return stage_named_parameters(self.stages)

    def parameters_for_norm(self) -> list[nn.Parameter]:
        """This rank's parameters minus the last stage's embedding copy: their squared grad
        norms summed over the pipeline count every model parameter once."""
        copy = self._embedding_copy()
        return [p for p in self.named_parameters().values() if p is not copy]

    @torch.no_grad()
    def update_expert_biases(self, tokens_per_expert: dict[str, torch.Tensor]) -> None:
        """The aux-loss-free bias step of this rank's MoE layers (``tokens_per_expert`` as
        :meth:`step` returns it: every layer of the model, summed over the step)."""
        for stage in self.stages:
            for name, load in tokens_per_expert.items():
                try:
                    mixer = stage.get_submodule(f"{name}.mixer")
                except AttributeError:
                    continue  # a layer of another stage
                mixer.update_expert_bias(load.to(self.device))  # a routing mixer's load

    # --- the step -------------------------------------------------------------------------

    def step(
        self,
        micro: list[MicroBatch],
        ranks: Ranks | None = None,
        loss_average: LossAverage = "token",
    ) -> StepOutcome:
        """Forward and backward over ``micro``; gradients accumulate on this rank's parameters.

        ``micro`` is this data-parallel replica's share of the step; ``ranks`` (None: one
        replica) makes the weights shares of the global step, as ``forward_backward`` does,
        and ``loss_average`` (``training.objective.loss_average``) what they are shares of.
        The returned statistics are the whole model's and the whole step's, on every rank.
        """
        check_microbatch_count(self.layout, len(micro))
        ids, docs = _concat(micro)
        batch, seq = micro[0].input_ids.shape
        schedule = self._schedule(len(micro), batch, seq)
        counts = [micro_batch_share(b.loss_mask, b.document_ids, loss_average) for b in micro]
        step_targets = sum(counts)
        if ranks is not None:
            step_targets = int(ranks.sum_over_data(torch.tensor(step_targets)).item())
        step_micro = len(micro) * (ranks.data_size if ranks is not None else 1)
        self._weights = [count / max(1, step_targets) for count in counts]
        self._loss_average = loss_average
        self._micro = [self._to_device(b) for b in micro]
        self._token_loss = [None] * len(micro)
        self._lm_loss = [None] * len(micro)
        for stage in self.stages:
            stage.records.clear()
            stage.aux_scale = 1.0 / step_micro
        kwargs = {"input_ids": ids.to(self.device)}
        if docs is not None:
            kwargs["document_ids"] = docs.to(self.device)
        # The loss function's target is the micro-batch index: it reads the rest itself.
        target = torch.arange(len(micro))
        schedule.step(kwargs["input_ids"], target=target, return_outputs=False, **kwargs)
        for stage in self.stages:
            if len(stage.records) != len(micro):
                raise RuntimeError(
                    f"stage {stage.stage_index} ran {len(stage.records)} forward passes for "
                    f"{len(micro)} micro-batches"
                )
        self._sync_embedding_grads()
        return self._outcome(micro, step_micro, ranks)

    def _to_device(self, batch: MicroBatch) -> MicroBatch:
        docs = batch.document_ids
        return MicroBatch(
            batch.input_ids.to(self.device),
            batch.loss_mask.to(self.device),
            None if docs is None else docs.to(self.device),
        )

    def _schedule(self, count: int, batch: int, seq: int) -> _PipelineSchedule:
        key = (count, batch, seq)
        if key not in self._schedules:
            stages = []
            for module in self.stages:
                inputs, outputs = module.example_io(batch, seq, self.activation_dtype)
                stages.append(
                    PipelineStage(
                        module,
                        module.stage_index,
                        module.num_stages,
                        self.device,
                        input_args=inputs,
                        output_args=outputs,
                        group=self.group,
                    )
                )
            # scale_grads=False: the loss function already weights every micro-batch.
            if self.layout.vpp == 1:
                schedule = Schedule1F1B(stages[0], count, loss_fn=self._loss, scale_grads=False)
            else:
                schedule = ScheduleInterleaved1F1B(
                    stages, count, loss_fn=self._loss, scale_grads=False
                )
            self._schedules[key] = schedule
        return self._schedules[key]

    def _loss(
        self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor
    ) -> torch.Tensor:
        """Micro-batch ``target``'s token loss times its share of the step's target tokens
        (the aux losses ride on the activations)."""
        index = int(target.reshape(-1)[0])
        logits, *mtp_logits = output if isinstance(output, tuple) else (output,)
        batch = self._micro[index]
        # language_model_loss reads logits, mtp_logits and aux_loss only.
        model_output = ModelOutput(logits, tuple(mtp_logits), None, {}, logits, {})
        losses = language_model_loss(
            model_output,
            batch.input_ids,
            batch.loss_mask,
            mtp_loss_scale=self.mtp_scale,
            document_ids=batch.document_ids,
            loss_average=self._loss_average,
        )
        loss = self._weights[index] * losses.total
        self._token_loss[index] = loss.detach()
        self._lm_loss[index] = losses.lm.detach()
        return loss

    def _embedding_copy(self) -> nn.Parameter | None:
        """The last stage's embedding when it is a copy of the first stage's."""
        last = self.stages[-1]
        return last.shared_embedding if last.is_last and self._embedding_shared else None

    def _sync_embedding_grads(self) -> None:
        """Sum the first and last stage's embedding gradients on both (a + b == b + a
        exactly, so the copies get bitwise-equal gradients and stay equal)."""
        if not self._embedding_shared:
            return
        if self.pp_rank == 0:
            param, peer = self.stages[0].shared_embedding, self.layout.pp - 1
        elif self.pp_rank == self.layout.pp - 1:
            param, peer = self._embedding_copy(), 0
        else:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP: this shard
        received = torch.empty_like(local)
        peer_rank = dist.get_global_rank(self.group, peer)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, local, peer_rank, self.group),
                dist.P2POp(dist.irecv, received, peer_rank, self.group),
            ]
        )
        for work in works:
            work.wait()
        local.add_(received)

    def _outcome(
        self, micro: list[MicroBatch], step_micro: int, ranks: Ranks | None
    ) -> StepOutcome:
        """Every stage's statistics merged into the step's, on every rank."""
        tokens: dict[str, torch.Tensor] = {}
        rms: dict[str, float] = {}
        aux = 0.0
        for stage in self.stages:
            for record in stage.records:
                for name, load in record.tokens_per_expert.items():
                    tokens[name] = tokens[name] + load if name in tokens else load
                for name, value in record.residual_rms.items():
                    rms[name] = rms.get(name, 0.0) + float(value) / len(micro)
                if record.aux_loss is not None:
                    aux += float(record.aux_loss)
        # [token loss, lm loss, aux, tokens]: the last stage holds the first two and counts
        # the tokens (once per pipeline); every stage adds its aux losses.
        totals = torch.tensor([0.0, 0.0, aux / step_micro, 0.0], dtype=torch.float64)
        if self.stages[-1].is_last:
            lm = torch.stack(self._lm_loss).double().cpu()
            totals[0] = torch.stack(self._token_loss).double().sum().cpu()
            totals[1] = (torch.tensor(self._weights, dtype=torch.float64) * lm).sum()
            totals[3] = sum(batch.num_tokens for batch in micro)
        # NCCL reduces device tensors only.
        totals = totals.to(self.device)
        dist.all_reduce(totals, group=self.group)
        totals = totals.cpu()
        if ranks is not None:
            totals = ranks.sum_over_tokens(totals)
            tokens = ranks.sum_over_routing(tokens)  # gathers every stage's layers too
            rms = ranks.mean_over_tokens(rms)
        else:
            tokens, rms = self._gather_stages({n: t.cpu() for n, t in tokens.items()}, rms)
        token_loss, lm_loss, aux_loss, count = totals.tolist()
        return StepOutcome(
            loss=token_loss + aux_loss,
            lm_loss=lm_loss,
            tokens=int(count),
            tokens_per_expert=tokens,
            residual_rms=rms,
        )

    def _gather_stages(
        self, tokens: dict[str, torch.Tensor], rms: dict[str, float]
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Every rank's per-layer statistics on every rank, in stack order."""
        gathered: list[tuple[dict, dict] | None] = [None] * self.layout.pp
        dist.all_gather_object(gathered, (tokens, rms), group=self.group)
        all_tokens = {n: t for part in gathered for n, t in part[0].items()}
        all_rms = {n: v for part in gathered for n, v in part[1].items()}
        return (
            dict(sorted(all_tokens.items(), key=_layer_key)),
            dict(sorted(all_rms.items(), key=_layer_key)),
        )


def _layer_key(item: tuple[str, object]) -> tuple[bool, int]:
    """Main-stack layers in stack order, then the MTP layers (``mtp.layers.j``)."""
    prefix, _, index = item[0].rpartition(".")
    return prefix.startswith("mtp"), int(index)


class PipelinedModel(nn.Module):
    def __init__(self, cfg: ModelConfig, runner: PipelineRunner) -> None:
        super().__init__()
        self.cfg = cfg
        object.__setattr__(self, "runner", runner)  # not a submodule (see the module doc)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.runner.named_parameters().items()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        """The stages' modules under the full model's names, each once."""
        seen: set[str] = set()
        for stage in self.runner.stages:
            for name, module in stage.named_modules():
                if name not in seen:
                    seen.add(name)
                    yield name, module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for stage in self.runner.stages:
            merged.update(stage.state_dict())
        return merged

    def load_state_dict(self, state: dict[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        for stage in self.runner.stages:
            own = stage.state_dict()
            stage.load_state_dict({k: v for k, v in state.items() if k in own}, strict, assign)

    def train(self, mode: bool = True) -> PipelinedModel:
        for stage in self.runner.stages:
            stage.train(mode)
        return self

    def excluded_from_norm(self) -> set[str]:
        """Names whose gradient another rank already counts (the last stage's embedding)."""
        kept = {id(p) for p in self.runner.parameters_for_norm()}
        return {n for n, p in self.runner.named_parameters().items() if id(p) not in kept}

    def forward_backward(
        self,
        micro: list[MicroBatch],
        mtp_scale: float,
        ranks: Ranks,
        loss_average: LossAverage = "token",
    ) -> StepOutcome:
        return self.runner.step(micro, ranks, loss_average)

    @torch.no_grad()
    def update_expert_biases(self, tokens_per_expert: dict[str, torch.Tensor]) -> None:
        self.runner.update_expert_biases(tokens_per_expert)
