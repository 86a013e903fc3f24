"""Validation while training (``training.eval``): the held-out loss costs the run no bit of its
determinism, reaches metrics.jsonl and TensorBoard, and is the number ``evaluate`` gives."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
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

EVAL = {"interval": 2, "tokens": 640}
RUN = 5
"""Steps of the in-process runs: evaluated at 2 and 4, and after the last."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_shards(tiny_blueprint(), tmp_path_factory.mktemp("validation-data"))
    return add_heldout_sets(out)


def _sets(data: Path) -> dict[str, Path]:
    return {category: s.folder for category, s in heldout_sets(data).items()}


def _train(data: Path, run_dir: Path, evaluation: dict | None, loggers=("jsonl",)) -> dict:
    training = {"steps": RUN, "optimizer": {"lr": 1e-2, "min_lr": 1e-3}, "loggers": loggers}
    if evaluation is not None:
        training["eval"] = evaluation
    bp = tiny_blueprint(training=training)
    compiled = factory.compile(bp, seed=0, precision="emulate")  # NVFP4: stochastic rounding
    options = RunOptions(run_dir=run_dir, checkpoint_every=4, heldout=_sets(data))
    with ShardLoader(data, bp.parallelism.micro_batch_size, seed=3) as loader:
        history = fit(compiled, loader, RUN, options)
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
    assert steps == [2, 4, RUN]  # every interval, and after the last step
    at_end = [r for r in metrics.heldout if r.step == RUN]
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
    first = next(r for r in metrics.heldout if r.step == 2 and r.category is None)
    assert overall.loss < first.loss


def test_the_recorded_loss_is_evaluate_on_the_final_weights(runs: dict, data: Path) -> None:
    compiled = runs["evaluated"]["compiled"]
    again = evaluate(
        compiled.model, _sets(data), EVAL["tokens"], 2, compiled.blueprint.model.mtp_depth
    )
    recorded = {r.category: r for r in read_metrics(runs["dir"]).heldout if r.step == RUN}
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
    assert [event.step for event in curve] == [2, 4, RUN]
    recorded = [r.loss for r in read_metrics(runs["dir"]).heldout if r.category is None]
    assert [event.value for event in curve] == pytest.approx(recorded, rel=1e-6)


def test_the_evaluation_reads_the_first_samples_in_manifest_order(data: Path) -> None:
    folder = _sets(data)["web"]
    batches = heldout_micro_batches(folder, 5 * 64, 2)
    # 5 samples of 64 tokens, the last micro-batch filled up to the training's shape with a
    # sample that counts no target.
    assert [tuple(b.input_ids.shape) for b in batches] == [(2, 64)] * 3
    assert not batches[-1].loss_mask[1].any() and batches[-1].loss_mask[0].any()
    again = heldout_micro_batches(folder, 5 * 64, 5)
    assert torch.equal(torch.cat([b.input_ids for b in batches])[:5], again[0].input_ids)


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


DRIVER = Path(__file__).with_name("runtime_driver.py")


def _driven(tmp: Path, data: Path, run_dir: Path, **spec: object) -> dict:
    """Train in a child process (``runtime_driver.py``: checkpoints every 2 steps, NVFP4
    emulated) with evaluation every 2 steps; each step's loss and each evaluation's records,
    the last record of a step winning (a step re-run after a resume replaces the one cut
    short)."""
    training = {"steps": STEPS, "optimizer": {"lr": 1e-2, "min_lr": 1e-3}}
    training["eval"] = {"interval": 2, "tokens": 256}
    training["average"] = {"kind": "ema", "decay": 0.75, "start": 1}
    full = {
        "blueprint": tiny_blueprint(training=training).model_dump(mode="json"),
        "data": str(data),
        "run_dir": str(run_dir),
        "steps": STEPS,
        "heldout": {c: str(folder) for c, folder in _sets(data).items()},
        **spec,
    }
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(full))
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(path)], capture_output=True, text=True, timeout=240
    )
    losses, evaluations, resumed_evaluations = {}, {}, []
    resumed = False
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "run":
            resumed = record["resumed_at"] > 0
        elif record["kind"] == "step":
            losses[record["step"]] = record["loss"]
        elif record["kind"] == "eval":
            key = (record["step"], record["category"])
            evaluations[key] = (record["loss"], record["tokens"], record["mtp_losses"])
            if resumed:
                resumed_evaluations.append(key)
    return {"done": done, "losses": losses, "eval": evaluations, "resumed": resumed_evaluations}


def _newest_average(run_dir: Path) -> dict[str, torch.Tensor]:
    """``training.average``'s moving average as the run's newest checkpoint holds it."""
    from factory.runtime.averaging import running_average
    from factory.runtime.checkpoint import complete_checkpoints

    return running_average(complete_checkpoints(run_dir / "checkpoints")[-1][1])


def test_a_run_with_evaluation_and_averaging_resumes_after_sigkill_bit_for_bit(
    tmp_path: Path, data: Path
) -> None:
    reference = _driven(tmp_path, data, tmp_path / "reference")
    assert reference["done"].returncode == 0, reference["done"].stderr
    assert sorted({step for step, _ in reference["eval"]}) == [2, 4, 6, STEPS]
    killed = _driven(tmp_path, data, tmp_path / "run", kill={"step": 4})  # after step 2's save
    assert killed["done"].returncode == -9, killed["done"].stderr
    resumed = _driven(tmp_path, data, tmp_path / "run", resume=True)
    assert resumed["done"].returncode == 0, resumed["done"].stderr
    assert resumed["losses"] == reference["losses"]  # every step, bit for bit
    assert resumed["eval"] == reference["eval"]  # every evaluation, bit for bit
    # The resumed run evaluated again at the step it resumed from, with the same numbers.
    assert resumed["resumed"][0][0] == 2
    want, got = _newest_average(tmp_path / "reference"), _newest_average(tmp_path / "run")
    assert want.keys() == got.keys() and want
    for name, tensor in want.items():  # training.average's moving average, bit for bit
        assert torch.equal(got[name], tensor), name


def test_the_run_page_shows_the_heldout_loss_beside_the_training_loss(
    runs: dict, tmp_path: Path
) -> None:
    from factory.report.run_page import write_report
    from factory.report.run_plots import plots

    metrics = read_metrics(runs["dir"])
    curves = metrics.heldout_curves()
    assert list(curves) == [*CATEGORIES, None]
    assert [r.step for r in curves[None]] == [2, 4, RUN]
    page = write_report(runs["dir"], tmp_path / "report").read_text()
    assert "<h2>Held-out loss</h2>" in page and "all sets" in page and "MTP 2" in page
    overall = curves[None][-1]
    assert f"{overall.loss:.4f}" in page
    without = dataclasses.replace(metrics, heldout=())  # the same run, not evaluated
    assert dict(plots(metrics))["loss.png"] != dict(plots(without))["loss.png"]
