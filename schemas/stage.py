"""One stage of a training program: what changes from the stage before, and what carries over.

Nemotron 3 is trained as a program: pretraining phase 1 (diversity) and phase 2 (quality),
long-context extension, then SFT (arXiv 2512.20848 section 2-3; docs/stages.md). A
blueprint's ``stages`` lists them in order. Each stage gives only what differs from the
stage before (the first: from the blueprint's own sections), as partial ``data``,
``parallelism``, ``precision`` and ``training`` sections merged the way ``extends`` merges
fragments (mappings deeply, anything else replaced). The model is the blueprint's and no
stage may change it: every stage trains the same weights.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from factory.schemas.base import Section

__all__ = ["STAGE_SECTIONS", "StageCarry", "StageConfig"]

STAGE_SECTIONS = ("data", "parallelism", "precision", "training")
"""The blueprint sections a stage may change, in the order a stage lists them."""

Overrides = dict[str, Any]


class StageCarry(Section):
    """What a stage takes over from the checkpoint of the stage before (weights always)."""

    optimizer: bool = True
    """Adam's moments and step count continue, as across Megatron's blend phase transitions;
    false starts a fresh optimizer, as fine-tuning from a pretrained checkpoint does."""
    data_position: bool = False
    """Read on where the stage before stopped in its data, instead of from the start of this
    stage's own. Only when both stages read the same recipe at the same sequence length."""


class StageConfig(Section):
    """A stage of the program: its name, what it changes, and what it carries over."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=64)
    """Names the stage's run folder, checkpoints, metrics and exports (lowercase, digits,
    '_' and '-')."""
    description: str = ""
    continue_schedule: bool = False
    """This stage goes on with the learning-rate schedule of the stage before: the two (and
    any further stage that continues) form one schedule over their summed steps, as Super's
    minus-sqrt decay spans its phase 2. False: the stage's own ``training.schedule`` starts
    at its first step (SFT's warmup)."""
    carry: StageCarry = StageCarry()
    data: Overrides = Field(default_factory=dict)
    """What changes in ``data``: the recipe, ``seq_len``, ``tokens``."""
    parallelism: Overrides = Field(default_factory=dict)
    """What changes in ``parallelism``: the layout, ``world_size``, batch sizes."""
    precision: Overrides = Field(default_factory=dict)
    """What changes in ``precision``, e.g. the recipe for a stage trained in BF16."""
    training: Overrides = Field(default_factory=dict)
    """What changes in ``training``: ``steps`` or ``tokens``, optimizer, schedule, objective."""
    model: Overrides | None = None
    """Refused: every stage trains the blueprint's one model."""

    @field_validator("model")
    @classmethod
    def _model_is_shared(cls, model: Overrides | None) -> None:
        if model is not None:
            named = ", ".join(sorted(model)) or "model"
            raise ValueError(
                f"a stage cannot change the model ({named}): every stage trains the "
                "architecture of the blueprint's model section"
            )
        return None

    def overrides(self) -> dict[str, Overrides]:
        """The sections this stage changes, by name."""
        return {name: getattr(self, name) for name in STAGE_SECTIONS if getattr(self, name)}
