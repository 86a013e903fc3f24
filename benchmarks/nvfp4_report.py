"""Summary, table, plot and HTML page of ``nvfp4_replication``'s results.json.

Separate from the runs so that a finished (or killed) replication can be
re-rendered without training: ``python -m benchmarks nvfp4_replication --render``.

Metrics (losses are next-token cross-entropy on the shared training stream):

* final loss: mean over the last ``FINAL_FRACTION`` of steps;
* gap vs bf16 in %: final / final_bf16 - 1;
* mean gap, 2nd half: the mean of the per-step relative gaps (same step, same
  batch) over the second half of the run, steadier than the last 10% alone;
* max gap, smoothed: the largest relative gap between trailing means over
  ``steps // 20`` steps (from the first full window);
* max gap, one step: the largest relative gap between two runs' losses on the
  same step, i.e. the same batch (the data order is shared);
* spikes: steps whose loss exceeds ``SPIKE`` x the median of the previous
  ``SPIKE_WINDOW`` steps, and how many of them bf16 does not have (a spike in
  both comes from the batch, not the number format);
* the largest gradient norm of the second half, and the median step time.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

BASELINE = "bf16"
SPIKE, SPIKE_WINDOW = 1.2, 20
FINAL_FRACTION = 0.1


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (shorter at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def spikes(losses: list[float]) -> list[int]:
    """Steps whose loss exceeds SPIKE x the median of the SPIKE_WINDOW steps before."""
    return [
        i
        for i in range(SPIKE_WINDOW, len(losses))
        if losses[i] > SPIKE * statistics.median(losses[i - SPIKE_WINDOW : i])
    ]


def summarize(runs: dict[str, dict[str, Any]], steps: int) -> dict[str, dict[str, Any]]:
    """The table's numbers for every finished run (gaps only once the baseline has run).

    Steps in the summary are 1-based, as in the plot and the logs.
    """
    window = max(1, steps // 20)
    tail = max(1, round(FINAL_FRACTION * steps))
    curves = {name: [r["lm_loss"] for r in run["records"]] for name, run in runs.items()}
    smoothed = {name: smooth(losses, window) for name, losses in curves.items()}
    summary: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        losses, records = curves[name], run["records"]
        complete = not run["diverged"] and len(losses) == steps
        late = [r["grad_norm"] for r in records[len(records) // 2 :] if r["finite"]]
        row: dict[str, Any] = {
            "final_loss": statistics.fmean(losses[-tail:]) if complete else float("nan"),
            "median_step_s": statistics.median(r["seconds"] for r in records),
            "total_s": sum(r["seconds"] for r in records),
            "steps_done": len(losses),
            "non_finite_steps": sum(not r["finite"] for r in records),
            "diverged": run["diverged"],
            "spikes": [i + 1 for i in spikes(losses)],
            "max_grad_norm_second_half": max(late, default=float("nan")),
        }
        if BASELINE in summary and name != BASELINE:
            base, own = curves[BASELINE], smoothed[name]
            row["gap_pct"] = 100 * (row["final_loss"] / summary[BASELINE]["final_loss"] - 1)
            gaps = [
                (100 * (own[i] / smoothed[BASELINE][i] - 1), i + 1)
                for i in range(window - 1, min(len(base), len(own)))
            ]
            if gaps:
                row["max_gap_pct"], row["max_gap_step"] = max(gaps)
            paired = list(zip(losses, base, strict=False))  # a stopped run is shorter
            half = [100 * (loss / b - 1) for loss, b in paired[steps // 2 :]]
            if half:
                row["mean_gap_second_half_pct"] = statistics.fmean(half)
            row["max_step_gap_pct"], row["max_step_gap_step"] = max(
                ((100 * (loss / b - 1), i + 1) for i, (loss, b) in enumerate(paired)),
                default=(float("nan"), 0),
            )
            row["spikes_not_in_bf16"] = sorted(
                set(row["spikes"]) - set(summary[BASELINE]["spikes"])
            )
        summary[name] = row
    return summary


def _pct(row: dict[str, Any], key: str, step: str | None = None) -> str:
    if key not in row:
        return "-"
    return f"{row[key]:+.2f}%" + (f" ({row[step]})" if step else "")


def table_rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Header plus one row per configuration, as strings (terminal and HTML share them)."""
    rows = [
        [
            "config",
            "final loss (last 10%)",
            "gap vs bf16",
            "mean gap, 2nd half",
            "max gap, smoothed (step)",
            "max gap, one step (step)",
            "median step",
            "non-finite",
            "spikes (not in bf16)",
            "max |g|, 2nd half",
        ]
    ]
    for name, row in summary.items():
        new_spikes = row.get("spikes_not_in_bf16")
        rows.append(
            [
                name,
                f"{row['final_loss']:.4f}",
                _pct(row, "gap_pct"),
                _pct(row, "mean_gap_second_half_pct"),
                _pct(row, "max_gap_pct", "max_gap_step"),
                _pct(row, "max_step_gap_pct", "max_step_gap_step"),
                f"{row['median_step_s']:.2f} s",
                f"{row['non_finite_steps']}" + (" (stopped)" if row["diverged"] else ""),
                f"{len(row['spikes'])}"
                + (f" ({len(new_spikes)})" if new_spikes is not None else ""),
                f"{row['max_grad_norm_second_half']:.2f}",
            ]
        )
    return rows


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    header, *rows = table_rows(summary)
    table = Table(title="NVFP4 replication: Super CPU proxy")
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    Console(width=170).print(table)


