"""A blueprint as a program: each stage resolved into the whole blueprint it trains with.

Stage ``i`` is the blueprint with the changes of stages ``0..i`` merged in order, so a stage
states only what differs from the one before (``factory.schemas.stage``). Merging works on
what the author wrote (``model_dump(exclude_unset=True)``), not on filled-in defaults, so a
default one section derives from another (a layout's data-parallel size from its world
size) is derived again in the stage that changes the other. The result is a plain
single-stage :class:`Blueprint` per stage, which every planner, check, trainer and export
takes as it always has.

A blueprint without ``stages`` is a program of one implicit stage, :data:`DEFAULT_STAGE`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from factory.deep_merge import deep_merge
from factory.dotted_paths import join_path, parent_path
from factory.schemas.blueprint import Blueprint
from factory.schemas.stage import StageCarry

__all__ = [
    "DEFAULT_STAGE",
    "Program",
    "ProgramStage",
    "StageInvalid",
    "document_path",
    "resolve_program",
]

DEFAULT_STAGE = "train"
"""The name of the one stage of a blueprint without ``stages``."""

_SCHEDULE_FIELDS = ("optimizer", "schedule")


@dataclass(frozen=True)
class ProgramStage:
    """One stage, resolved: its whole blueprint and its place in the program."""

    name: str
    index: int
    blueprint: Blueprint
    """The stage's whole configuration (no ``stages`` of its own)."""
    carry: StageCarry
    schedule_offset: int
    """Steps of this stage's learning-rate schedule that earlier stages took."""
    schedule_steps: int
    """Steps the schedule spans: this stage's and every stage it continues or that continues
    it."""
    declared: bool
    """False for the implicit stage of a blueprint without ``stages``."""
    set_paths: tuple[frozenset[str], ...] = ()
    """Per stage up to this one, the dotted paths it wrote (where findings are reported)."""

    @property
    def steps(self) -> int:
        return self.blueprint.training_steps

    def document_path(self, path: str) -> str:
        """Where in the blueprint file ``path`` of this stage's blueprint was written."""
        return document_path(self.set_paths, path)


