"""The report of a training run: plots and one HTML page from ``RUN_DIR/metrics.jsonl``.

The run appends one JSON object per line as it goes (kinds ``run``, ``step``,
``event``, ``checkpoint``, ``rollback``, ``end``), so the file may be read while
the run is alive or after it was killed: an unparsable *last* line is a write
cut short and is skipped; an unparsable line anywhere else is damage and raises
:class:`ReportError`. Unknown kinds are skipped, so older reports read newer runs.

The x axis of every plot is the optimizer update, which keeps counting across
rollbacks; the schedule step repeats after one. Torch-free; matplotlib and
numpy are imported only when drawing.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

from factory.io import staged_directory
from factory.runtime.monitors import Event
from factory.runtime.report_plots import ACTION_COLOURS, CAPTIONS, MARKS, plots

__all__ = [
    "Checkpoint", "Event", "ReportError", "Rollback", "RunEnd", "RunInfo", "RunMetrics",
    "StepRecord", "read_metrics", "write_report",
]  # fmt: skip

METRICS = "metrics.jsonl"
MAX_EVENT_ROWS = 1000
"""The events table keeps every stop and rollback, and warnings up to this many rows."""


class ReportError(ValueError):
    """The metrics file is missing, empty or damaged; the message names the file and line."""


@dataclass(frozen=True)
class RunInfo:
    name: str
    steps: int
    seq_len: int
    global_batch_size: int
    layers: tuple[str, ...]
    started: str


@dataclass(frozen=True)
class StepRecord:
    update: int
    step: int
    loss: float
    lm_loss: float
    lr: float
    grad_norm: float
    tokens_seen: int
    tokens_per_s: float
    seconds: float
    finite: bool
    max_vio: dict[str, float]
    residual_rms: dict[str, float]


@dataclass(frozen=True)
class Checkpoint:
    update: int
    step: int
    path: str
    seconds: float
    is_async: bool


@dataclass(frozen=True)
class Rollback:
    update: int
    from_step: int
    to_step: int
    skipped_samples: int
    anneal_steps: int


@dataclass(frozen=True)
class RunEnd:
    update: int
    step: int
    reason: str
    message: str


@dataclass(frozen=True)
class RunMetrics:
    path: Path
    run: RunInfo | None
    steps: tuple[StepRecord, ...]
    events: tuple[Event, ...]
    checkpoints: tuple[Checkpoint, ...]
    rollbacks: tuple[Rollback, ...]
    end: RunEnd | None
    cut_short: bool
    """Whether an unparsable last line (a write the killed process never finished) was skipped."""

    @property
    def name(self) -> str:
        return self.run.name if self.run else self.path.parent.name


KINDS: dict[str, type] = {
    "run": RunInfo,
    "step": StepRecord,
    "event": Event,
    "checkpoint": Checkpoint,
    "rollback": Rollback,
    "end": RunEnd,
}
JSON_KEYS = {"is_async": "async"}  # `async` is a Python keyword


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
def _fields(cls: type) -> list[tuple[str, str, Any]]:
    """(attribute, JSON key, type) of every field; cached, as resolving hints is slow."""
    hints = get_type_hints(cls)
    return [(f.name, JSON_KEYS.get(f.name, f.name), hints[f.name]) for f in fields(cls)]


def _record(cls: type, obj: dict[str, Any], where: str) -> Any:
    values = {}
    for name, key, hint in _fields(cls):
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
        checkpoints=tuple(found["checkpoint"]),
        rollbacks=tuple(found["rollback"]),
        end=found["end"][-1] if found["end"] else None,
        cut_short=cut_short,
    )


# --- the page --------------------------------------------------------------------------------


def _facts(metrics: RunMetrics) -> list[tuple[str, str]]:
    last = metrics.steps[-1]
    finite = [s for s in metrics.steps if math.isfinite(s.loss) and math.isfinite(s.lm_loss)]
    of = f" of {metrics.run.steps}" if metrics.run else ""
    end = metrics.end
    reason = f"{end.reason}: {end.message}" if end else "no end line: still running, or killed"
    loss = "no finite loss"
    if finite:
        f = finite[-1]
        loss = f"{f.loss:.4f} (LM loss {f.lm_loss:.4f}, update {f.update})"
    speed = statistics.median(s.tokens_per_s for s in metrics.steps)
    actions = Counter(e.action for e in metrics.events)
    ordered = dict.fromkeys(a for a in [*ACTION_COLOURS, *sorted(actions)] if a in actions)
    saved = metrics.checkpoints[-1] if metrics.checkpoints else None
    facts = [
        ("steps completed", f"{last.step + 1}{of} (optimizer update {last.update})"),
        ("end", reason + (" (last line cut short)" if metrics.cut_short else "")),
        ("final loss", loss),
        ("tokens/s", f"{speed:,.0f} median, {last.tokens_per_s:,.0f} last"),
        ("tokens seen", f"{last.tokens_seen:,} in {sum(s.seconds for s in metrics.steps):,.1f} s"),
        ("events", ", ".join(f"{actions[a]} {a}" for a in ordered) or "none"),
        ("checkpoints", f"{len(metrics.checkpoints)}, last at step {saved.step}: {saved.path}"
         if saved else "none"),
    ]  # fmt: skip
    if metrics.run:
        run = metrics.run
        facts.append(("batch", f"{run.global_batch_size} × {run.seq_len} tokens"))
        facts.append(("started", run.started))
    return facts


def _shown_events(events: tuple[Event, ...]) -> list[Event]:
    """Every stop and rollback, and warnings while there is room: a long run may warn often."""
    room = MAX_EVENT_ROWS - sum(e.action != "warn" for e in events)
    shown = []
    for event in sorted(events, key=lambda e: e.update):  # by update: the table reads as a timeline
        if event.action != "warn" or room > 0:
            room -= event.action == "warn"
            shown.append(event)
    return shown


def _table(header: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join(
        f'<tr class="{html.escape(css)}">'
        + "".join(f"<td>{html.escape(c)}</td>" for c in row)
        + "</tr>"
        for row, css in zip(rows, classes or [""] * len(rows), strict=True)
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _events_html(metrics: RunMetrics) -> str:
    if not metrics.events:
        return "<p>No monitor fired.</p>"
    shown = _shown_events(metrics.events)

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    header = ["update", "step", "monitor", "action", "layer", "value", "threshold", "message"]
    rows = [
        [
            str(e.update),
            str(e.step),
            e.monitor,
            e.action,
            e.layer or "-",
            num(e.value),
            num(e.threshold),
            e.message,
        ]
        for e in shown
    ]
    table = _table(header, rows, [e.action for e in shown])
    more = len(metrics.events) - len(shown)
    return table + (f"<p>{more} more warnings in {METRICS}.</p>" if more else "")


def _rollbacks_html(metrics: RunMetrics) -> str:
    header = ["update", "from step", "to step", "skipped samples", "anneal steps"]
    rows = [
        [
            str(r.update),
            str(r.from_step),
            str(r.to_step),
            f"{r.skipped_samples:,}",
            str(r.anneal_steps),
        ]
        for r in metrics.rollbacks
    ]
    return f"<h2>Rollbacks</h2>{_table(header, rows)}" if rows else ""


def _html(metrics: RunMetrics, drawn: list[tuple[str, bytes]]) -> str:
    """One page with nothing external: the PNGs are inlined as base64 data URIs."""
    name = html.escape(metrics.name)
    facts = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _facts(metrics)
    )
    figures = "".join(
        f'<figure><img alt="{file}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode("ascii")}"><figcaption>{html.escape(CAPTIONS[file])}'
        "</figcaption></figure>"
        for file, png in drawn
    )
    # the action column in the plots' colours
    css = "".join(f"tr.{a} td:nth-child(4){{color:{c}}}" for a, c in ACTION_COLOURS.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{name}: training report</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}}img{{max-width:100%}}figure{{margin:1.5em 0}}
figcaption{{font-size:90%;color:#444}}{css}</style></head><body>
<h1>{name}</h1><table>{facts}</table>
<h2>Events</h2>{_events_html(metrics)}{_rollbacks_html(metrics)}
<h2>Plots</h2><p>{html.escape(MARKS)}</p>{figures}
</body></html>
"""


def _target(run_dir: Path, out: Path | str | None) -> Path:
    """Where the report goes; never over the run itself or a folder that is not a report."""
    target = (Path(out) if out is not None else run_dir / "report").resolve()
    if target == run_dir.resolve() or target in run_dir.resolve().parents:
        raise ReportError(f"{target}: would replace the run directory {run_dir}")
    empty = target.is_dir() and not any(target.iterdir())
    if target.exists() and not empty and not (target / "report.html").is_file():
        raise ReportError(f"{target}: exists and is not a report folder; choose another --out")
    return target


def write_report(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Render the run's plots and ``report.html`` into ``out`` (default ``run_dir/report``).

    The folder is built beside its destination and swapped in whole, so a reader
    never sees half a report. Returns the path of ``report.html``.
    """
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics.steps:
        raise ReportError(f"{metrics.path}: no step line yet")
    target = _target(run_dir, out)
    drawn = plots(metrics)
    with staged_directory(target) as staging:
        for file, png in drawn:
            (staging / file).write_bytes(png)
        (staging / "report.html").write_text(_html(metrics, drawn), encoding="utf-8")
    return target / "report.html"