def plot_png(runs: dict[str, dict[str, Any]], steps: int) -> bytes:
    """Smoothed loss curves (top) and the relative gap vs bf16 (bottom), as PNG bytes.

    Drawn through the Agg canvas directly (no pyplot state, no display).
    """
    import io

    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    window = max(1, steps // 20)
    curves = {n: smooth([r["lm_loss"] for r in run["records"]], window) for n, run in runs.items()}
    colours = {name: f"C{i}" for i, name in enumerate(runs)}
    with matplotlib.rc_context({"svg.hashsalt": "factory"}):
        figure = Figure(figsize=(9.0, 7.5), dpi=100)
        FigureCanvasAgg(figure)
        top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        for name, curve in curves.items():
            top.plot(range(1, len(curve) + 1), curve, label=name, color=colours[name], lw=1.4)
        top.set_ylabel(f"LM loss (trailing mean of {window})")
        top.set_title("Super CPU proxy: NVFP4 policies vs unquantized (bf16)")
        top.legend()
        top.grid(alpha=0.3)
        base = curves.get(BASELINE)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        if base is not None:
            for name, curve in curves.items():
                if name == BASELINE:
                    continue
                n = min(len(base), len(curve))
                gap = [100 * (curve[i] / base[i] - 1) for i in range(n)]
                bottom.plot(range(1, n + 1), gap, label=name, color=colours[name], lw=1.2)
        bottom.set_xlabel("optimizer step")
        bottom.set_ylabel("relative gap vs bf16 (%)")
        bottom.grid(alpha=0.3)
        if len(curves) > 1:
            bottom.legend()
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def html_report(results: dict[str, Any], png: bytes) -> str:
    """A self-contained page: what ran, the table, and the plot embedded as base64."""
    import base64
    import html

    header, *rows = table_rows(results["summary"])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    meta = results["meta"]
    facts = "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in meta.items()
    )
    configs = "".join(
        f"<li><b>{html.escape(n)}</b>: {html.escape(c['description'])}; overrides "
        f"{html.escape(', '.join(c['overrides']) or 'none')}; linears per format "
        f"{html.escape(str(c['recipes']))}</li>"
        for n, c in results["configs"].items()
    )
    image = base64.b64encode(png).decode("ascii")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>NVFP4 replication (Super CPU proxy)</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
td:first-child,th:first-child{{text-align:left}}</style></head><body>
<h1>NVFP4 vs BF16 on the Super CPU proxy</h1>
<p>Same seed, same initial weights and the same data order for every run; the loss is
next-token cross-entropy on the training stream (under one epoch). "bf16" is
<code>precision="off"</code>: unquantized linears computed in the model dtype, fp32 on CPU.
Gaps are relative to bf16: "smoothed" compares the trailing means drawn below, "one step"
compares the losses of the same step (same batch). Spikes: steps whose loss exceeds {SPIKE}x
the median of the previous {SPIKE_WINDOW} steps; in brackets, those bf16 does not have at the
same step (the batches are shared, so a spike in both comes from the data).</p>
<table><tr>{head}</tr>{body}</table>
<h2>Loss curves</h2><img alt="loss curves and relative gap" src="data:image/png;base64,{image}">
<h2>Configurations</h2><ul>{configs}</ul>
<h2>Run</h2><ul>{facts}</ul>
</body></html>
"""


def write_results(out: Path, results: dict[str, Any]) -> None:
    import json

    from factory.io import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(results, indent=1, allow_nan=True) + "\n")


def publish(out: Path, results: dict[str, Any]) -> int:
    """Summarize, write results.json, the PNG and the HTML report; print the table.

    Exit status 1 when a run stopped at a non-finite loss.
    """
    from factory.io import atomic_write_bytes, atomic_write_text

    results["summary"] = summarize(results["runs"], results["meta"]["steps"])
    write_results(out, results)
    print_table(results["summary"])
    png = plot_png(results["runs"], results["meta"]["steps"])
    atomic_write_bytes(out / "loss_curves.png", png)
    atomic_write_text(out / "report.html", html_report(results, png))
    print(f"wrote {out}/results.json, loss_curves.png, report.html")
    return 1 if any(run["diverged"] for run in results["runs"].values()) else 0
