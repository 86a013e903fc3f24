"""Blueprint -> Megatron-Bridge ``ConfigContainer`` fields: the one mapping table, torch-free.

:func:`fields` is the only place a blueprint field meets a Megatron field (each layer
type declares its own, ``LayerType.megatron_fields``): the
generated ``recipe.py`` and ``overrides.yaml`` are rendered from it,
``docs/megatron.md`` carries its table (``factory.exports.megatron.mapping_markdown``, compared by the
tests) and the tests check every ``config``/``model`` name against the installed
megatron-core 0.16.1 (``TransformerConfig``, ``ModelParallelConfig``, ``MambaModel``).
Every Bridge-side name (section classes and their import paths, their fields, the
mixed-precision presets, the provider-only fields) is checked against Megatron-Bridge
main at ``BRIDGE_COMMIT`` and the Megatron-LM commit it pins (``MEGATRON_LM_COMMIT``), read
from source into ``megatron_bridge_fields.json`` by ``megatron_bridge_source``. What
Megatron cannot express is in ``factory.exports.megatron_refusals``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from factory.exports.quant_recipe import (
    QUANT_RECIPE_FILE,
    QUANT_RECIPE_LOADER,
    QuantRecipeError,
    megatron_quant_recipe,
    mtp_formats,
)
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision_recipes import HIGH_PRECISION, MegatronPreset, recipe_named
from factory.schemas.program import Program
from factory.spec.layer_type import (
    LAYER_TYPES,
    MEGATRON_DEFAULT,
    LayerType,
    MegatronField,
    Ref,
)

__all__ = [
    "PROVIDER_FIELDS_SINCE",
    "SECTIONS",
    "Field",
    "Ref",
    "fields",
    "megatron_fields",
    "objective",
    "pipeline_stage_sizes",
    "run_starts",
    "shared_field_conflicts",
    "stage_fields",
]

MEGATRON_CORE_VERSION = "0.16.1"
BRIDGE_COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"  # 2026-08-22, package_info 0.7.0
MEGATRON_LM_COMMIT = "2a75ac12c54ba6a42b34024756820bf819a2e25f"  # its 3rdparty/Megatron-LM
# Model provider fields that Megatron-Bridge 0.3.x (with megatron-core 0.16.1) lacks, with the
# first release that has each: read from the Megatron-Bridge 0.3.1, 0.4.0, 0.5.0 and 0.6.0 wheels
# and megatron-core 0.17.0's TransformerConfig (mtp_use_repeated_layer is megatron-core's).
# 0.3.x names the pattern hybrid_override_pattern, which recipe.py renames.
PROVIDER_FIELDS_SINCE: dict[str, tuple[str, str]] = {
    "mtp_hybrid_override_pattern": ("Megatron-Bridge", "0.4.0"),
    "keep_mtp_spec_in_bf16": ("Megatron-Bridge", "0.4.0"),
    "mtp_use_repeated_layer": ("megatron-core", "0.17.0"),
}


@dataclass(frozen=True)
class Call:
    """A call of a function named by import path on a file beside recipe.py."""

    path: str
    file: str


Kind = Literal["config", "model", "provider", "container"]
"""config: a megatron-core 0.16.1 TransformerConfig/ModelParallelConfig field. model: a
parameter of 0.16.1's MambaModel (named in ``Field.mcore``). provider: Megatron-Bridge's
HybridModelProvider only. container: a field of another ConfigContainer section's class."""


@dataclass(frozen=True)
class Field:
    blueprint: str
    section: str
    name: str
    kind: Kind
    get: Callable[[Blueprint], Any]
    mcore: str | None = None


SKIP = object()
"""``get`` returns this when the field does not apply (no attention layers, no MoE, ...)."""


