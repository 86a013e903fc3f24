"""What a blueprint has that a Megatron-Bridge recipe cannot express, torch-free.

Two kinds. ``refusals`` change the model or its numerics if dropped, so the
export stops and names each (path, reason); ``--allow-unexpressed`` turns them
into README entries instead. ``not_carried`` is what factory does around
training that Megatron has no field for (stability monitors, rollback): always
listed in the README, never silently dropped. Checked against megatron-core
0.16.1 and Megatron-Bridge ``HybridModelProvider`` (``megatron_fields``).
"""

from __future__ import annotations

import re

from factory.exports.hf_config import ExportError
from factory.exports.megatron_fields import (
    objective,
    pipeline_stage_sizes,
    run_starts,
    shared_field_conflicts,
)
from factory.exports.quant_recipe import QuantRecipeError, megatron_quant_recipe, mtp_formats
from factory.schemas.blueprint import Blueprint
from factory.schemas.precision_recipes import HIGH_PRECISION, recipe_named
from factory.schemas.program import Program, ProgramStage
from factory.spec.layer_type import LAYER_TYPES

__all__ = [
    "MegatronExportError",
    "not_carried",
    "program_refusals",
    "refusals",
    "stage_refusals",
]


class MegatronExportError(ExportError):
    """The blueprint has fields a Megatron recipe cannot express; ``fields`` names them."""

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self.fields = fields
        lines = "\n".join(f"  {path}: {why}" for path, why in fields)
        super().__init__(f"cannot export to Megatron-Bridge:\n{lines}")


