"""What the stages of one build read, whichever executor runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from factory.data.stages.curate import UnitTask
from factory.data.steps.tokenize import DocumentTokenizer
from factory.schemas.data_recipe import DataRecipe

__all__ = ["StageInputs"]


@dataclass(frozen=True)
class StageInputs:
    """The recipe, the output folder, one curate task per input file (in canonical order:
    sources as listed, files sorted) and the tokenizer."""

    recipe: DataRecipe
    out: Path
    tasks: list[UnitTask]
    tokenizer: DocumentTokenizer
    units: dict[str, list[Path]] = field(init=False)
    """Each source's units (its tasks' output files), by source name."""

    def __post_init__(self) -> None:
        units = {source.name: [] for source in self.recipe.sources}
        for task in self.tasks:
            units[self.recipe.sources[task.source_index].name].append(task.output_path)
        object.__setattr__(self, "units", units)

    @property
    def order(self) -> list[Path]:
        """Every unit in canonical order: the order dedup visits them."""
        return [task.output_path for task in self.tasks]

    @property
    def work(self) -> Path:
        """The intermediates' folder (kept for resume)."""
        return self.out / ".work"
