"""``factory report``: a run's metrics.jsonl becomes plots and one self-contained page."""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import factory.cli.report_cmd  # noqa: F401  (registers `report` until app.py imports it)
from factory.report.run_metrics import ReportError, read_metrics
from factory.report.run_page import write_report

Cli = Callable[..., tuple[int, str, str]]

LAYERS = [f"backbone.layers.{i}" for i in range(8)]
MOE = LAYERS[1::2]
PLOTS = ["loss.png", "lr.png", "grad_norm.png", "max_vio.png", "residual_rms.png"]
ROLLBACK_AT, RESUME = 34, 20  # the run rolls back from step 34 to step 20


def _step(update: int, step: int) -> dict[str, Any]:
    spike = 3.0 if 31 <= update <= ROLLBACK_AT else 0.0
    loss = 6.0 * math.exp(-step / 25) + 2.0 + 0.05 * math.sin(update) + spike
    return {
        "kind": "step",
        "update": update,
        "step": step,
        "loss": loss + 0.1,
        "lm_loss": loss,
        "lr": 3e-4 * min(1.0, (step + 1) / 10),
        "grad_norm": 1.0 + 20 * spike + 0.2 * math.cos(update),
        "tokens_seen": (update + 1) * 8 * 256,
        "tokens_per_s": 5000.0 + 10 * update,
        "seconds": 0.4,
        "finite": True,
        "max_vio": {name: 0.1 + 0.02 * i * step / 10 for i, name in enumerate(MOE)},
        "residual_rms": {name: 1.0 + i * 0.5 * (1 + step / 20) for i, name in enumerate(LAYERS)},
    }


def _event(update: int, monitor: str, action: str, layer: str | None = None) -> dict[str, Any]:
    message = f"{monitor} {action} at update {update} <{layer or 'model'}>"
    return {
        "kind": "event",
        "update": update,
        "step": update,
        "monitor": monitor,
        "action": action,
        "message": message,
        "value": 9.5,
        "threshold": 4.0,
        "layer": layer,
    }


def _lines() -> list[dict[str, Any]]:
    """A 50-step run: a loss spike, a rollback, a non-finite step, warnings, a stop."""
    started = "2025-01-01T00:00:00+00:00"
    lines: list[dict[str, Any]] = [
        {"kind": "run", "name": "nano-proxy", "steps": 60, "seq_len": 256}
        | {"global_batch_size": 8, "layers": LAYERS, "started": started}
    ]
    steps = list(range(ROLLBACK_AT + 1)) + list(range(RESUME, 50))
    for update, step in enumerate(steps):
        lines.append(_step(update, step))
        if update == 11:  # a non-finite step: NaN and null both read as NaN
            lines[-1] |= {"finite": False, "loss": math.nan, "grad_norm": None}
        if step % 10 == 0:
            lines.append(
                {"kind": "checkpoint", "update": update, "step": step}
                | {"path": f"ckpt/step{step}", "seconds": 0.2, "async": step > 0}
            )
        if update == ROLLBACK_AT:
            lines.append(_event(update, "loss_spike", "rollback"))
            lines.append(
                {"kind": "rollback", "update": update, "from_step": step, "to_step": RESUME}
                | {"skipped_samples": 64, "anneal_steps": 5}
            )
    lines += [
        _event(10, "non_finite", "warn"),
        _event(25, "max_vio", "warn", MOE[2]),
        _event(40, "residual_rms", "warn", LAYERS[6]),
        {"kind": "from_a_newer_producer", "update": 60},
        _event(len(steps) - 1, "grad_spike", "stop"),
        {"kind": "end", "update": len(steps) - 1, "step": 49, "reason": "stopped"}
        | {"message": "grad_spike stopped the run"},
    ]
    return lines


def _write(run: Path, lines: list[dict[str, Any]], tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line) + "\n" for line in lines) + tail
    (run / "metrics.jsonl").write_text(text, encoding="utf-8")
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the killed process's last write, cut short
    return _write(tmp_path_factory.mktemp("run") / "nano", _lines(), '{"kind": "step", "upd')


@pytest.fixture(scope="module")
def page(run: Path) -> Path:
    return write_report(run)


def test_reads_every_kind_and_skips_the_cut_short_last_line(run: Path) -> None:
    metrics = read_metrics(run)
    assert metrics.run is not None and metrics.run.layers == tuple(LAYERS)
    assert len(metrics.steps) == ROLLBACK_AT + 1 + 50 - RESUME and metrics.cut_short
    assert [s.update for s in metrics.steps] == list(range(len(metrics.steps)))
    assert math.isnan(metrics.steps[11].loss) and math.isnan(metrics.steps[11].grad_norm)
    assert {e.action for e in metrics.events} == {"warn", "stop", "rollback"}
    assert [(r.from_step, r.to_step) for r in metrics.rollbacks] == [(ROLLBACK_AT, RESUME)]
    assert [c.is_async for c in metrics.checkpoints][:2] == [False, True]
    assert metrics.end is not None and metrics.end.reason == "stopped"