def _megatron_cuts(sizes: list[int], total: int) -> list[int]:
    """Stage sizes Megatron builds from first/last stage sizes and an even middle
    (``MambaStack._select_layers_for_pipeline_parallel``)."""
    pp = len(sizes)
    if len(set(sizes)) == 1:
        return [total // pp] * pp
    middle = pp - 2
    per_middle = (total - sizes[0] - sizes[-1]) // middle if middle > 0 else 0
    return [sizes[0], *([per_middle] * middle), sizes[-1]]


def _model(bp: Blueprint) -> list[tuple[str, str]]:
    m, out = bp.model, []
    used = m.parsed_pattern.main + m.mtp_pattern
    if m.position_embedding == "rope" and m.rope_base != int(m.rope_base):
        out.append(("model.rope_base", f"Megatron's rotary_base is an int, got {m.rope_base}"))
    out += shared_field_conflicts(bp)
    for kind in LAYER_TYPES.values():
        if kind.symbol in used:
            out += kind.megatron_refusals(m)
    if len(set(m.parsed_pattern.mtp)) > 1:
        out.append(
            (
                "model.pattern",
                "MTP depths with different inner patterns; Megatron-Bridge "
                "repeats one mtp_hybrid_override_pattern",
            )
        )
    if m.init.checkpoint:
        out.append(
            (
                "model.init.checkpoint",
                "a Hugging Face checkpoint must first be converted "
                "(Megatron-Bridge AutoBridge.import_ckpt), then set "
                "checkpoint.pretrained_checkpoint",
            )
        )
    if m.init.upcycle_from:
        out.append(("model.init.upcycle_from", "dense-to-MoE upcycling is not a recipe field"))
    return out


def _layout(bp: Blueprint) -> list[tuple[str, str]]:
    par, parsed, out = bp.parallelism, bp.model.parsed_pattern, []
    vpp = par.vpp or (len(parsed.segments) // par.pp if parsed.has_pipes else 1)
    if vpp > 1:
        out.append(
            (
                "parallelism.vpp",
                f"virtual pipeline stages ({vpp}) are unsupported by "
                "Megatron's hybrid model (MambaStack and HybridModelProvider assert it)",
            )
        )
    elif par.pp > 1:
        sizes = pipeline_stage_sizes(bp)
        if not sizes:
            out.append(
                (
                    "parallelism.pp",
                    f"{parsed.num_layers} layers do not split evenly "
                    f"over pp={par.pp} and the pattern has no '|'",
                )
            )
        elif _megatron_cuts(sizes, parsed.num_layers) != sizes:
            out.append(
                (
                    "model.pattern",
                    f"pipeline cuts {sizes}: Megatron can only make the "
                    "first and last stages differ from an even middle",
                )
            )
    if par.modules:
        out.append(
            (
                "parallelism.modules",
                "heterogeneous per-module grids are not a ConfigContainer field",
            )
        )
    return out


def _precision(bp: Blueprint) -> list[tuple[str, str]]:
    p, out = bp.precision, []
    recipe = recipe_named(p.recipe)
    if recipe.megatron is None:
        out.append(("precision.recipe", f"{recipe.title} has no Megatron recipe"))
    out += recipe.megatron_refusals(p)
    if p.high_precision.layers:
        out.append(
            (
                "precision.high_precision.layers",
                "Megatron keeps only the first and last "
                f"N layers in BF16, not {p.high_precision.layers}",
            )
        )
    if p.overrides:  # per-module formats become megatron-core's quant_recipe
        try:
            megatron_quant_recipe(bp)
        except QuantRecipeError as exc:
            out += [(f"precision.overrides: {path}", why) for path, why in exc.problems]
        mtp = mtp_formats(bp)
        if mtp and mtp not in ({p.recipe}, {HIGH_PRECISION}):
            out.append(
                (
                    "precision.overrides (MTP layers)",
                    f"MTP GEMMs in {sorted(mtp)}: Megatron runs MTP in the preset's format "
                    "or all in BF16 (keep_mtp_spec_in_bf16)",
                )
            )
    if p.switch_to_bf16 is not None:
        out.append(("precision.switch_to_bf16", "Megatron has no mid-run switch to BF16"))
    return out


def refusals(bp: Blueprint) -> list[tuple[str, str]]:
    """(blueprint path, reason) for each thing a Megatron recipe cannot express."""
    return _model(bp) + _layout(bp) + _precision(bp)


_DOTTED_HEAD = re.compile(r"^[A-Za-z0-9_.\[\]']+")


def _located(stage: ProgramStage, path: str) -> str:
    """``path`` of the stage's blueprint where the file writes it; the words after a dotted
    path (``precision.overrides: *.mixer.k_proj``) are kept."""
    head = _DOTTED_HEAD.match(path)
    if head is None:
        return path
    return stage.document_path(head.group()) + path[head.end() :]


def _shift_invariant(stage: ProgramStage) -> bool:
    """A schedule whose rate does not depend on where it starts: constant, no warmup."""
    schedule = stage.blueprint.training.schedule
    return (
        schedule.kind == "constant" and round(stage.schedule_steps * schedule.warmup_fraction) == 0
    )


def _chain(stage: ProgramStage, start: int) -> list[tuple[str, str]]:
    """What the checkpoint chain into ``stage`` cannot say in Bridge."""
    out: list[tuple[str, str]] = []
    where = f"stages[{stage.index}]"
    carried = stage.index > 0 and stage.carry.optimizer
    if start != stage.schedule_offset and not _shift_invariant(stage):
        kind = stage.blueprint.training.schedule.kind
        if carried:
            out.append(
                (
                    f"{where}.carry.optimizer",
                    f"stage {stage.name!r} resumes the optimizer, so Bridge continues the run at "
                    f"iteration {start}, where Megatron's scheduler (counting from the run's "
                    f"iteration 0) cannot start the stage's own {kind} schedule; carry no "
                    "optimizer (Bridge's finetune) or make the schedule constant without warmup",
                )
            )
        else:
            out.append(
                (
                    f"{where}.continue_schedule",
                    f"stage {stage.name!r} goes on with the schedule at its step "
                    f"{stage.schedule_offset}, but without the optimizer Bridge fine-tunes "
                    "from the checkpoint before (pretrained_checkpoint), and a fine-tune's "
                    "scheduler starts at iteration 0; carry the optimizer or start a schedule",
                )
            )
    if stage.index > 0 and stage.carry.data_position and not stage.carry.optimizer:
        out.append(
            (
                f"{where}.carry.data_position",
                f"stage {stage.name!r} fine-tunes from the checkpoint before (no optimizer), "
                "and Bridge's finetune resets the consumed samples; carry the optimizer too",
            )
        )
    kind, average = objective(stage.blueprint)
    if kind == "sft":
        if average == "conversation":
            out.append(
                (
                    stage.document_path("training.objective.loss_average"),
                    f"stage {stage.name!r}: Megatron averages the loss per token "
                    "(calculate_per_token_loss) or per micro-batch, never per conversation",
                )
            )
        micro = stage.blueprint.parallelism.micro_batch_size
        if micro != 1:
            out.append(
                (
                    stage.document_path("parallelism.micro_batch_size"),
                    f"stage {stage.name!r}: Bridge trains packed sequences one per micro-batch "
                    f"(ConfigContainer.validate), not {micro}",
                )
            )
    return out


def stage_refusals(stage: ProgramStage, start: int) -> list[tuple[str, str]]:
    """(path in the blueprint file, reason) for what one stage's recipe cannot express: its
    blueprint's :func:`refusals`, placed where the file writes the value, and what the
    checkpoint chain into it cannot say; its Megatron run starts at iteration ``start``
    (``megatron_fields.run_starts``)."""
    located = [(_located(stage, path), why) for path, why in refusals(stage.blueprint)]
    return located + _chain(stage, start)


def program_refusals(program: Program) -> list[tuple[str, str]]:
    """Every stage's :func:`stage_refusals`, once each (a value of the base that every stage
    keeps is refused once, at the base's path)."""
    out: dict[tuple[str, str], None] = {}
    for stage, start in zip(program, run_starts(program), strict=True):
        out.update(dict.fromkeys(stage_refusals(stage, start)))
    return list(out)


def not_carried(bp: Blueprint) -> list[tuple[str, str]]:
    """What factory does around the run that the recipe leaves to the operator."""
    out = [
        (
            "training.stability",
            "loss/grad spike, MaxVio, residual-RMS and non-finite monitors "
            "with rollback are factory's runtime; Megatron only logs (check_for_nan_in_loss_and_"
            "grad stops on NaN)",
        ),
        (
            "data.recipe",
            f"the curated mixture {bp.data.recipe!r} is built by `factory data`; "
            "the recipe reads its megatron/ indexed files",
        ),
        ("parallelism.gpu", f"{bp.parallelism.gpu}: used by factory's planner only"),
        (
            "training.cluster",
            "MFU, failure rate, restart time and checkpoint bandwidths: factory's cost and "
            "failure plan only (docs/cost.md)",
        ),
    ]
    if bp.training.average is not None:
        out.append(
            (
                "training.average",
                "the moving average of the weights is factory's trainer's; Megatron-Bridge "
                "keeps none (average its checkpoints after the run)",
            )
        )
    trackers = [name for name in bp.training.loggers if name != "jsonl"]
    if trackers:
        out.append(
            (
                "training.loggers",
                f"{', '.join(trackers)}: factory's trainer writes them; for Megatron set "
                "Bridge's LoggerConfig (tensorboard_dir, wandb_project) in the recipe",
            )
        )
    return out
