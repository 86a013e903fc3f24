"""One pipeline rank's stages, seen by the training loop as the model.

The loop, the optimizer and the checkpointer ask a model for its named
parameters, its ``state_dict`` (DCP fills it in place), ``train()``, and the
expert-bias step. :class:`PipelinedModel` answers for the stages this rank runs
(``factory.distributed.pipeline_stages``), under the full model's names, and
runs a step through the pipeline schedule
(:class:`~factory.distributed.pipeline.PipelineRunner`) instead of a forward
call. The stages are not registered as submodules: their parameter names would
get a prefix, and checkpoints would no longer be those of the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from factory.distributed.pipeline import PipelineRunner
from factory.runtime.batches import MicroBatch
from factory.runtime.ranks import Ranks
from factory.runtime.step import StepOutcome
from factory.schemas.model import ModelConfig

__all__ = ["PipelinedModel"]


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
        self, micro: list[MicroBatch], mtp_scale: float, ranks: Ranks
    ) -> StepOutcome:
        return self.runner.step(micro, ranks)

    @torch.no_grad()
    def update_expert_biases(self, tokens_per_expert: dict[str, torch.Tensor]) -> None:
        self.runner.update_expert_biases(tokens_per_expert)
