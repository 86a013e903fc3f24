"""The build page's "Which checkpoint is good" section: the evaluate stage's
``evaluation.json`` (the smoke run's kept checkpoints and their average on the held-out sets,
samples of the model, MTP acceptance rates). The held-out curves over the run are in the
smoke run's loss plot. Torch-free."""

from __future__ import annotations

from typing import Any

from factory.report.bar_chart import Series, bar_chart_svg
from factory.report.build_folder import BuildFolder, missing
from factory.report.html_parts import escape, figure_svg, section, table

__all__ = ["evaluation_section"]

_ANCHOR, _TITLE = "evaluation", "Which checkpoint is good: held-out loss and samples"

_LOSS_COLOUR = "#2e7d32"
"""The held-out green of the run page's loss plot."""


def _rows(record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, losses) of each kept checkpoint, then of their average."""
    rows = [(f"step {c['step']}", c) for c in record["checkpoints"]]
    averaged = record["averaged"]
    steps = ", ".join(str(s) for s in averaged["steps"])
    return [*rows, (f"average of steps {steps}", averaged)]


def _loss_table(record: dict[str, Any]) -> str:
    sets = list(record["sets"])
    header = ["checkpoint", "all sets", "perplexity", *sets]
    body = [
        [label, f"{losses['loss']:.4f}", f"{losses['perplexity']:.2f}"]
        + [f"{losses['sets'][name]:.4f}" if name in losses["sets"] else "—" for name in sets]
        for label, losses in _rows(record)
    ]
    return table(header, body)


def _loss_chart(record: dict[str, Any]) -> str:
    """Each row's held-out loss above the lowest: the differences are hundredths of a nat at
    a loss of several, which bars from zero would not show."""
    rows = _rows(record)
    lowest = min(losses["loss"] for _, losses in rows)
    chart = bar_chart_svg(
        [label for label, _ in rows],
        [Series("above the lowest", _LOSS_COLOUR, [losses["loss"] - lowest for _, losses in rows])],
        lambda value: f"+{value:.4f} nats",
    )
    return figure_svg(
        chart,
        f"Held-out loss over all sets (token-weighted) of each kept checkpoint of the smoke "
        f"run and of their uniform average (factory average), above the lowest, "
        f"{lowest:.4f} nats; the table gives each set's.",
    )


def _acceptance(record: dict[str, Any]) -> str:
    acceptance = record["acceptance"]
    pairs = zip(acceptance["accepted"], acceptance["drafted"], strict=True)
    rows = [
        [str(depth), f"{a:,}", f"{d:,}", f"{a / d:.1%}" if d else "—"]
        for depth, (a, d) in enumerate(pairs, 1)
    ]
    return (
        "<h3>MTP self-speculation</h3>"
        f"<p>The MTP heads drafted, the main model verified; "
        f"{acceptance['tokens_per_forward']:.2f} new "
        "tokens per main-model forward over the samples (greedy output is identical to plain "
        "decoding).</p>" + table(["draft position", "accepted", "drafted", "rate"], rows)
    )


def _samples(record: dict[str, Any]) -> str:
    items = "".join(
        f"<li><pre>{escape(s['prompt'])}<b>{escape(s['text'])}</b></pre></li>"
        for s in record["samples"]
    )
    return f"<h3>Samples (greedy, the prompt then the model's text in bold)</h3><ol>{items}</ol>"


def evaluation_section(folder: BuildFolder) -> str:
    """The evaluate stage's record, or why there is none."""
    record = folder.evaluation
    if not isinstance(record, dict):
        return section(_ANCHOR, _TITLE, missing(folder, "evaluate", "held-out evaluation"))
    where = f" (program stage {escape(record['stage'])})" if record.get("stage") else ""
    body = (
        f"<p>The smoke run{where} on its data's held-out sets, which training never sees "
        "(the data build sets them aside by document hash). Its loss plot above carries the "
        "held-out curves over the run.</p>" + _loss_chart(record) + _loss_table(record)
    )
    if record.get("acceptance"):
        body += _acceptance(record)
    return section(_ANCHOR, _TITLE, body + _samples(record))
