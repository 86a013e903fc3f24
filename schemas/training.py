"""The ``training`` section: optimizer, schedule, length, checkpoints, seed, loggers and cluster."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from factory.schemas.base import Section, Seed, StepCount, TokenCount
from factory.schemas.cluster import ClusterConfig
from factory.schemas.stability import StabilityConfig
from factory.schemas.trackers import JSONL, logger_names

__all__ = [
    "AverageConfig",
    "EvalConfig",
    "Logger",
    "LossAverage",
    "ObjectiveConfig",
    "ObjectiveKind",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainingConfig",
]


def _known_logger(name: str) -> str:
    # Asked at validation, not fixed when this module is imported, so a tracker registered
    # later (factory.schemas.trackers) is a name like the shipped ones.
    if name not in logger_names():
        raise ValueError(f"unknown logger {name!r}; known: {', '.join(logger_names())}")
    return name


def _logger_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = list(logger_names())


Logger = Annotated[str, AfterValidator(_known_logger), Field(json_schema_extra=_logger_enum)]
"""Where a run's metrics go: ``jsonl`` or a tracker of ``factory.schemas.trackers``."""


def _each_logger_once(names: tuple[str, ...]) -> tuple[str, ...]:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each logger once; {', '.join(repeated)} given more than once")
    return names


Loggers = Annotated[
    tuple[Logger, ...],
    AfterValidator(_each_logger_once),
    Field(json_schema_extra={"uniqueItems": True}),
]


class OptimizerConfig(Section):
    """AdamW with decoupled weight decay."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam (beta1, beta2)."""
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Global gradient-norm clip; null disables it."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        for beta in self.betas:
            if not 0 <= beta < 1:
                raise ValueError(f"each beta must be in [0, 1), got {list(self.betas)}")
        return self


ObjectiveKind = Literal["pretrain", "sft"]
"""What a stage trains the model to do (``ObjectiveConfig.kind``)."""
LossAverage = Literal["token", "conversation"]
"""How a step's target-token losses are averaged (``ObjectiveConfig.loss_average``)."""


class ObjectiveConfig(Section):
    """What the loss trains: next-token prediction on every token, or on assistant turns only,
    and how a step averages the losses of its targets (docs/architecture.md, The objective).

    Nemotron 3 trains each model as a program: pretraining on every token, then SFT on
    chat data with the loss on the output (assistant) tokens only. Nemotron 3 Super's SFT
    has two stages that differ only in the average: a global token average, then a
    per-conversation average, which keeps long outputs from dominating (Nemotron 3 Super
    technical report, arXiv 2604.12374, post-training; NVIDIA-NeMo/Nemotron's Super SFT
    guide, docs.nvidia.com/nemotron/nightly/nemotron/super3/sft.html, "Two-Stage SFT
    Loss")."""

    kind: ObjectiveKind = "pretrain"
    """Both train on the tokens the data's loss mask marks; they differ in what the data
    must be. pretrain: any recipe (a text source marks every token). sft: every source of
    the recipe masks its prompts, i.e. formats chat (assistant turns train: think block,
    content, tool calls and ``<|im_end|>``; system, user and tool turns and the assistant
    header are context); validate refuses an sft objective with a text source."""
    loss_average: LossAverage = "token"
    """token: the sum of the step's target losses over the number of its targets (Megatron's
    global per-token average; every target weighs the same, what pretraining does).
    conversation: each packed document's (conversation's) targets are averaged first, then
    the documents with targets are averaged over the step, so a long answer weighs as much as
    a short one (Super's second SFT stage). A document cut across two packed sequences counts
    as two. Both hold over micro-batches, data-parallel replicas and context-parallel
    ranks, and for each MTP depth over its own targets."""

    @field_validator("loss_average")
    @classmethod
    def _conversation_needs_sft(cls, average: LossAverage, info: ValidationInfo) -> LossAverage:
        # Checked on loss_average (kind is validated first), so the error names this field.
        if average == "conversation" and info.data.get("kind") == "pretrain":
            raise ValueError(
                "loss_average 'conversation' needs kind 'sft': a pretraining sequence packs "
                "documents cut at arbitrary points, not conversations, and averaging per "
                "document would weigh a short fragment's tokens above a long document's "
                "(Nemotron uses the per-conversation average only in SFT)"
            )
        return average


class ScheduleConfig(Section):
    """Learning-rate schedule."""

    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    """wsd: warmup, stable, then decay over the last decay_fraction. cosine: warmup then cosine."""
    warmup_fraction: float = Field(default=0.01, ge=0, lt=1)
    """Fraction of training spent in linear warmup."""
    decay_fraction: float = Field(default=0.2, gt=0, le=1)
    """WSD: fraction of training spent decaying to min_lr."""
    decay_shape: Literal["linear", "cosine", "minus_sqrt"] = "minus_sqrt"
    """WSD: shape of the final decay."""


