"""``factory export megatron`` of a program: one Megatron-Bridge recipe per stage, chained by
checkpoint, torch-free.

``OUT/<stage>/`` holds what the one-stage export writes (``recipe.py``, ``overrides.yaml``,
``launch.sh``, ``README.md``, ``hf/``, ``quant_recipe.yaml`` where the stage needs it);
``OUT/README.md`` lists the chain and ``OUT/launch.sh`` runs the stages in order.
``factory.exports.megatron.export_megatron`` writes this for a blueprint with ``stages``; one
without exports exactly as before.

Why one recipe per stage and not one recipe with phase transitions: Megatron-LM's
``--phase-transition-iterations`` (``megatron/training``, which neither megatron-core 0.16.1's
package nor Megatron-Bridge 0.3.1 ships) saves a checkpoint and exits at each boundary and an
outer script relaunches with the next phase's ``--data-path``, so it is a chain of runs too,
one blend at one layout, sequence length and batch size each; Bridge has no such field at all.
A stage is therefore one Bridge run:

* a pretraining stage is a pretrain config (``GPTDatasetConfig``), run by ``pretrain``;
* an SFT stage (``training.objective.kind: sft``) is a finetune config: Bridge's
  ``FinetuningDatasetConfig`` with ``PackedSequenceSpecs`` packing to the stage's
  ``data.seq_len``, run by ``finetune``;
* each stage after the first saves into its own checkpoint folder and starts from the folder
  of the stage before. Without ``carry.optimizer`` it names it ``pretrained_checkpoint``:
  Bridge loads the weights only, with ``finetune`` semantics (no optimizer or RNG state,
  iteration 0), while its own folder holds no checkpoint, then resumes its own. With
  ``carry.optimizer`` it loads the stage before's checkpoint whole (optimizer, scheduler,
  iteration, consumed samples) until its own folder holds one, and continues the run's
  iteration count; its scheduler values are the recipe's (``override_opt_param_scheduler``).

What a chain cannot say (a schedule that restarts inside a resumed run, a per-conversation
loss average, ...) is refused by ``megatron_refusals.program_refusals``, naming the stage's
field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import yaml

from factory.exports.hf_config import ExportError, hf_config
from factory.exports.megatron_fields import (
    BRIDGE_COMMIT,
    MEGATRON_CORE_VERSION,
    SECTIONS,
    megatron_fields,
    objective,
    run_starts,
    stage_fields,
)
from factory.exports.megatron_recipe import (
    _EXTRA_CLASSES,
    EXTRA_KEYWORDS,
    RecipeShape,
    launch_sh,
    overrides_yaml,
    recipe_source,
)
from factory.exports.megatron_refusals import (
    MegatronExportError,
    not_carried,
    program_refusals,
    stage_refusals,
)
from factory.exports.quant_recipe import QUANT_RECIPE_FILE, megatron_quant_recipe
from factory.io import staged_directory
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program, ProgramStage

__all__ = ["stage_recipe_shape", "write_program"]

FINETUNE_DATASET = ("megatron.bridge.training.config", "FinetuningDatasetConfig")
PACKED_SPECS = ("megatron.bridge.data.datasets.packed_sequence", "PackedSequenceSpecs")
# Bridge's checkpoint_exists (training/utils/checkpoint_utils.py) looks for these trackers.
_RESUMES = '''

def _resumes(directory: str) -> bool:
    """Whether Bridge resumes from ``directory``: a tracker its checkpoint_exists reads."""
    return any(
        (Path(directory) / tracker).is_file()
        for tracker in ("latest_train_state.pt", "latest_checkpointed_iteration.txt")
    )
'''
# The layout a distributed optimizer's checkpoint is resharded across only when Bridge saves
# it fully reshardable (dist_ckpt_optim_fully_reshardable; data parallelism alone it always is).
_MODEL_PARALLEL = ("tp", "pp", "cp", "ep", "expert_tp")


def _ident(text: str) -> str:
    return re.sub(r"\W", "_", text).strip("_").lower()


def _checkpoint_dir(bp: Blueprint, stage: ProgramStage) -> str:
    return f"checkpoints/{bp.meta.name}/{stage.name}"


def _data_path(stage: ProgramStage) -> str:
    # factory data builds a program's stage into DATA/<stage>/, its prefixes under megatron/.
    name = Path(stage.blueprint.data.recipe).stem
    return f"data/{stage.name}/megatron/{name}"


def _is_sft(stage: ProgramStage) -> bool:
    return objective(stage.blueprint)[0] == "sft"


def _reshards_optimizer(stage: ProgramStage, after: ProgramStage | None) -> bool:
    """Whether the stage after resumes this stage's optimizer on another model-parallel
    layout."""
    if after is None or not after.carry.optimizer:
        return False
    here, there = stage.blueprint.parallelism, after.blueprint.parallelism
    return any(getattr(here, name) != getattr(there, name) for name in _MODEL_PARALLEL)


def stage_recipe_shape(bp: Blueprint, program: Program, stage: ProgramStage) -> RecipeShape:
    """``recipe.py`` of one stage of ``bp``'s program."""
    start = run_starts(program)[stage.index]
    own = stage.blueprint
    fields = stage_fields(own, start, stage.schedule_offset, stage.schedule_steps)
    keywords = {section: dict(values) for section, values in EXTRA_KEYWORDS.items()}
    classes = {**SECTIONS, **_EXTRA_CLASSES}
    imports: list[tuple[str, str]] = []
    helpers = ""
    before = program.stages[stage.index - 1] if stage.index else None
    after = program.stages[stage.index + 1] if stage.index + 1 < len(program) else None
    if _is_sft(stage):
        classes["dataset"] = FINETUNE_DATASET
        cp = own.parallelism.cp
        keywords["dataset"] = {
            "dataset_root": "dataset_root",
            # Bridge packs whole conversations to packed_sequence_size; under context
            # parallelism each is padded to a multiple of 2 * CP (its Nemotron-3 SFT recipe).
            "packed_sequence_specs": f"{PACKED_SPECS[1]}(packed_sequence_size="
            f"{own.data.seq_len}, pad_seq_to_mult={2 * cp if cp > 1 else 1})",
            # The tokenizer's own chat template renders the turns; the loss is on the
            # assistant's (GPTSFTChatDataset).
            "dataset_kwargs": "{'chat': True, 'use_hf_tokenizer_chat_template': True}",
            "do_validation": "False",
            "do_test": "False",
        }
        imports.append(PACKED_SPECS)
        data_param = f"dataset_root: str = {f'data/{stage.name}/bridge'!r}"
        prologue: tuple[str, ...] = ()
        data_doc = "dataset_root holds Bridge's training.jsonl"
    else:
        data_param = "data_paths: list[str] | None = None"
        prologue = (f"data_paths = data_paths or [{_data_path(stage)!r}]",)
        data_doc = "data_paths are indexed-dataset prefixes"
    params = [data_param, f'checkpoint_dir: str = "{_checkpoint_dir(bp, stage)}"']
    if before is not None:
        params.append(f'previous_checkpoint: str = "{_checkpoint_dir(bp, before)}"')
        if stage.carry.optimizer:
            keywords["checkpoint"]["load"] = (
                "checkpoint_dir if _resumes(checkpoint_dir) else previous_checkpoint"
            )
            keywords["scheduler"] = {"override_opt_param_scheduler": "True"}
            imports.append(("pathlib", "Path"))
            helpers = _RESUMES
        else:
            keywords["checkpoint"]["pretrained_checkpoint"] = "previous_checkpoint"
    if _reshards_optimizer(stage, after):
        keywords["checkpoint"]["dist_ckpt_optim_fully_reshardable"] = "True"
    params.append(f"tokenizer: str = {bp.meta.hf_id or 'tokenizer'!r}")
    entry: Literal["pretrain", "finetune"] = "finetune" if _is_sft(stage) else "pretrain"
    kind = "SFT (finetune)" if entry == "finetune" else "pretraining"
    return RecipeShape(
        func_name=f"{_ident(bp.meta.name)}_{_ident(stage.name)}_{entry}_config",
        summary=f"{kind} recipe for stage {stage.name!r} ({stage.index + 1} of "
        f"{len(program)}) of {bp.meta.name}",
        fields=fields,
        keywords=keywords,
        classes=classes,
        params=tuple(params),
        prologue=prologue,
        doc=f"The ConfigContainer of stage {stage.name!r} of {bp.meta.name!r}; {data_doc}.",
        helpers=helpers,
        imports=tuple(imports),
        entry=entry,
    )


