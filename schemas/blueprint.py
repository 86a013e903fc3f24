"""The whole blueprint: one typed document per model."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from factory.schemas.base import Section
from factory.schemas.data import DataConfig
from factory.schemas.model import ModelConfig
from factory.schemas.parallelism import ParallelismConfig
from factory.schemas.precision import PrecisionConfig
from factory.schemas.stage import StageConfig
from factory.schemas.training import TrainingConfig

__all__ = ["Blueprint", "Meta"]


class Meta(Section):
    """Who and what this blueprint is."""

    name: str = Field(min_length=1)
    """Short name, used for build folders."""
    description: str = ""
    family: str = ""
    """Model family, e.g. 'nemotron-3'."""
    hf_id: str | None = None
    """Hugging Face id of the released checkpoint this blueprint reproduces."""
    sources: list[str] = Field(default_factory=list)
    """Where the numbers come from."""


MAX_STAGES = 64
"""Stages one program may have (Nemotron 3's have five or six)."""


def _a_program(stages: list[StageConfig]) -> list[StageConfig]:
    if not stages:
        raise ValueError("an empty program: list at least one stage, or leave `stages` out")
    names = [stage.name for stage in stages]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each stage name once; {', '.join(repeated)} given more than once")
    return stages


Stages = Annotated[list[StageConfig], Field(max_length=MAX_STAGES), AfterValidator(_a_program)]


class Blueprint(Section):
    """A model blueprint: architecture, precision, parallel layout, data and training.

    With ``stages`` it is a program: each stage is this blueprint with the stage's changes
    (``factory.schemas.program``); without, it is one stage.
    """

    meta: Meta
    model: ModelConfig
    precision: PrecisionConfig = PrecisionConfig()
    parallelism: ParallelismConfig
    data: DataConfig
    training: TrainingConfig
    stages: Stages | None = None
    """The program's stages in order (``factory.schemas.stage``); absent: one stage."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes: global batch times sequence length."""
        return self.parallelism.global_batch_size * self.data.seq_len

    @property
    def training_tokens(self) -> int:
        """Tokens the run trains on: from tokens or steps, else one pass over data.tokens."""
        if self.training.tokens is not None:
            return self.training.tokens
        if self.training.steps is not None:
            return self.training.steps * self.tokens_per_step
        return self.data.tokens

    @property
    def training_steps(self) -> int:
        """Optimizer steps: as written, or tokens // tokens_per_step (Megatron's floor)."""
        if self.training.steps is not None:
            return self.training.steps
        return self.training_tokens // self.tokens_per_step