class AverageConfig(Section):
    """An exponential moving average of the fp32 master weights, kept while training.

    After the optimizer step of schedule step ``s``: at ``s = start`` the average takes the
    masters as they are, after it ``avg = avg * decay + master * (1 - decay)`` in fp32,
    element by element (any sharding gives the same bits). It is sharded like the
    optimizer state, saved in every checkpoint, restored on resume, and written at the end
    to ``RUN/averaged/ema/`` (``factory average`` says what that holds); training itself is
    unchanged, bit for bit."""

    kind: Literal["ema"] = "ema"
    decay: float = Field(gt=0, lt=1)
    """Weight kept of the average at each step (0.999: a horizon of about 1000 steps)."""
    start: int = Field(default=0, ge=0)
    """The step whose weights start the average (it must be one the run takes)."""


class EvalConfig(Section):
    """Validation while training: the loss on the data build's held-out sets
    (``factory.runtime.evaluation``; docs/training.md, Validation and factory eval)."""

    interval: StepCount
    """Steps between evaluations; the run is also evaluated after its last step. At most
    the run's steps (validate refuses a longer one)."""
    tokens: TokenCount = 65536
    """Positions read from each held-out set at every evaluation (whole samples, the first
    ones of the set in its manifest's order, so every evaluation reads the same tokens; a
    smaller set is read whole). Suffixes allowed: '1M'."""
    sets: tuple[str, ...] | None = None
    """The held-out categories evaluated (the build's ``heldout`` names); null: every set
    the data build has. A name the build lacks is refused when the training starts."""

    @field_validator("sets")
    @classmethod
    def _sets_named_once(cls, sets: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if sets is not None:
            if not sets:
                raise ValueError("name at least one held-out set, or leave sets out for all")
            repeated = sorted({name for name in sets if sets.count(name) > 1})
            if repeated:
                raise ValueError(f"each set once; {', '.join(repeated)} given more than once")
        return sets


class TrainingConfig(Section):
    """How long to train and how."""

    alternatives = (("steps", "tokens"),)

    optimizer: OptimizerConfig
    schedule: ScheduleConfig = ScheduleConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    """Pretraining or SFT, and the token or per-conversation loss average."""
    steps: StepCount | None = None
    """Optimizer steps; give at most one of steps and tokens (neither: one pass over the data).
    At most 2**40."""
    tokens: TokenCount | None = None
    """Training tokens (suffixes allowed: '25T'); converted to steps with the global batch.
    At most 10**16."""
    checkpoint_interval: StepCount = 1000
    """Steps between checkpoints (at most 2**40)."""
    average: AverageConfig | None = None
    """A moving average of the weights kept while training (none by default)."""
    seed: Seed = 1234
    """Seed for initialisation, data order and stochastic rounding (0 to 2**63 - 1)."""
    compile: bool = False
    """``torch.compile`` each block whose shapes follow from the batch alone (Mamba,
    attention, dense MLP, and MoE where its dispatch is sync-free: the grouped-GEMM path,
    no quantized expert GEMMs, no expert parallelism). The
    first step pays the compile (seconds per block type); needs a C++ compiler on CPU.
    Works under every layout (blocks are compiled after tensor, expert and context
    parallelism and before FSDP2, per pipeline stage; under TP the Mamba blocks stay
    eager) and with the precision policy on, whose quantized GEMMs run eagerly between
    the compiled regions. The run's first lines say which blocks are compiled."""
    loggers: Loggers = (JSONL,)
    """Where the run's metrics go. ``jsonl``: ``metrics.jsonl`` in the run folder, which every
    run writes whether listed or not (resuming and the run report read it). Every other name
    is an experiment tracker (``factory.schemas.trackers`` lists them with the extra each
    needs; ``tensorboard``: event files in ``<run>/tensorboard/``; ``wandb``: a Weights &
    Biases run in ``<run>/wandb/``, offline unless ``WANDB_MODE`` says otherwise). Each
    tracker gets the same per-step scalars, monitor events, checkpoints and rollbacks, from
    rank 0."""
    eval: EvalConfig | None = None
    """The held-out loss per category and overall, with the MTP losses, every ``interval``
    steps and at the end, into ``metrics.jsonl``, the trackers and the run page; it does not
    change training (RNG, data position and precision state are put back). null: none."""
    stability: StabilityConfig = StabilityConfig()
    """What the run watches (MoE load, residual stream, loss and gradient spikes, non-finite
    values) and what it does when a threshold is crossed (``factory.runtime.monitors``)."""
    cluster: ClusterConfig = ClusterConfig()
    """What the cluster delivers (MFU, failure rate, restart time, checkpoint bandwidths), from
    which the plan prices the run and its failures (``factory.planner.cost``, docs/cost.md)."""