def _consumed(program: Program, stage: ProgramStage) -> int:
    """Samples Bridge counts as consumed when ``stage`` starts: those of the stages since the
    run's iteration count last started at 0."""
    count = 0
    for earlier in program.stages[: stage.index]:
        carried = earlier.index > 0 and earlier.carry.optimizer
        count = (
            count if carried else 0
        ) + earlier.steps * earlier.blueprint.parallelism.global_batch_size
    return count


def _data_position(program: Program, stage: ProgramStage) -> str:
    consumed = _consumed(program, stage)
    if stage.carry.data_position:
        return (
            f"- the data position carries: Bridge resumes the consumed-sample count and reads "
            f"on from sample {consumed}."
        )
    return (
        "- Bridge resumes the consumed-sample count with it, so the stage reads its own "
        f"mixture from sample {consumed} on, not from its start (Megatron-LM's phase "
        "transitions restart it at 0; Bridge has none)."
    )


def _how_it_starts(program: Program, stage: ProgramStage, start: int) -> list[str]:
    if stage.index == 0:
        return ["- from initialised weights (the program's first stage)."]
    before = program.stages[stage.index - 1]
    if not stage.carry.optimizer:
        lines = [
            f"- from the weights of stage `{before.name}` (`previous_checkpoint`, Bridge's "
            "`pretrained_checkpoint`): a fine-tune, so a fresh optimizer at iteration 0."
        ]
    else:
        lines = [
            f"- from the whole checkpoint of stage `{before.name}` (`previous_checkpoint`): "
            f"optimizer, scheduler and RNG state; Megatron's iteration goes on from {start} to "
            f"{start + stage.steps}.",
            _data_position(program, stage),
        ]
    lines.append("- once its own `checkpoint_dir` holds a checkpoint, Bridge resumes that one.")
    return lines