def test_every_plot_is_written_with_drawn_content(page: Path) -> None:
    from matplotlib.image import imread

    assert page == page.parent / "report.html" and page.parent.name == "report"
    assert sorted(p.name for p in page.parent.iterdir()) == sorted([*PLOTS, "report.html"])
    for name in PLOTS:
        pixels = imread(page.parent / name)
        assert pixels.shape[0] > 250 and pixels.shape[1] == 900, name
        assert pixels[..., :3].std() > 0.05, f"{name} is blank"
    assert not list(page.parent.parent.glob(".report.*")), "a staging folder was left behind"


def test_the_page_inlines_every_plot_and_lists_every_event(run: Path, page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for name in PLOTS:
        encoded = base64.b64encode((page.parent / name).read_bytes()).decode("ascii")
        assert f"data:image/png;base64,{encoded}" in text, name
    assert "http" not in text and "<link" not in text and "<script" not in text
    for event in read_metrics(run).events:
        assert html.escape(event.message) in text
    assert "nano-proxy" in text and "stopped: grad_spike stopped the run" in text
    assert f"{ROLLBACK_AT + 1 + 50 - RESUME - 1}" in text  # the last optimizer update


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"kind": "step", "upd', "not JSON"),
        ("[1, 2]", "not an object with a 'kind'"),
        ('{"kind": "checkpoint", "update": 3, "step": 3}', "checkpoint line lacks 'path'"),
        ('{"kind": "rollback", "update": 3, "from_step": "x"}', "rollback 'from_step'"),
    ],
)
def test_a_damaged_middle_line_is_an_error_naming_it(tmp_path: Path, line: str, says: str) -> None:
    lines = _lines()[:5]
    text = "".join(json.dumps(x) + "\n" for x in lines[:3]) + line + "\n"
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps(lines[3]) + "\n", encoding="utf-8")
    with pytest.raises(ReportError, match=f"metrics.jsonl:4: {says}"):
        read_metrics(tmp_path)


def test_refuses_to_replace_the_run_or_a_folder_that_is_not_a_report(run: Path) -> None:
    with pytest.raises(ReportError, match="would replace the run directory"):
        write_report(run, run)
    with pytest.raises(ReportError, match="would replace the run directory"):
        write_report(run, run.parent)
    (run / "notes").mkdir(exist_ok=True)
    (run / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ReportError, match="is not a report folder"):
        write_report(run, run / "notes")
    with pytest.raises(ReportError, match="is not a report folder"):
        write_report(run, run / "metrics.jsonl")
    assert (run / "notes" / "todo.txt").read_text() == "keep me"


def test_cli_writes_the_report_where_asked(
    cli: Cli, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # drawing is tested above; this is the command's plumbing, so skip the seconds it takes
    monkeypatch.setattr("factory.report.run_page.plots", lambda metrics: [])
    for _ in range(2):  # the second run replaces the first report
        status, out, err = cli("report", str(run), "--out", str(tmp_path / "page"))
        assert status == 0, err
        assert out.strip() == f"wrote {tmp_path.resolve() / 'page' / 'report.html'}"
    assert "nano-proxy" in (tmp_path / "page" / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "content", [None, "", "\n", '{"kind": "run", "na', json.dumps(_lines()[0]) + "\n"]
)
def test_cli_missing_or_empty_metrics_exit_2(cli: Cli, tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content, encoding="utf-8")
    status, _, err = cli("report", str(tmp_path))
    assert status == 2
    assert err.startswith(f"{tmp_path}/metrics.jsonl: "), err
    assert not (tmp_path / "report").exists()


def test_a_finished_run_rerun_by_an_earlier_release_counts_its_checkpoint_once(
    tmp_path: Path,
) -> None:
    """Earlier releases saved a finished run's last checkpoint again when it was rerun, and
    appended another run and end line; the end has no message, so no colon after it."""
    first = {"kind": "run", "name": "nano-proxy", "steps": 2, "seq_len": 256}
    saved = {"kind": "checkpoint", "update": 2, "step": 2, "path": "ckpt/step2"}
    saved |= {"seconds": 0.2, "async": False}
    end = {"kind": "end", "update": 2, "step": 2, "reason": "completed", "message": ""}
    once = [first | {"global_batch_size": 8, "layers": LAYERS}, _step(0, 0), _step(1, 1)]
    run = _write(tmp_path / "run", [*once, saved, end, once[0] | {"resumed_at": 2}, saved, end])
    metrics = read_metrics(run)
    assert [(c.update, c.step) for c in metrics.checkpoints] == [(2, 2)]
    text = write_report(run).read_text(encoding="utf-8")
    assert "<td>completed</td>" in text and "completed:" not in text
    assert "<td>1, last at step 2: ckpt/step2</td>" in text
