"""The report of a training run: plots and one HTML page from ``RUN_DIR/metrics.jsonl``
(``factory report``, and the end of every ``factory train``).

The x axis of every plot is the optimizer update, which keeps counting across
rollbacks; the schedule step repeats after one. Torch-free; matplotlib and
numpy are imported only when drawing.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

from factory.io import staged_directory
from factory.report.html_parts import STYLE, escape, figure_png, key_value_table, table
from factory.report.run_metrics import ReportError, RunMetrics, read_metrics
from factory.report.run_plots import ACTION_COLOURS, CAPTIONS, MARKS, plots
from factory.runtime.callbacks import Event
from factory.runtime.metrics import METRICS

__all__ = ["write_report"]

MAX_EVENT_ROWS = 1000
"""The events table keeps every stop and rollback, and warnings up to this many rows."""


def _facts(metrics: RunMetrics) -> list[tuple[str, str]]:
    last = metrics.steps[-1]
    finite = [s for s in metrics.steps if math.isfinite(s.loss) and math.isfinite(s.lm_loss)]
    of = f" of {metrics.run.steps}" if metrics.run else ""
    end = metrics.end
    reason = "no end line: still running, or killed"
    if end:
        reason = f"{end.reason}: {end.message}" if end.message else end.reason
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
    events = table(header, rows, row_classes=[e.action for e in shown])
    more = len(metrics.events) - len(shown)
    return events + (f"<p>{more} more warnings in {METRICS}.</p>" if more else "")


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
    return f"<h2>Rollbacks</h2>{table(header, rows)}" if rows else ""


def _heldout_html(metrics: RunMetrics) -> str:
    """The held-out loss of each set at the run's last evaluation (``training.eval``)."""
    curves = metrics.heldout_curves()
    if not curves:
        return ""
    last = {category: records[-1] for category, records in curves.items()}
    step = max(record.step for record in last.values())
    depths = sorted({d for r in last.values() for d in r.mtp_losses}, key=int)
    header = ["set", "loss", "perplexity", "tokens", *(f"MTP {d}" for d in depths)]
    rows = [
        [
            category if category is not None else "all sets",
            f"{r.loss:.4f}",
            f"{r.perplexity:.4g}",
            f"{r.tokens:,}",
            *(f"{r.mtp_losses[d]:.4f}" if d in r.mtp_losses else "-" for d in depths),
        ]
        for category, r in sorted(last.items(), key=lambda item: item[0] is None)
    ]
    note = f"<p>At step {step}, the last evaluation; the loss plot shows every one.</p>"
    return f"<h2>Held-out loss</h2>{note}{table(header, rows)}"


def _html(metrics: RunMetrics, drawn: list[tuple[str, bytes]]) -> str:
    """One page with nothing external: the PNGs are inlined as base64 data URIs."""
    name = escape(metrics.name)
    figures = "".join(figure_png(png, file, CAPTIONS[file]) for file, png in drawn)
    # the action column in the plots' colours
    css = "".join(f"tr.{a} td:nth-child(4){{color:{c}}}" for a, c in ACTION_COLOURS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{name}: training report</title>
<style>{STYLE}body{{max-width:960px}}{css}</style></head><body>
<h1>{name}</h1>{key_value_table(_facts(metrics))}
{_heldout_html(metrics)}<h2>Events</h2>{_events_html(metrics)}{_rollbacks_html(metrics)}
<h2>Plots</h2><p>{escape(MARKS)}</p>{figures}
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
