"""Rules on a program's stages together (``factory.checks.registry.program_rule``).

Each stage's own blueprint passes every rule already (``factory.checks.validate``); these
ask what only a stage's place in the program says.
"""

from __future__ import annotations

from collections.abc import Iterator

from factory.checks.data_rules import recipe_of
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