@dataclass(frozen=True)
class Required:
    """A ``TransformerConfig`` field Megatron-Core requires whatever the pattern: where no layer
    type in the pattern sets it, the value the layer types that set it declare for their absence
    (``MegatronField.absent``), so the row comes from the registry when :func:`fields` is asked."""

    name: str

    def row(self) -> Field | None:
        """The row (None where no registered layer type declares the field's absence)."""
        declared = [
            (kind, field)
            for kind in sorted(LAYER_TYPES.values(), key=lambda kind: kind.name)
            for field in kind.megatron_fields or ()
            if field.name == self.name and field.absent is not MEGATRON_DEFAULT
        ]
        if not declared:
            return None
        value = declared[0][1].absent
        layers = " or ".join(dict.fromkeys(kind.title or kind.name for kind, _ in declared))
        return Field(f"(no {layers} layers)", "model", self.name, "config", lambda bp: value)


# ConfigContainer sections and the class each is built from in recipe.py (module, class).
# optimizer and ddp are Bridge's subclasses: ConfigContainer defers their __post_init__ to
# finalize(). mixed_precision is a preset whose setup() copies its fields onto the model.
SECTIONS: dict[str, tuple[str, str]] = {
    "model": ("megatron.bridge.models.hybrid.hybrid_provider", "HybridModelProvider"),
    "train": ("megatron.bridge.training.config", "TrainingConfig"),
    "optimizer": ("megatron.bridge.training.config", "OptimizerConfig"),
    "scheduler": ("megatron.bridge.training.config", "SchedulerConfig"),
    "ddp": ("megatron.bridge.training.config", "DistributedDataParallelConfig"),
    "dataset": ("megatron.bridge.training.config", "GPTDatasetConfig"),
    "checkpoint": ("megatron.bridge.training.config", "CheckpointConfig"),
    "rng": ("megatron.bridge.training.config", "RNGConfig"),
    "mixed_precision": ("megatron.bridge.training.mixed_precision", "MixedPrecisionConfig"),
}

_WSD_SHAPES = {"linear": "linear", "cosine": "cosine", "minus_sqrt": "minus_sqrt"}
_UNEXPRESSED = MegatronPreset("bf16_mixed")
"""What the export writes for a recipe Megatron has no name for (the refusals name it)."""


def _layer_value(kind: LayerType, field: MegatronField, bp: Blueprint) -> Any:
    """What the layer type sets ``field`` to in ``bp`` (SKIP where its pattern lacks the layer
    or the field does not apply)."""
    if not kind.used_by(bp.model):
        return SKIP
    source = bp.parallelism if field.reads == "parallelism" else kind.config(bp.model)
    return field.get(source) if field.when is None or field.when(source) else SKIP


def _setters(bp: Blueprint, name: str) -> list[tuple[LayerType, MegatronField, Any]]:
    """Every layer type in ``bp``'s pattern that sets the Megatron field ``name``, with its
    value; a fallback only where no other layer type sets the field."""
    found = [
        (kind, field, value)
        for kind in sorted(LAYER_TYPES.values(), key=lambda kind: kind.name)
        for field in kind.megatron_fields or ()
        if field.name == name and (value := _layer_value(kind, field, bp)) is not SKIP
    ]
    firm = [entry for entry in found if entry[1].share != "fallback"]
    return firm or found[:1]


def _layer_field(kind: LayerType, field: MegatronField) -> Field:
    """A layer type's field: its value where the pattern uses the layer, the field applies
    and (for a fallback) no other layer type sets it."""

    def get(bp: Blueprint) -> Any:
        setters = _setters(bp, field.name)
        return next((value for k, _, value in setters if k is kind), SKIP)

    return Field(field.blueprint, "model", field.name, "config", get)


def shared_field_conflicts(bp: Blueprint) -> list[tuple[str, str]]:
    """(blueprint path, reason) for every Megatron field that layer types in ``bp``'s pattern
    set to different values: Megatron has one such field for all of them."""
    names = {f.name for kind in LAYER_TYPES.values() for f in kind.megatron_fields or ()
             if f.share == "agree"}  # fmt: skip
    out: dict[str, str] = {}
    for name in sorted(names):
        setters = _setters(bp, name)
        if len({repr(value) for _, _, value in setters}) < 2:
            continue
        values = ", ".join(f"{field.blueprint}={value!r}" for _, field, value in setters)
        layers = " and ".join(kind.name for kind, _, _ in setters)
        path = setters[0][1].blueprint
        out.setdefault(path, f"Megatron has one {name} for {layers} layers; {values}")
    return list(out.items())


