"""Reading a training run's ``RUN_DIR/metrics.jsonl`` (``factory.runtime.metrics`` writes it)
into the records it was written from, for the run's report page and the build's checks.

The run appends one JSON object per line as it goes (kinds ``run``, ``step``,
``event``, ``checkpoint``, ``rollback``, ``eval``, ``end``), so the file may be read while
the run is alive or after it was killed: an unparsable *last* line is a write
cut short and is skipped; an unparsable line anywhere else is damage and raises
:class:`ReportError`. Unknown kinds are skipped, so older reports read newer runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

from factory.runtime.callbacks import Event, HeldoutMetrics, Rollback
from factory.runtime.metrics import (
    JSON_KEYS,
    KINDS,
    METRICS,
    CheckpointSaved,
    RunEnd,
    RunInfo,
    StepMetrics,
)

__all__ = ["ReportError", "RunMetrics", "read_metrics"]


class ReportError(ValueError):
    """The metrics file is missing, empty or damaged; the message names the file and line."""


@dataclass(frozen=True)
class RunMetrics:
    path: Path
    run: RunInfo | None
    steps: tuple[StepMetrics, ...]
    events: tuple[Event, ...]
    checkpoints: tuple[CheckpointSaved, ...]
    rollbacks: tuple[Rollback, ...]
    end: RunEnd | None
    cut_short: bool
    """Whether an unparsable last line (a write the killed process never finished) was skipped."""
    heldout: tuple[HeldoutMetrics, ...] = ()
    """The held-out losses (``training.eval``), each set's and all sets' (category None)."""

    @property
    def name(self) -> str:
        return self.run.name if self.run else self.path.parent.name

    def heldout_curves(self) -> dict[str | None, list[HeldoutMetrics]]:
        """Each held-out set's records (None: all sets together) in update order, one per
        update: an evaluation repeated after a resume or a rollback replaces the earlier."""
        latest: dict[tuple[str | None, int], HeldoutMetrics] = {}
        for record in self.heldout:
            latest[(record.category, record.update)] = record
        curves: dict[str | None, list[HeldoutMetrics]] = {}
        for (category, _), record in sorted(latest.items(), key=lambda item: item[0][1]):
            curves.setdefault(category, []).append(record)
        return curves


_NUMBERS = {int, float, type(None)}


def _numbers(values: Iterable[Any]) -> bool:
    """All ints, floats or nulls (not bools); one set of types, as per-layer dicts are the hot loop."""
    return set(map(type, values)) <= _NUMBERS


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` says, or raise TypeError; a null float is NaN (a non-finite step)."""
    if hint is float or hint == float | None:
        if value is None:
            return math.nan if hint is float else None
        if _number(value):
            return float(value)
    elif hint == str | None:
        if value is None or isinstance(value, str):
            return value
    elif hint is int and _number(value) and float(value).is_integer():
        return int(value)
    elif hint in (str, bool) and isinstance(value, hint):
        return value
    elif (
        hint == tuple[str, ...]
        and isinstance(value, list)
        and all(isinstance(v, str) for v in value)
    ):
        return tuple(value)
    elif hint == dict[str, float] and isinstance(value, dict) and _numbers(value.values()):
        return {k: math.nan if v is None else float(v) for k, v in value.items()}
    raise TypeError(f"{json.dumps(value)[:40]} is not {getattr(hint, '__name__', hint)}")


@cache
def _fields(cls: type) -> list[tuple[str, str, Any, bool]]:
    """(attribute, JSON key, type, required) of every field; cached, as resolving hints is
    slow. A field with a default may be absent (a line written before it existed)."""
    hints = get_type_hints(cls)
    return [
        (f.name, JSON_KEYS.get(f.name, f.name), hints[f.name], f.default is MISSING)
        for f in fields(cls)
    ]


def _record(cls: type, obj: dict[str, Any], where: str) -> Any:
    values = {}
    for name, key, hint, required in _fields(cls):
        if key not in obj and not required:
            continue
        if key not in obj:
            raise ReportError(f"{where}: {obj['kind']} line lacks {key!r}")
        try:
            values[name] = _convert(obj[key], hint)
        except TypeError as exc:
            raise ReportError(f"{where}: {obj['kind']} {key!r}: {exc}") from None
    return cls(**values)


def _objects(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """(``file:line``, object) for every line, and whether a cut-short last line was dropped."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    while lines and not lines[-1].strip():
        lines.pop()
    out, cut_short = [], False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                cut_short = True
                break
            raise ReportError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
            raise ReportError(f"{path}:{number}: not an object with a 'kind'")
        out.append((f"{path}:{number}", obj))
    return out, cut_short


def _once(saved: list[CheckpointSaved]) -> tuple[CheckpointSaved, ...]:
    """Each checkpoint once: earlier releases saved a finished run's last checkpoint again
    when it was rerun (the same update and step, the same folder): one checkpoint, not two."""
    return tuple({(c.update, c.step): c for c in saved}.values())


def read_metrics(run_dir: Path | str) -> RunMetrics:
    """Parse ``run_dir/metrics.jsonl``; raise :class:`ReportError` if it is missing or damaged."""
    path = Path(run_dir) / METRICS
    objects, cut_short = _objects(path)
    if not objects:
        raise ReportError(f"{path}: empty (no complete line yet)")
    found: dict[str, list[Any]] = {kind: [] for kind in KINDS}
    for where, obj in objects:
        if obj["kind"] in KINDS:
            found[obj["kind"]].append(_record(KINDS[obj["kind"]], obj, where))
    return RunMetrics(
        path=path,
        run=found["run"][0] if found["run"] else None,  # a resumed run may repeat it
        steps=tuple(found["step"]),
        events=tuple(found["event"]),
        checkpoints=_once(found["checkpoint"]),
        rollbacks=tuple(found["rollback"]),
        end=found["end"][-1] if found["end"] else None,
        cut_short=cut_short,
        heldout=tuple(found["eval"]),
    )
