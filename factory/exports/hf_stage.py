"""``factory export hf`` of one stage: a program's blueprint or a run folder, torch-free.

A program's stages share one model, so the HF export of a blueprint's stage is the export of
that stage's blueprint (``ProgramStage.blueprint``); a run folder already holds each stage's
trained model as a Hugging Face checkpoint (the run-folder contract: ``RUN/program.json`` lists
the stages in order, ``RUN/<stage>/model/`` is one's export; a run without stages has its
``RUN/model/``; ``factory average`` adds ``averaged/<name>/model/`` beside a stage's
``model/``), which the export copies. The final stage is the default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from factory.errors import did_you_mean
from factory.exports.hf_config import ExportError
from factory.io import staged_directory
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import DEFAULT_STAGE, ProgramStage, resolve_program

__all__ = [
    "AVERAGED_DIR",
    "HF_FILES",
    "PROGRAM_FILE",
    "UnknownAverage",
    "UnknownStage",
    "copy_run_model",
    "is_run_folder",
    "stage_folder",
    "stage_of",
]

PROGRAM_FILE = "program.json"
AVERAGED_DIR = "averaged"
"""Where a run (a program's stage) keeps its averaged checkpoints: ``averaged/<name>/``."""
HF_FILES = ("config.json", "model.safetensors")
"""What a run's ``model/`` holds (``factory.exports.hf.write_hf_checkpoint``)."""


class UnknownStage(ExportError):
    """``--stage`` names no stage of the program."""


class UnknownAverage(ExportError):
    """``--averaged`` names no averaged checkpoint of the run."""


def _unknown(name: str, names: list[str]) -> UnknownStage:
    return UnknownStage(
        f"no stage {name!r}; the program has {', '.join(names)}{did_you_mean(name, names)}"
    )


def stage_of(bp: Blueprint, name: str | None) -> ProgramStage:
    """Stage ``name`` of ``bp``'s program (its final stage when None)."""
    program = resolve_program(bp)
    if name is None:
        return program.final
    if name not in program.names:
        raise _unknown(name, program.names)
    return program.stage(name)


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is a training's run folder (a program's, or one run's with a model)."""
    return (path / PROGRAM_FILE).is_file() or (path / "model" / HF_FILES[0]).is_file()


def _run_stages(run: Path) -> list[str]:
    if not (run / PROGRAM_FILE).is_file():
        return [DEFAULT_STAGE]
    try:
        document = json.loads((run / PROGRAM_FILE).read_text(encoding="utf-8"))
        return [entry["name"] for entry in document["stages"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{run / PROGRAM_FILE}: not a program's stage list ({exc})") from None


def stage_folder(run: Path, stage: str | None = None) -> tuple[str, Path]:
    """The name and run folder of ``stage`` (the final stage when None) of the run folder
    ``run``: ``RUN/<stage>/`` in a program's, ``RUN`` itself in a run without stages."""
    names = _run_stages(run)
    name = names[-1] if stage is None else stage
    if name not in names:
        raise _unknown(name, names)
    return name, run / name if (run / PROGRAM_FILE).is_file() else run


def copy_run_model(
    run: Path, out: Path, stage: str | None = None, averaged: str | None = None
) -> Path:
    """Copy the Hugging Face checkpoint the run folder ``run`` holds for ``stage`` (its final
    stage when None) to ``out``, atomically; returns the folder it came from. With
    ``averaged``, the export of that stage's averaged checkpoint ``averaged/<name>/model/``
    (``factory average``) instead of its trained model."""
    name, folder = stage_folder(run, stage)
    if averaged is None:
        source = folder / "model"
        missing = [file for file in HF_FILES if not (source / file).is_file()]
        if missing:
            raise ExportError(
                f"{source}: no {', '.join(missing)}: stage {name!r} has not finished training"
            )
    else:
        source = folder / AVERAGED_DIR / averaged / "model"
        if not all((source / file).is_file() for file in HF_FILES):
            kept = sorted(p.parent.name for p in (folder / AVERAGED_DIR).glob("*/model"))
            raise UnknownAverage(
                f"no averaged checkpoint {averaged!r} with a Hugging Face export in "
                f"{folder / AVERAGED_DIR}; there are {', '.join(kept) or 'none'}"
                f"{did_you_mean(averaged, kept)}"
            )
    with staged_directory(out) as staging:
        for file in HF_FILES:
            shutil.copyfile(source / file, staging / file)
    return source
