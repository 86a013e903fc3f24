"""Rules on a program's stages together (``factory.checks.registry.program_rule``).

Each stage's own blueprint passes every rule already (``factory.checks.validate``); these
ask what only a stage's place in the program says.
"""

from __future__ import annotations

from collections.abc import Iterator

from factory.checks.data_rules import recipe_of, stated_tokens
from factory.checks.registry import Finding, StageFinding, program_rule
from factory.schemas.program import Program

__all__: list[str] = []


@program_rule("stages.recipe_seq_len")
def recipe_packs_to_the_stage(program: Program) -> Iterator[StageFinding]:
    """A stage's recipe that states a packing length states the stage's sequence length."""
    if not program.declared:
        return  # one stage: the blueprint's data.seq_len decides, as it always has
    for stage in program:
        read = recipe_of(stage.blueprint)
        if read is None or read.recipe is None or read.source_map is None:
            continue
        recipe, seq_len = read.recipe, stage.blueprint.data.seq_len
        stated = (
            "packing" in recipe.model_fields_set and "seq_len" in recipe.packing.model_fields_set
        )
        if not stated or recipe.packing.seq_len == seq_len:
            continue
        file, line = read.source_map.locate("packing.seq_len")
        yield (
            stage.index,
            Finding(
                "data.recipe",
                f"recipe {stage.blueprint.data.recipe!r} packs to {recipe.packing.seq_len:,} "
                f"tokens ({file}:{line}: packing.seq_len) but this stage trains at "
                f"data.seq_len {seq_len:,}: the build packs the stage's data at {seq_len:,}; "
                "name a recipe written for this stage, or make the two agree",
                "warning",
            ),
        )


@program_rule("data.recipe_epochs")
def recipe_epochs(program: Program) -> Iterator[StageFinding]:
    """A stage training on more tokens than its recipe's mixture holds repeats it: say how
    often (counting the stages before it whose data position it carries on from)."""
    read_so_far = 0  # tokens read from the mixture up to this stage, from its first reader
    for stage in program:
        bp = stage.blueprint
        trained = bp.training_steps * bp.tokens_per_step
        carried = read_so_far if stage.index and stage.carry.data_position else 0
        read_so_far = carried + trained
        read = recipe_of(bp)
        holds = None if read is None or read.recipe is None else stated_tokens(read.recipe)
        if not holds or read_so_far <= holds:
            continue
        before = f", after {carried:,} read by the stages before" if carried else ""
        yield (
            stage.index,
            Finding(
                "data.recipe",
                f"{read_so_far / holds:.2f} epochs over the curated mixture: "
                f"{bp.training_steps:,} steps of {bp.tokens_per_step:,} tokens{before} read "
                f"{read_so_far:,} tokens from it and recipe {bp.data.recipe!r} states "
                f"{holds:,} (total_tokens and the sources' tokens); more data, or fewer steps, "
                "if repeating it is not the intent",
                "warning",
            ),
        )
