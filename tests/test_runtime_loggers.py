"""``training.loggers``: TensorBoard and W&B get what ``metrics.jsonl`` holds, read back with
each library's own files (TensorBoard's event reader; W&B's offline run folder)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import PRESETS
from runtime_helpers import MICRO, tiny_blueprint

import factory
from factory.runtime.batches import build_shards
from factory.runtime.callbacks import Callback, Event, StepStats, TrainerView, Verdict
from factory.runtime.fit import fit
from factory.runtime.loader import ShardLoader
from factory.runtime.loggers import run_loggers, tracker_class
from factory.runtime.loggers.tracker import Tracker
from factory.runtime.ranks import SingleProcess
from factory.runtime.run_options import RunOptions
from factory.schemas.trackers import TRACKERS, TrackerEntry, logger_names, register_tracker

REPO = Path(__file__).resolve().parent.parent

STEP_FIELDS = ("loss", "lm_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "seconds")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tiny_blueprint(), tmp_path_factory.mktemp("loggers-data"))


class RollbackAt(Callback):
    """Asks once for a rollback at ``step``, as a monitor would."""

    def __init__(self, step: int) -> None:
        self.step, self.asked = step, False

    def check_step(self, trainer: TrainerView, stats: StepStats) -> Verdict:
        if stats.step != self.step or self.asked:
            return Verdict()
        self.asked = True
        event = Event(stats.update, stats.step, "probe", "rollback", "probe fired", 2.5, 1.0)
        return Verdict((event,))


def _train(shards: Path, run_dir: Path, names: list[str], steps: int, **kw: Any) -> None:
    bp = tiny_blueprint(training={"loggers": names})
    compiled = factory.compile(bp, seed=0, precision="off")
    extra = [RollbackAt(kw.pop("rollback_at"))] if "rollback_at" in kw else []
    options = RunOptions(run_dir=run_dir, checkpoint_every=1, **kw)
    with ShardLoader(shards, MICRO, seed=7) as batches:
        assert fit(compiled, batches, steps, options, extra).end == "completed"


def _step_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's step records, the last of each step winning (re-run after a rollback
    or a resume)."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "step":
            records[record["step"]] = record
    return records


def _expected_scalars(record: dict[str, Any]) -> dict[str, float]:
    values = {name: float(record[name]) for name in STEP_FIELDS}
    values.update({f"max_vio/{k}": v for k, v in record["max_vio"].items()})
    values.update({f"residual_rms/{k}": v for k, v in record["residual_rms"].items()})
    return values


def test_every_logger_is_metrics_jsonl_or_a_tracker() -> None:
    assert logger_names() == ("jsonl", "tensorboard", "wandb")


@pytest.mark.parametrize("entry", TRACKERS.values(), ids=list(TRACKERS))
def test_each_tracker_entry_builds_a_tracker_its_extra_installs(entry: TrackerEntry) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    [own] = [r for r in extras["dev"] if r.startswith("nemotron-factory[")]
    assert entry.extra in extras and entry.extra in own.partition("[")[2].rstrip("]").split(",")
    assert entry.package is not None
    pytest.importorskip(entry.package)
    assert issubclass(tracker_class(entry), Tracker)


def test_each_tracker_module_has_a_registry_entry() -> None:
    folder = REPO / "factory" / "runtime" / "loggers"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "tracker"}
    named = {e.build.partition(":")[0] for e in TRACKERS.values()}
    assert named == {f"factory.runtime.loggers.{m}" for m in modules}


def test_a_tracker_entry_says_how_it_is_built_and_installed() -> None:
    with pytest.raises(ValueError, match="'module:Class'"):
        TrackerEntry("csv", build="factory.runtime.loggers.csv_log")
    with pytest.raises(ValueError, match="needs the extra"):
        TrackerEntry("csv", build="factory.runtime.loggers.csv_log:CsvLog", package="csvkit")
    for taken in ("jsonl", "wandb"):
        with pytest.raises(ValueError, match="already exists"):
            register_tracker(TrackerEntry(taken, build="factory.runtime.loggers.csv_log:CsvLog"))
    assert logger_names() == ("jsonl", "tensorboard", "wandb")


def test_rank_0_writes_every_tracker_and_the_other_ranks_only_their_own_jsonl(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    names = ["jsonl", "tensorboard", "wandb"]
    main = run_loggers(names, tmp_path, SingleProcess())
    assert [type(c).__name__ for c in main] == ["MetricsLog", "TensorBoardLog", "WandbLog"]
    other = run_loggers(names, tmp_path, SimpleNamespace(is_main=False, rank=1))  # type: ignore[arg-type]
    assert [c.path for c in other] == [tmp_path / "ranks" / "rank_00001.jsonl"]  # type: ignore[attr-defined]
    assert [type(c).__name__ for c in run_loggers([], tmp_path, SingleProcess())] == ["MetricsLog"]


def test_an_unknown_or_repeated_logger_is_a_located_error(cli, write_yaml) -> None:
    path = write_yaml(
        f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  loggers: [jsonl, tensorbord]\n"
    )
    status, _, err = cli("validate", str(path))
    assert status == 2 and f"{path.name}:3: training.loggers[1]: " in err and "tensorbord" in err
    path.write_text(f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  loggers: [wandb, wandb]\n")
    status, _, err = cli("validate", str(path))
    assert status == 2 and f"{path.name}:3: training.loggers: " in err and "wandb" in err


def test_a_tracker_that_is_not_installed_is_refused_before_training(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = dataclasses.replace(TRACKERS["wandb"], package="no_such_package_here")
    monkeypatch.setitem(TRACKERS, "wandb", absent)
    out = tmp_path / "run"
    argv = ["train", "nano", "--proxy", "--out", str(out), "--set", "training.loggers=[wandb]"]
    status, _, err = cli(*argv)
    assert status == 2, err
    assert "training.loggers" in err and "nemotron-factory[wandb]" in err
    assert "Traceback" not in err and not out.exists()


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {
        t: [(e.step, e.value) for e in accumulator.Scalars(t)]
        for t in accumulator.Tags()["scalars"]
    }


def test_tensorboard_shows_each_step_of_metrics_jsonl_once(shards: Path, tmp_path: Path) -> None:
    """A rollback at step 2 re-runs it from its checkpoint; the finished run then loses its last
    checkpoint and resumes at step 3. TensorBoard shows steps 0-3 once each, as metrics.jsonl's
    last record of each step has them, and keeps the event that caused the rollback."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    _train(shards, run, ["jsonl", "tensorboard"], 4, rollback_at=2)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    _train(shards, run, ["tensorboard"], 4, resume=True)

    records = _step_records(run)
    assert sorted(records) == list(range(4))
    scalars = _tensorboard_scalars(run / "tensorboard")
    expected = {s: _expected_scalars(r) for s, r in records.items()}
    for tag in expected[0]:
        assert [step for step, _ in scalars[tag]] == list(range(4)), tag
        for step, value in scalars[tag]:
            assert value == pytest.approx(expected[step][tag], rel=1e-6), (tag, step)
    assert scalars["events/probe"] == [(2, 2.5)]
    assert scalars["rollback/to_step"] == [(2, 2.0)]
    # Checkpoints at 1, 2, 3 and 4, then again at 3 and 4: those at and after the step the
    # rollback (2) and the resume (3) went back to went with the steps written there.
    assert [step for step, _ in scalars["checkpoint/seconds"]] == [1, 4]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2