def _stage_readme(
    bp: Blueprint,
    program: Program,
    stage: ProgramStage,
    shape: RecipeShape,
    unexpressed: list[tuple[str, str]],
    hf_note: str,
) -> str:
    start = run_starts(program)[stage.index]
    own = stage.blueprint
    sft = shape.entry == "finetune"
    lines = [
        f"# {bp.meta.name}: stage `{stage.name}` ({stage.index + 1} of {len(program)}), "
        "Megatron-Bridge export",
        "",
        f"Written by `factory export megatron`; megatron-core {MEGATRON_CORE_VERSION}, "
        f"Megatron-Bridge {BRIDGE_COMMIT[:7]}. {stage.steps} steps at sequence length "
        f"{own.data.seq_len}, global batch {own.parallelism.global_batch_size}.",
        "",
        f"- `recipe.py`: `{shape.func_name}()` returns the ConfigContainer; run as a script it "
        f"calls Bridge's `{shape.entry}`.",
        "- `overrides.yaml`: the same blueprint-derived values as OmegaConf YAML.",
        "- `launch.sh`: torchrun (set NODES, NODE_RANK, MASTER_ADDR) or srun under Slurm.",
        f"- `hf/`: {hf_note}",
    ]
    if sft:
        lines.append(
            f"- data: Bridge's `FinetuningDatasetConfig` reads `training.jsonl` (conversations) "
            f"under `dataset_root` and packs whole conversations to {own.data.seq_len} tokens "
            f"itself, rendering them with the tokenizer's chat template (recipe "
            f"{own.data.recipe!r} says what they are; factory's own shards are not read)."
        )
    else:
        lines.append(
            f"- data: indexed-dataset prefix `{_data_path(stage)}` from `factory data` (recipe "
            f"{own.data.recipe!r}); pass others as `data_paths`."
        )
    lines += ["", "## How it starts", "", *_how_it_starts(program, stage, start)]
    lines += ["", "## Not expressed in Megatron (refused unless --allow-unexpressed)", ""]
    lines += [f"- `{p}`: {why}" for p, why in unexpressed] or ["- none"]
    lines += ["", "## Not carried (factory runtime only)", ""]
    lines += [f"- `{p}`: {why}" for p, why in not_carried(own)]
    return "\n".join(lines) + "\n"