def pipeline_stage_sizes(bp: Blueprint) -> list[int]:
    """Layers per pipeline stage the blueprint asks for ('|' segments, else an even split)."""
    parsed, pp = bp.model.parsed_pattern, bp.parallelism.pp
    if parsed.has_pipes:
        return [len(segment) for segment in parsed.segments]
    n = parsed.num_layers
    return [n // pp] * pp if n % pp == 0 else []


def _uneven(bp: Blueprint, end: Literal["first", "last"]) -> Any:
    """Megatron reproduces uneven cuts with first/last stage sizes and an even middle."""
    sizes = pipeline_stage_sizes(bp)
    if len(sizes) != bp.parallelism.pp or len(sizes) < 2 or len(set(sizes)) == 1:
        return SKIP
    return sizes[0] if end == "first" else sizes[-1]


def _steps(bp: Blueprint, fraction: float) -> int:
    return round(bp.training_steps * fraction)


def _recompute(bp: Blueprint) -> Any:
    kind = bp.parallelism.recompute
    return None if kind == "none" else kind


def _high(bp: Blueprint, end: Literal["first", "last", "any"]) -> Any:
    # Written whenever the recipe is not bf16: the fp8 current-scaling preset keeps one BF16
    # layer at each end by itself, which the blueprint may not ask for.
    hp = bp.precision.high_precision
    if not recipe_named(bp.precision.recipe).quantizes:
        return SKIP
    return {"first": hp.first, "last": hp.last, "any": bool(hp.first or hp.last)}[end]


def _preset(bp: Blueprint) -> MegatronPreset:
    """Bridge's mixed-precision preset for the default recipe and its settings."""
    p = bp.precision
    to_megatron = recipe_named(p.recipe).megatron
    return _UNEXPRESSED if to_megatron is None else to_megatron(p.options_for(p.recipe))


def _preset_field(name: str) -> Callable[[Blueprint], Any]:
    return lambda bp: _preset(bp).fields.get(name, SKIP)


def _mtp(fn: Callable[[Blueprint], Any]) -> Callable[[Blueprint], Any]:
    return lambda bp: fn(bp) if bp.model.mtp_depth else SKIP


def objective(bp: Blueprint) -> tuple[str, str]:
    """(kind, loss average) of ``training.objective``: ("pretrain", "token") where the
    blueprint's schema has no objective section."""
    section = getattr(bp.training, "objective", None)
    return getattr(section, "kind", "pretrain"), getattr(section, "loss_average", "token")


def _sft(fn: Callable[[Blueprint], Any]) -> Callable[[Blueprint], Any]:
    return lambda bp: fn(bp) if objective(bp)[0] == "sft" else SKIP


M, T, P = "model", "container", "mixed_precision"
# One row per field reads as the table it is; the formatter would spread rows over lines.
# fmt: off
_MODEL_FIELDS: tuple[Field | Required, ...] = (
    # The hybrid stack. '|' is not written: pipeline cuts become first/last stage sizes.
    Field("model.pattern", M, "hybrid_layer_pattern", "provider", lambda bp: bp.model.parsed_pattern.main),
    Field("model.pattern", M, "num_layers", "config", lambda bp: bp.model.num_layers),
    Field("model.pattern", M, "is_hybrid_model", "config", lambda bp: True),
    Field("model.hidden_size", M, "hidden_size", "config", lambda bp: bp.model.hidden_size),
    Field("model.vocab_size", M, "vocab_size", "model", lambda bp: bp.model.vocab_size,
          "vocab_size"),
    Field("data.seq_len", M, "seq_length", "model", lambda bp: bp.data.seq_len,
          "max_sequence_length"),
    Field("model.tie_embeddings", M, "share_embeddings_and_output_weights", "model",
          lambda bp: bp.model.tie_embeddings, "share_embeddings_and_output_weights"),
    Field("model.position_embedding", M, "position_embedding_type", "model",
          lambda bp: bp.model.position_embedding, "position_embedding_type"),
    Field("model.rope_base", M, "rotary_base", "model",
          lambda bp: int(bp.model.rope_base) if bp.model.position_embedding == "rope" else SKIP,
          "rotary_base"),
    Field("model.rope_fraction", M, "rotary_percent", "model",
          lambda bp: bp.model.rope_fraction if bp.model.position_embedding == "rope" else SKIP,
          "rotary_percent"),
    Field("model.norm_eps", M, "layernorm_epsilon", "config", lambda bp: bp.model.norm_eps),
    Field("model.norm_eps", M, "normalization", "config", lambda bp: "RMSNorm"),
    Field("model.init.std", M, "init_method_std", "config", lambda bp: bp.model.init.std),
    # Megatron requires these whatever the pattern; a layer type in the pattern that sets one
    # overrides the value its layer types declare for a pattern without them.
    Required("add_bias_linear"),
    Required("activation_func"),
    Required("gated_linear_unit"),
    Field("(none)", M, "hidden_dropout", "config", lambda bp: 0.0),
    Field("(none)", M, "attention_dropout", "config", lambda bp: 0.0),
    Required("num_attention_heads"),
)
# Each layer type's own fields (factory/layers/<name>/spec.py) come here, by layer name.
_RUN_FIELDS: tuple[Field, ...] = (
    # Multi-token prediction.
    Field("model.mtp.depth", M, "mtp_num_layers", "config", _mtp(lambda bp: bp.model.mtp_depth)),
    Field("model.mtp.pattern", M, "mtp_hybrid_override_pattern", "provider",
          _mtp(lambda bp: bp.model.mtp_pattern)),
    Field("model.mtp.repeated", M, "mtp_use_repeated_layer", "provider",
          _mtp(lambda bp: bool(bp.model.mtp and bp.model.mtp.repeated))),
    Field("model.mtp.loss_scale", M, "mtp_loss_scaling_factor", "config",
          _mtp(lambda bp: bp.model.mtp.loss_scale if bp.model.mtp else 0.1)),
    Field("precision.overrides (MTP layers)", M, "keep_mtp_spec_in_bf16", "provider",
          lambda bp: _mtp_in_bf16(bp)),
    Field("precision.overrides", M, "quant_recipe", "config", lambda bp: _quant_recipe(bp)),
    # Layout.
    Field("parallelism.tp", M, "tensor_model_parallel_size", "config", lambda bp: bp.parallelism.tp),
    Field("parallelism.pp", M, "pipeline_model_parallel_size", "config",
          lambda bp: bp.parallelism.pp),
    Field("parallelism.pp", M, "pipeline_dtype", "config",
          lambda bp: Ref("torch.bfloat16") if bp.parallelism.pp > 1 else SKIP),
    Field("model.pattern '|'", M, "num_layers_in_first_pipeline_stage", "config",
          lambda bp: _uneven(bp, "first")),
    Field("model.pattern '|'", M, "num_layers_in_last_pipeline_stage", "config",
          lambda bp: _uneven(bp, "last")),
    Field("parallelism.cp", M, "context_parallel_size", "config", lambda bp: bp.parallelism.cp),
    Field("parallelism.ep", M, "expert_model_parallel_size", "config",
          lambda bp: bp.parallelism.ep),
    Field("parallelism.sequence_parallel", M, "sequence_parallel", "config",
          lambda bp: bp.parallelism.sequence_parallel),
    Field("parallelism.recompute", M, "recompute_granularity", "config", _recompute),
    # Precision: Bridge's MixedPrecisionConfig.setup() overwrites these model fields with the
    # preset's, so they are set on the preset ("name") rather than on the model.
    Field("precision.recipe", P, "name", T, lambda bp: _preset(bp).name),
    Field("precision.recipe", P, "fp8", T, _preset_field("fp8")),
    Field("precision.fp8.scaling", P, "fp8_recipe", T, _preset_field("fp8_recipe")),
    Field("precision.recipe", P, "fp4", T, _preset_field("fp4")),
    Field("precision.recipe", P, "fp4_recipe", T, _preset_field("fp4_recipe")),
    Field("precision.high_precision", P, "first_last_layers_bf16", T, lambda bp: _high(bp, "any")),
    Field("precision.high_precision.first", P, "num_layers_at_start_in_bf16", T,
          lambda bp: _high(bp, "first")),
    Field("precision.high_precision.last", P, "num_layers_at_end_in_bf16", T,
          lambda bp: _high(bp, "last")),
    # Training.
    Field("parallelism.micro_batch_size", "train", "micro_batch_size", T,
          lambda bp: bp.parallelism.micro_batch_size),
    Field("parallelism.global_batch_size", "train", "global_batch_size", T,
          lambda bp: bp.parallelism.global_batch_size),
    Field("training.{steps,tokens}", "train", "train_iters", T, lambda bp: bp.training_steps),
    # SFT masks the prompts, so micro-batches hold different numbers of targets: Megatron's
    # per-token loss sums them over the step, as factory's token average does.
    Field("training.objective.kind", M, "calculate_per_token_loss", "config",
          _sft(lambda bp: True)),
    Field("training.optimizer.name", "optimizer", "optimizer", T, lambda bp: "adam"),
    Field("training.optimizer.lr", "optimizer", "lr", T, lambda bp: bp.training.optimizer.lr),
    Field("training.optimizer.min_lr", "optimizer", "min_lr", T,
          lambda bp: bp.training.optimizer.min_lr),
    Field("training.optimizer.betas", "optimizer", "adam_beta1", T,
          lambda bp: bp.training.optimizer.betas[0]),
    Field("training.optimizer.betas", "optimizer", "adam_beta2", T,
          lambda bp: bp.training.optimizer.betas[1]),
    Field("training.optimizer.eps", "optimizer", "adam_eps", T,
          lambda bp: bp.training.optimizer.eps),
    Field("training.optimizer.weight_decay", "optimizer", "weight_decay", T,
          lambda bp: bp.training.optimizer.weight_decay),
    # Megatron disables clipping with 0.0 where the blueprint writes null.
    Field("training.optimizer.grad_clip", "optimizer", "clip_grad", T,
          lambda bp: bp.training.optimizer.grad_clip or 0.0),
    Field("parallelism.distributed_optimizer", "optimizer", "use_distributed_optimizer", T,
          lambda bp: bp.parallelism.distributed_optimizer),
    Field("(bf16 master)", "optimizer", "bf16", T, lambda bp: True),
    Field("parallelism.distributed_optimizer", "ddp", "use_distributed_optimizer", T,
          lambda bp: bp.parallelism.distributed_optimizer),
    Field("parallelism.distributed_optimizer_instances", "ddp",
          "num_distributed_optimizer_instances", T,
          lambda bp: bp.parallelism.distributed_optimizer_instances),
    Field("training.schedule.kind", "scheduler", "lr_decay_style", T,
          lambda bp: {"wsd": "WSD", "cosine": "cosine", "constant": "constant"}[
              bp.training.schedule.kind]),
    Field("training.schedule.warmup_fraction", "scheduler", "lr_warmup_iters", T,
          lambda bp: _steps(bp, bp.training.schedule.warmup_fraction)),
    Field("training.{steps,tokens}", "scheduler", "lr_decay_iters", T,
          lambda bp: bp.training_steps),
    Field("training.schedule.decay_shape", "scheduler", "lr_wsd_decay_style", T,
          lambda bp: _WSD_SHAPES[bp.training.schedule.decay_shape]
          if bp.training.schedule.kind == "wsd" else SKIP),
    Field("training.schedule.decay_fraction", "scheduler", "lr_wsd_decay_iters", T,
          lambda bp: _steps(bp, bp.training.schedule.decay_fraction)
          if bp.training.schedule.kind == "wsd" else SKIP),
    Field("data.seq_len", "dataset", "seq_length", T, lambda bp: bp.data.seq_len),
    Field("training.seed", "dataset", "random_seed", T, lambda bp: bp.training.seed),
    Field("training.checkpoint_interval", "checkpoint", "save_interval", T,
          lambda bp: bp.training.checkpoint_interval),
    Field("training.seed", "rng", "seed", T, lambda bp: bp.training.seed),
)
# fmt: on


def fields() -> tuple[Field, ...]:
    """Every row of the mapping: the model's, each registered layer type's (those the pattern
    does not use give nothing), then the run's."""
    by_name = sorted(LAYER_TYPES.values(), key=lambda kind: kind.name)
    model = [row.row() if isinstance(row, Required) else row for row in _MODEL_FIELDS]
    own = [_layer_field(kind, f) for kind in by_name for f in kind.megatron_fields or ()]
    return (*(row for row in model if row is not None), *own, *_RUN_FIELDS)


def _quant_recipe(bp: Blueprint) -> Any:
    """quant_recipe.yaml (``factory.exports.quant_recipe``) when some module leaves the preset's
    format; the refusals report a table it cannot say."""
    try:
        return (
            Call(QUANT_RECIPE_LOADER, QUANT_RECIPE_FILE)
            if megatron_quant_recipe(bp).modules
            else SKIP
        )
    except QuantRecipeError:
        return SKIP


def _mtp_in_bf16(bp: Blueprint) -> Any:
    quantized = recipe_named(bp.precision.recipe).quantizes and bp.model.mtp_depth
    return True if quantized and mtp_formats(bp) == {HIGH_PRECISION} else SKIP


def megatron_fields(bp: Blueprint) -> dict[str, dict[str, Any]]:
    """Section -> field -> value, for every field of :func:`fields` that applies to ``bp``."""
    out: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for field in fields():
        value = field.get(bp)
        if value is not SKIP:
            out[field.section][field.name] = value
    return out


def stage_fields(
    bp: Blueprint, start: int, schedule_offset: int, schedule_steps: int
) -> dict[str, dict[str, Any]]:
    """:func:`megatron_fields` of one stage of a program, whose Megatron run starts at
    iteration ``start`` (0 for the first stage and for one Bridge fine-tunes from the checkpoint
    before; the iteration the stage before ended at when it resumes it) and whose learning-rate
    schedule is at step ``schedule_offset`` of ``schedule_steps`` there.

    Megatron counts ``train_iters`` and the scheduler's warmup and decay in iterations of the
    run, so the schedule's iteration 0 lies ``start - schedule_offset`` iterations into it
    (``megatron_refusals.program_refusals`` refuses a schedule that would start elsewhere than
    Megatron's iteration 0 and is not constant). An SFT stage reads Bridge's
    ``FinetuningDatasetConfig``, whose seed field is ``seed``."""
    out = megatron_fields(bp)
    schedule = bp.training.schedule
    shift = start - schedule_offset
    out["train"]["train_iters"] = start + bp.training_steps
    out["scheduler"]["lr_warmup_iters"] = round(schedule_steps * schedule.warmup_fraction)
    out["scheduler"]["lr_decay_iters"] = shift + schedule_steps
    if schedule.kind == "wsd":
        out["scheduler"]["lr_wsd_decay_iters"] = round(schedule_steps * schedule.decay_fraction)
    if objective(bp)[0] == "sft":
        out["dataset"] = {"seq_length": bp.data.seq_len, "seed": bp.training.seed}
    return out


def run_starts(program: Program) -> list[int]:
    """Per stage, the iteration its Megatron run starts at: 0 for the first stage and for a
    stage that does not carry the optimizer (Bridge fine-tunes from the checkpoint before:
    ``finetune`` resets the iteration), else the iteration the stage before ended at (Bridge
    resumes that checkpoint: optimizer, scheduler, iteration and consumed samples)."""
    starts: list[int] = []
    for stage in program:
        if stage.index == 0 or not stage.carry.optimizer:
            starts.append(0)
        else:
            before = program.stages[stage.index - 1]
            starts.append(starts[-1] + before.steps)
    return starts