def _wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then 32 KiB
    blocks of chunks, each with a 7-byte header (checksum, length, type: whole, first,
    middle, last), as LevelDB's log writes them."""
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def _wandb_history(path: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_offline_run_holds_each_step_and_resumes_the_same_run(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
    run = tmp_path / "run"
    _train(shards, run, ["jsonl", "wandb"], 3)
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    _train(shards, run, ["wandb"], 3, resume=True)
    # finish() can return before W&B's service has written all of a run's file: the service's
    # shutdown waits for it.
    pytest.importorskip("wandb").teardown()

    run_id = (run / "wandb" / "run-id").read_text().strip()
    logs = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(logs) == 2  # the resumed run continues the same W&B run
    records = _step_records(run)
    parts = [[r for r in _wandb_history(log) if "loss" in r] for log in logs]
    assert [r["step"] for r in parts[0]] == [0, 1, 2] and [r["step"] for r in parts[1]] == [2]
    for row in [*parts[0][:2], *parts[1]]:  # step 2 as re-run
        expected = _expected_scalars(records[row["step"]])
        assert {k: row[k] for k in expected} == pytest.approx(expected, rel=1e-6)


def test_wandb_that_cannot_start_is_a_notice_not_a_failed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WANDB_MODE=online without a login: the run goes on with metrics.jsonl, saying why."""
    wandb = pytest.importorskip("wandb")
    from factory.runtime.loggers.wandb_log import WandbLog

    def refuse(**settings: Any) -> None:
        raise wandb.errors.UsageError("No API key configured.\nUse `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    notices: list[str] = []
    trainer = SimpleNamespace(
        compiled=SimpleNamespace(blueprint=tiny_blueprint()),
        position=SimpleNamespace(step=3),
        options=SimpleNamespace(notice=notices.append),
    )
    tracker = WandbLog(tmp_path)
    tracker.pre_train(trainer)  # type: ignore[arg-type]
    tracker.scalars(3, {"loss": 1.0})
    tracker.close(trainer)  # type: ignore[arg-type]
    assert len(notices) == 1
    assert notices[0].startswith("training.loggers: W&B did not start (No API key configured.)")


def test_the_megatron_recipe_lists_the_trackers_it_leaves_to_the_operator() -> None:
    from factory.exports.megatron_refusals import not_carried
    from factory.schemas.blueprint import Blueprint

    nano = factory.load_blueprint("nano")
    assert "training.loggers" not in dict(not_carried(nano))
    data = nano.model_dump(mode="json")
    data["training"]["loggers"] = ["jsonl", "tensorboard", "wandb"]
    why = dict(not_carried(Blueprint.model_validate(data)))["training.loggers"]
    assert why.startswith("tensorboard, wandb: ")