def _index_readme(bp: Blueprint, program: Program, unexpressed: list[tuple[str, str]]) -> str:
    starts = run_starts(program)
    lines = [
        f"# {bp.meta.name}: Megatron-Bridge export of a {len(program)}-stage program",
        "",
        "One Bridge recipe per stage, chained by checkpoint: each stage after the first starts "
        "from the checkpoint of the stage before (`OUT/<stage>/README.md`, 'How it starts'). "
        "`launch.sh` runs them in order from one working directory, where the recipes' "
        "`checkpoints/` and `data/` paths are resolved.",
        "",
        "| # | stage | recipe | Bridge entry | steps | Megatron iterations | seq_len | "
        "starts from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage, start in zip(program, starts, strict=True):
        entry = "finetune" if _is_sft(stage) else "pretrain"
        if stage.index == 0:
            source = "initialised weights"
        else:
            before = program.stages[stage.index - 1].name
            how = "whole checkpoint" if stage.carry.optimizer else "weights, a fine-tune"
            source = f"`{before}`: {how}"
        lines.append(
            f"| {stage.index + 1} | `{stage.name}` | `{stage.name}/recipe.py` | {entry} | "
            f"{stage.steps} | {start}-{start + stage.steps} | {stage.blueprint.data.seq_len} | "
            f"{source} |"
        )
    lines += ["", "## Not expressed in Megatron (refused unless --allow-unexpressed)", ""]
    lines += [f"- `{p}`: {why}" for p, why in unexpressed] or ["- none"]
    return "\n".join(lines) + "\n"


def _chain_launch(program: Program) -> str:
    runs = "".join(f'"$HERE/{stage.name}/launch.sh" "$@"\n' for stage in program)
    return f"""#!/usr/bin/env bash
# The program's stages in order; each resumes its own checkpoint if it has one.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
{runs}"""


def write_program(bp: Blueprint, program: Program, out: Path, allow_unexpressed: bool) -> Path:
    """Write ``out`` atomically: one recipe folder per stage of ``bp``'s ``program``, the
    chain's README and launch.sh (``factory.exports.megatron.export_megatron`` calls this for
    a blueprint with ``stages``); raises MegatronExportError for refusals, each at the path
    the blueprint file writes it."""
    unexpressed = program_refusals(program)
    if unexpressed and not allow_unexpressed:
        raise MegatronExportError(unexpressed)
    with staged_directory(out) as tmp:
        for stage in program:
            own = stage.blueprint
            folder = tmp / stage.name
            folder.mkdir()
            try:
                hf = hf_config(own, dtype="bfloat16")
                hf_note = (
                    "`config.json` for Hugging Face NemotronH (`factory export hf` adds weights)."
                )
            except ExportError as exc:
                hf, hf_note = None, f"not written: {exc}"
            shape = stage_recipe_shape(bp, program, stage)
            mine = stage_refusals(stage, run_starts(program)[stage.index])
            (folder / "recipe.py").write_text(recipe_source(own, shape))
            (folder / "overrides.yaml").write_text(overrides_yaml(own, shape.fields))
            (folder / "launch.sh").write_text(launch_sh(own))
            (folder / "launch.sh").chmod(0o755)
            (folder / "README.md").write_text(
                _stage_readme(bp, program, stage, shape, mine, hf_note)
            )
            if "quant_recipe" in megatron_fields(own)["model"]:
                document = megatron_quant_recipe(own).document
                (folder / QUANT_RECIPE_FILE).write_text(yaml.safe_dump(document, sort_keys=False))
            if hf is not None:
                (folder / "hf").mkdir()
                (folder / "hf" / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / "README.md").write_text(_index_readme(bp, program, unexpressed))
        (tmp / "launch.sh").write_text(_chain_launch(program))
        (tmp / "launch.sh").chmod(0o755)
    return out
