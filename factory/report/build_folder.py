"""A ``factory build`` folder: its layout (the stages in the order they run, the files each
writes, ``build.json``), which the build job writes by, and reading it back for the build
page, where every file is optional since its stage may have been skipped. Light to import:
the CLI offers the stages without loading the build."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from factory.report.html_parts import note

__all__ = [
    "BUILD_RECORD", "OUTPUTS", "PROGRAM_PLAN", "STAGES", "BuildFolder", "StageInfo", "missing",
    "outputs",
]  # fmt: skip

STAGES = (
    "validate",
    "plan",
    "model",
    "precision",
    "export",
    "data",
    "smoke",
    "evaluate",
    "distributed",
    "report",
)
"""In the order they run; ``--skip`` takes these names."""

OUTPUTS: dict[str, tuple[str, ...]] = {
    "validate": ("resolved.yaml",),
    "plan": ("plan.json", "report.md", "search.json"),
    "model": ("model_check.json",),
    "precision": ("precision.json",),
    "export": ("exports",),
    "data": ("data",),
    "smoke": ("smoke",),
    "evaluate": ("evaluation.json",),
    "distributed": ("distributed", "distributed.json"),
    "report": ("report.html",),
}
"""What each stage writes in the build folder (and what a changed blueprint clears)."""

PROGRAM_PLAN = "program_plan.json"
"""A program's planned stages (a blueprint with ``stages``), written by the plan stage."""

PROGRAM_OUTPUTS: dict[str, tuple[str, ...]] = {"plan": (PROGRAM_PLAN,)}
"""What a stage writes besides :data:`OUTPUTS` when the blueprint is a program. Its data
and smoke run hold a folder per program stage (``data/<stage>/``, ``smoke/<stage>/``)."""


def outputs(stage: str, program: bool) -> tuple[str, ...]:
    """The files and folders ``stage`` writes, for a program or a single-stage blueprint."""
    return OUTPUTS[stage] + (PROGRAM_OUTPUTS.get(stage, ()) if program else ())


BUILD_RECORD = "build.json"
"""Every stage's status, time and result, rewritten as each stage ends."""


@dataclass(frozen=True)
class StageInfo:
    status: str
    """'done', 'skipped', 'failed', or 'not run' when build.json does not list the stage."""
    seconds: float | None
    result: str


def _json_view(relative: str) -> cached_property[dict[str, Any] | None]:
    """A folder's JSON file ``relative``, parsed on first use (``BuildFolder.read_json``)."""
    return cached_property(lambda folder: folder.read_json(relative))


@dataclass(frozen=True)
class BuildFolder:
    """A build folder and lazily parsed views of its files (None for a missing file)."""

    root: Path

    def path(self, relative: str) -> Path:
        return self.root / relative

    def exists(self, relative: str) -> bool:
        return self.path(relative).exists()

    def read_json(self, relative: str) -> Any | None:
        """The parsed file, or None when it is absent or not valid JSON (a stage cut short)."""
        try:
            return json.loads(self.path(relative).read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    @cached_property
    def build(self) -> dict[str, Any]:
        found = self.read_json(BUILD_RECORD)
        return found if isinstance(found, dict) else {}

    @property
    def name(self) -> str:
        return str(self.build.get("name") or self.root.name)

    def stage(self, name: str) -> StageInfo:
        stages = self.build.get("stages")
        entry = stages.get(name) if isinstance(stages, dict) else None
        if not isinstance(entry, dict):
            return StageInfo("not run", None, "")
        seconds = entry.get("seconds")
        return StageInfo(
            status=str(entry.get("status", "not run")),
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
            result=str(entry.get("result", "")),
        )

    plan = _json_view("plan.json")
    search = _json_view("search.json")
    precision = _json_view("precision.json")
    model_check = _json_view("model_check.json")
    manifest = _json_view("data/manifest.json")
    distributed = _json_view("distributed.json")
    evaluation = _json_view("evaluation.json")
    program_plan = _json_view(PROGRAM_PLAN)

    @property
    def program(self) -> bool:
        """Whether the build is of a program (the plan stage wrote its stages)."""
        return self.program_plan is not None or bool(self.stage_names())

    def program_records(self, stage: str) -> dict[str, Any]:
        """Per program stage, what build stage ``stage`` recorded of it in build.json."""
        stages = self.build.get("stages")
        entry = stages.get(stage) if isinstance(stages, dict) else None
        found = entry.get("program") if isinstance(entry, dict) else None
        return found if isinstance(found, dict) else {}

    def stage_names(self) -> list[str]:
        """The program's stages in order: as planned, else as the data or smoke stage
        recorded them (none for a single-stage build)."""
        plan = self.program_plan
        if isinstance(plan, dict) and isinstance(plan.get("stages"), list):
            return [str(s["name"]) for s in plan["stages"]]
        return list(self.program_records("data") or self.program_records("smoke"))

    def stage_manifest(self, stage: str) -> dict[str, Any] | None:
        """The curated data's manifest of one program stage."""
        found = self.read_json(f"data/{stage}/manifest.json")
        return found if isinstance(found, dict) else None

    @cached_property
    def resolved(self) -> dict[str, Any] | None:
        """``resolved.yaml`` as plain data (its header comment is YAML's too)."""
        try:
            data = yaml.safe_load(self.path("resolved.yaml").read_text(encoding="utf-8"))
        except (FileNotFoundError, yaml.YAMLError):
            return None
        return data if isinstance(data, dict) else None

    def files(self) -> list[Path]:
        """Every file under the folder, relative to it, sorted; the report itself left out."""
        found = [p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file()]
        return sorted(p for p in found if p != Path("report.html") and not _hidden(p))


def _hidden(path: Path) -> bool:
    """Temporary files and folders of atomic writes (``.name.XXXX.tmp``)."""
    return any(part.startswith(".") and part.endswith(".tmp") for part in path.parts)


def missing(folder: BuildFolder, stage: str, what: str) -> str:
    """The note a section shows when its stage left nothing: why, from build.json."""
    info = folder.stage(stage)
    why = f": {info.result}" if info.result else ""
    kind = "failed" if info.status == "failed" else "skipped"
    return note(
        f"No {what}: the {stage} stage {info.status.replace('done', 'finished')}{why}.", kind
    )
