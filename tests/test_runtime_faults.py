"""Each fault the stability monitors exist for, injected into a real run, and the response.

Every test asserts the event in ``metrics.jsonl`` and the state after the
action: the rolled-back step, the skipped data window, the annealed learning
rate, the clean stop with its resumable checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import GLOBAL, tiny_blueprint

import factory
from factory.runtime import trainer
from factory.runtime.batches import build_shards
from factory.runtime.checkpoint import complete_checkpoints
from factory.runtime.fit import fit
from factory.runtime.history import RunHistory
from factory.runtime.loader import ShardLoader
from factory.runtime.run_options import RunOptions
from factory.runtime.schedule import learning_rate


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tiny_blueprint(), tmp_path_factory.mktemp("fault-data"))


Hook = Callable[[int, torch.nn.Module], None]


def _run(
    run_dir: Path,
    data: Path,
    monkeypatch: pytest.MonkeyPatch,
    stability: dict[str, Any],
    before: Hook | None = None,
    after: Hook | None = None,
    steps: int = 8,
    every: int = 2,
) -> tuple[RunHistory, list[dict[str, Any]]]:
    """Train with ``before``/``after`` called around the forward-backward of every attempt
    (with the 0-based attempt number and the model)."""
    bp = tiny_blueprint(training={"steps": steps, "stability": stability})
    compiled = factory.compile(bp, seed=0, precision="off")
    original = trainer.forward_backward
    attempts = {"n": 0}

    def forward_backward(model: torch.nn.Module, micro: list, *args: Any) -> Any:
        n = attempts["n"]
        attempts["n"] += 1
        if before is not None:
            before(n, model)
        out = original(model, micro, *args)
        if after is not None:
            after(n, model)
        return out

    monkeypatch.setattr(trainer, "forward_backward", forward_backward)
    options = RunOptions(run_dir=run_dir, checkpoint_every=every)
    with ShardLoader(data, bp.parallelism.micro_batch_size, seed=1) as loader:
        result = fit(compiled, loader, steps, options)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return result, [json.loads(line) for line in lines]


def _kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def test_a_nan_gradient_rolls_back_skips_the_window_and_anneals(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def poison(n: int, model: torch.nn.Module) -> None:
        if n == 4:  # the attempt at step 4
            next(model.parameters()).grad[0] = float("nan")

    result, records = _run(tmp_path, data, monkeypatch, {}, after=poison)
    (event,) = _kind(records, "event")
    assert (event["monitor"], event["action"], event["step"]) == ("non_finite", "rollback", 4)
    (rollback,) = _kind(records, "rollback")
    assert (rollback["from_step"], rollback["to_step"]) == (4, 4)  # the checkpoint before it
    assert rollback["skipped_samples"] == GLOBAL  # the step that met the NaN, not replayed
    steps = _kind(records, "step")
    assert [s["step"] for s in steps] == list(range(8))  # step 4 ran once, after the rollback
    bp = tiny_blueprint()
    scheduled = [learning_rate(s["step"], 8, bp.training) for s in steps[4:]]
    assert all(s["lr"] <= rate for s, rate in zip(steps[4:], scheduled, strict=True))
    assert steps[4]["lr"] < scheduled[0]  # annealing from step 4 on, below the schedule
    assert result.end == "completed"
    assert all(math.isfinite(r.loss) for r in result.records)


def test_a_router_collapse_stops_cleanly_with_a_resumable_checkpoint(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def collapse(n: int, model: torch.nn.Module) -> None:
        if n == 3:  # every token's first choice becomes expert 0 of the first MoE layer
            gate = model.backbone.layers[1].mixer.gate
            with torch.no_grad():
                gate.e_score_correction_bias[0] = 100.0

    # This 64-wide model's untrained routers reach MaxVio ~7 in layer 1 unaided; a collapse
    # sends every token's first choice to one expert: 1 + 15 = 16x the mean of 32 experts, top 2.
    stability = {"max_vio": {"threshold": 10.0, "after_step": 0, "patience": 1, "action": "stop"}}
    result, records = _run(tmp_path, data, monkeypatch, stability, before=collapse)
    events = _kind(records, "event")
    assert events and all(e["monitor"] == "max_vio" and e["step"] == 3 for e in events)
    (collapsed,) = [e for e in events if e["layer"] == "backbone.layers.1"]
    assert collapsed["value"] == pytest.approx(15.0, abs=0.5) and collapsed["action"] == "stop"
    assert result.end == "stopped" and [r.step for r in result.records] == [0, 1, 2]
    assert _kind(records, "end")[0]["reason"] == "stopped"
    latest_step, latest = complete_checkpoints(tmp_path / "checkpoints")[-1]
    assert latest_step == 3  # the refused step re-runs on resume
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["position"]["consumed"] == 3 * GLOBAL  # the data of step 3 is not lost


def test_a_loss_spike_from_a_learning_rate_jump_rolls_back_before_it(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original_lr = trainer.learning_rate_at
    jumped = {"done": False}

    def lr(position: Any, steps: int, compiled: Any) -> float:
        rate = original_lr(position, steps, compiled)
        if position.step == 5 and not jumped["done"]:
            jumped["done"] = True
            return rate * 100  # finite, but far past what the model tolerates
        return rate

    monkeypatch.setattr(trainer, "learning_rate_at", lr)
    stability = {"loss_spike": {"window": 5, "threshold": 5.0, "patience": 1}}
    result, records = _run(tmp_path, data, monkeypatch, stability, steps=10, every=5)
    spikes = [e for e in _kind(records, "event") if e["monitor"] == "loss_spike"]
    assert spikes and spikes[0]["step"] == 6 and spikes[0]["action"] == "rollback"
    (rollback,) = _kind(records, "rollback")
    assert (rollback["from_step"], rollback["to_step"]) == (6, 5)  # before the bad update
    assert rollback["skipped_samples"] == 2 * GLOBAL  # steps 5 and 6 are not replayed
    after = [s for s in _kind(records, "step") if s["update"] > rollback["update"]]
    assert [s["step"] for s in after] == list(range(5, 10))
    scheduled = [learning_rate(s["step"], 10, tiny_blueprint().training) for s in after]
    assert all(s["lr"] <= rate for s, rate in zip(after, scheduled, strict=True))
    assert after[0]["lr"] < scheduled[0]
    assert result.end == "completed" and result.records[-1].loss < spikes[0]["value"]


def test_a_residual_blow_up_is_reported_and_training_goes_on(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def blow_up(n: int, model: torch.nn.Module) -> None:
        if n == 3:
            with torch.no_grad():
                model.backbone.layers[3].mixer.o_proj.weight.mul_(1e5)

    stability = {"residual_rms": {"threshold": 1e3, "action": "warn"}}
    result, records = _run(tmp_path, data, monkeypatch, stability, before=blow_up)
    events = [e for e in _kind(records, "event") if e["monitor"] == "residual_rms"]
    assert events and events[0]["step"] == 3 and events[0]["action"] == "warn"
    assert events[0]["layer"] in {"backbone.layers.3", "backbone.layers.4"}
    assert events[0]["value"] > 1e3
    assert result.end == "completed" and len(result.records) == 8