@dataclass(frozen=True)
class Program:
    """The stages a blueprint trains through, in order."""

    stages: tuple[ProgramStage, ...]

    def __iter__(self) -> Iterator[ProgramStage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def declared(self) -> bool:
        """Whether the blueprint lists its stages (False: the one implicit stage)."""
        return self.stages[0].declared

    @property
    def names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    def stage(self, name: str) -> ProgramStage:
        """The stage called ``name``; KeyError naming the known ones otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r}; the program has {', '.join(self.names)}")

    @property
    def final(self) -> ProgramStage:
        return self.stages[-1]


class StageInvalid(Exception):
    """A stage does not resolve: ``problems`` at paths of the blueprint file, or ``error``,
    the stage's merged blueprint's validation error, whose paths ``set_paths`` places."""

    def __init__(
        self,
        problems: list[tuple[str, str]] = (),  # type: ignore[assignment]
        error: ValidationError | None = None,
        set_paths: tuple[frozenset[str], ...] = (),
    ) -> None:
        self.problems = list(problems)
        self.error = error
        self.set_paths = set_paths
        super().__init__(str(error) if error is not None else str(self.problems))


def document_path(set_paths: tuple[frozenset[str], ...], path: str) -> str:
    """``path`` of stage ``len(set_paths) - 1``'s blueprint as the file writes it: under the
    latest stage that set it (or a value inside it), else the blueprint's own sections."""
    for index in range(len(set_paths) - 1, -1, -1):
        written = set_paths[index]
        probe = path
        while probe:
            if probe in written:
                return _under_stage(index, path)
            probe = parent_path(probe)
        if any(p.startswith((path + ".", path + "[")) for p in written):
            return _under_stage(index, path)
    return path


def _under_stage(index: int, path: str) -> str:
    return f"{join_path('stages', index)}.{path}" if path else join_path("stages", index)


def _without_alternatives(document: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``document`` without the fields a stage's changes replace by writing an alternative to
    them (a stage giving ``training.steps`` drops the ``training.tokens`` it inherits)."""
    out = dict(document)
    for name, section in changes.items():
        kind = Blueprint.model_fields[name].annotation
        groups = getattr(kind, "alternatives", ())
        inherited = out.get(name)
        if not isinstance(inherited, dict):
            continue
        for group in groups:
            if any(field in section for field in group):
                inherited = {k: v for k, v in inherited.items() if k not in group}
        out[name] = inherited
    return out


def _written_paths(prefix: str, node: Any) -> Iterator[str]:
    """The values a stage writes: leaves, not the sections holding them."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _written_paths(join_path(prefix, str(key)), value)
    else:
        yield prefix


def resolve_program(blueprint: Blueprint) -> Program:
    """Every stage's blueprint, carry and schedule window; :class:`StageInvalid` when a stage
    does not resolve into a valid blueprint or breaks a rule between stages."""
    if blueprint.stages is None:
        steps = blueprint.training_steps
        only = ProgramStage(DEFAULT_STAGE, 0, blueprint, StageCarry(), 0, steps, declared=False)
        return Program((only,))
    document = blueprint.model_dump(exclude_unset=True, exclude={"stages"})
    resolved: list[tuple[Blueprint, frozenset[str]]] = []
    set_paths: list[frozenset[str]] = []
    for index, stage in enumerate(blueprint.stages):
        changes = stage.overrides()
        _check_continuation(index, stage.continue_schedule, changes)
        set_paths.append(frozenset(p for k, v in changes.items() for p in _written_paths(k, v)))
        document = deep_merge(_without_alternatives(document, changes), changes)
        try:
            merged = Blueprint.model_validate(document)
        except ValidationError as exc:
            raise StageInvalid(error=exc, set_paths=tuple(set_paths)) from None
        if index and stage.carry.data_position:
            _check_data_position(index, resolved[-1][0], merged)
        resolved.append((merged, set_paths[-1]))
    return Program(_with_schedules(blueprint, resolved, tuple(set_paths)))


def _with_schedules(
    blueprint: Blueprint,
    resolved: list[tuple[Blueprint, frozenset[str]]],
    set_paths: tuple[frozenset[str], ...],
) -> tuple[ProgramStage, ...]:
    """Each stage with its offset in, and the length of, the schedule it belongs to."""
    assert blueprint.stages is not None
    segments: list[list[int]] = []
    for index, stage in enumerate(blueprint.stages):
        if stage.continue_schedule and segments:
            segments[-1].append(index)
        else:
            segments.append([index])
    out: list[ProgramStage] = []
    for segment in segments:
        total = sum(resolved[i][0].training_steps for i in segment)
        offset = 0
        for index in segment:
            stage, merged = blueprint.stages[index], resolved[index][0]
            out.append(
                ProgramStage(
                    stage.name,
                    index,
                    merged,
                    stage.carry,
                    offset,
                    total,
                    declared=True,
                    set_paths=set_paths[: index + 1],
                )
            )
            offset += merged.training_steps
    return tuple(out)


def _check_data_position(index: int, before: Blueprint, stage: Blueprint) -> None:
    """Reading on in the data needs the same data: one recipe, packed at one length."""
    for name in ("recipe", "seq_len"):
        if getattr(before.data, name) != getattr(stage.data, name):
            raise StageInvalid(
                [
                    (
                        _under_stage(index, "carry.data_position"),
                        f"carries the data position, but data.{name} changes "
                        f"({getattr(before.data, name)!r} -> {getattr(stage.data, name)!r}): "
                        "a position in one mixture means nothing in another",
                    )
                ]
            )


def _check_continuation(index: int, continues: bool, changes: dict[str, Any]) -> None:
    """A stage that continues the schedule keeps it: one schedule, one optimizer setting."""
    if not continues:
        return
    where = _under_stage(index, "continue_schedule")
    if index == 0:
        raise StageInvalid([(where, "the first stage has no schedule to continue")])
    training = changes.get("training", {})
    for name in _SCHEDULE_FIELDS:
        if name in training:
            raise StageInvalid(
                [
                    (
                        _under_stage(index, f"training.{name}"),
                        f"this stage continues the schedule of the stage before, so it keeps "
                        f"training.{name}; set it on the stage where the schedule starts",
                    )
                ]
            )
