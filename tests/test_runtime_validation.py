"""Validation while training (``training.eval``): the held-out loss costs the run no bit of its
determinism, reaches metrics.jsonl and TensorBoard, and is the number ``evaluate`` gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from heldout_fixtures import CATEGORIES, add_heldout_sets
from runtime_helpers import STEPS, tiny_blueprint

import factory
from factory.checks.registry import run_rules
from factory.data.shards.heldout import heldout_sets
from factory.report.run_metrics import read_metrics
from factory.runtime.batches import build_shards
from factory.runtime.evaluation import evaluate, heldout_micro_batches
from factory.runtime.fit import fit
from factory.runtime.loader import ShardLoader
from factory.runtime.run_options import RunOptions

EVAL = {"interval": 3, "tokens": 640}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_shards(tiny_blueprint(), tmp_path_factory.mktemp("validation-data"))
    return add_heldout_sets(out)


def _sets(data: Path) -> dict[str, Path]:
    return {category: s.folder for category, s in heldout_sets(data).items()}


def _train(data: Path, run_dir: Path, evaluation: dict | None, loggers=("jsonl",)) -> dict:
    training = {"steps": STEPS, "optimizer": {"lr": 1e-2, "min_lr": 1e-3}, "loggers": loggers}
    if evaluation is not None:
        training["eval"] = evaluation
    bp = tiny_blueprint(training=training)
    compiled = factory.compile(bp, seed=0, precision="emulate")  # NVFP4: stochastic rounding
    options = RunOptions(run_dir=run_dir, checkpoint_every=4, heldout=_sets(data))
    with ShardLoader(data, bp.parallelism.micro_batch_size, seed=3) as loader:
        history = fit(compiled, loader, STEPS, options)
    return {
        "losses": [(r.loss, r.grad_norm) for r in history.records],
        "weights": {k: v.clone() for k, v in compiled.model.state_dict().items()},
        "precision": compiled.precision.state_dict() if compiled.precision else None,
        "rng": torch.get_rng_state(),
        "compiled": compiled,
    }


@pytest.fixture(scope="module")
def runs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("validation-runs")
    plain = _train(data, tmp / "plain", None)
    evaluated = _train(data, tmp / "evaluated", EVAL, loggers=("jsonl", "tensorboard"))
    return {"plain": plain, "evaluated": evaluated, "dir": tmp / "evaluated"}


def test_a_run_with_evaluation_trains_bit_for_bit_like_one_without(runs: dict) -> None:
    plain, evaluated = runs["plain"], runs["evaluated"]
    assert evaluated["losses"] == plain["losses"]
    assert evaluated["weights"].keys() == plain["weights"].keys()
    for name, value in plain["weights"].items():
        assert torch.equal(evaluated["weights"][name], value), name
    assert torch.equal(evaluated["rng"], plain["rng"])
    assert repr(evaluated["precision"]) == repr(plain["precision"])  # SR generators included


def test_metrics_hold_each_set_and_the_overall_loss_at_each_interval(runs: dict) -> None:
    metrics = read_metrics(runs["dir"])
    steps = sorted({r.step for r in metrics.heldout})
    assert steps == [3, 6, STEPS]  # every interval, and after the last step
    at_end = [r for r in metrics.heldout if r.step == STEPS]
    assert [r.category for r in at_end] == [*CATEGORIES, None]
    for record in at_end:
        assert math.isfinite(record.loss) and record.tokens > 0
        assert record.perplexity == pytest.approx(math.exp(record.loss))
        assert sorted(record.mtp_losses) == ["1", "2"]  # the proxy's MTP depth
    overall = at_end[-1]
    sets = at_end[:-1]
    assert overall.tokens == sum(r.tokens for r in sets)
    weighted = sum(r.loss * r.tokens for r in sets) / overall.tokens
    assert overall.loss == pytest.approx(weighted, rel=1e-12)
    # The loss fell on the held-out documents too.
    first = next(r for r in metrics.heldout if r.step == 3 and r.category is None)
    assert overall.loss < first.loss


def test_the_recorded_loss_is_evaluate_on_the_final_weights(runs: dict, data: Path) -> None:
    compiled = runs["evaluated"]["compiled"]
    again = evaluate(
        compiled.model, _sets(data), EVAL["tokens"], 2, compiled.blueprint.model.mtp_depth
    )
    recorded = {r.category: r for r in read_metrics(runs["dir"]).heldout if r.step == STEPS}
    for category, loss in again.sets.items():
        assert recorded[category].loss == loss.loss
        assert recorded[category].tokens == loss.tokens
    assert recorded[None].loss == again.overall.loss


def test_tensorboard_shows_the_heldout_curves(runs: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(runs["dir"] / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"heldout/loss", "heldout/web/loss", "heldout/code/perplexity", "heldout/mtp_1"} <= tags
    curve = accumulator.Scalars("heldout/loss")
    assert [event.step for event in curve] == [3, 6, STEPS]
    recorded = [r.loss for r in read_metrics(runs["dir"]).heldout if r.category is None]
    assert [event.value for event in curve] == pytest.approx(recorded, rel=1e-6)


def test_the_evaluation_reads_the_first_samples_in_manifest_order(data: Path) -> None:
    folder = _sets(data)["web"]
    batches = heldout_micro_batches(folder, 5 * 64, 2)
    assert [b.input_ids.shape[0] for b in batches] == [2, 2, 1]  # 5 samples of 64 tokens
    again = heldout_micro_batches(folder, 5 * 64, 5)
    assert torch.equal(torch.cat([b.input_ids for b in batches]), again[0].input_ids)


def test_an_interval_past_the_run_is_an_error_naming_the_field() -> None:
    bp = tiny_blueprint(training={"steps": STEPS, "eval": {"interval": STEPS + 1}})
    findings = [f for _, f in run_rules(bp) if f.path == "training.eval.interval"]
    assert findings and f"{STEPS} steps" in findings[0].message
    fine = tiny_blueprint(training={"steps": STEPS, "eval": {"interval": STEPS}})
    assert not [f for _, f in run_rules(fine) if f.path.startswith("training.eval")]


def test_a_set_named_twice_is_refused_by_the_schema() -> None:
    with pytest.raises(ValueError, match="more than once"):
        tiny_blueprint(training={"eval": {"interval": 1, "sets": ["web", "web"]}})


def test_metrics_lines_are_json_with_kind_eval(runs: dict) -> None:
    lines = (runs["dir"] / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds.count("eval") == 3 * (len(CATEGORIES) + 1)
    assert kinds[-1] == "end"
