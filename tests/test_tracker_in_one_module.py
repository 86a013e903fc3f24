"""A new experiment tracker is one module: this one.

It declares a tracker ``csv`` as a maintainer would: a subclass of
``factory.runtime.loggers.tracker.Tracker`` that says how a scalar and a note
are written (what ``factory/runtime/loggers/csv_log.py`` would hold), and its
registry entry (the line ``schemas/trackers.py`` would gain; it needs no
optional package, so no extra). Editing nothing in factory, ``factory validate``
accepts a blueprint naming it, the JSON Schema lists it, and a training run
writes every step's numbers to it, equal to ``metrics.jsonl``'s.
CONTRIBUTING.md ("Adding an experiment tracker") points here.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PRESETS
from runtime_helpers import tiny_blueprint

import factory
from factory.runtime.batches import build_shards
from factory.runtime.loggers.tracker import STEP_SCALARS, Tracker
from factory.schemas.blueprint import Blueprint
from factory.schemas.trackers import TRACKERS, TrackerEntry, register_tracker

SCALARS = "scalars.csv"
STEPS = 3


class CsvLog(Tracker):
    """Rank 0's scalars as ``step,tag,value`` rows of ``<run>/scalars.csv``; notes as rows
    whose value is the note's text."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        with (self.run_dir / SCALARS).open("a", newline="") as file:
            csv.writer(file).writerows((step, tag, repr(value)) for tag, value in values.items())

    def note(self, step: int, tag: str, text: str) -> None:
        with (self.run_dir / SCALARS).open("a", newline="") as file:
            csv.writer(file).writerow((step, f"notes/{tag}", text))


@pytest.fixture
def csv_tracker() -> Iterator[TrackerEntry]:
    """The entry as ``schemas/trackers.py`` would register it, for this test only (the
    shipped registry must hold exactly the shipped trackers elsewhere)."""
    entry = register_tracker(TrackerEntry("csv", build=f"{__name__}:CsvLog"))
    yield entry
    del TRACKERS[entry.name]


def _blueprint_naming_csv(write_yaml) -> Path:
    return write_yaml(f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  loggers: [jsonl, csv]\n")


def test_validate_accepts_the_name_and_the_schema_lists_it(
    csv_tracker: TrackerEntry, cli, write_yaml
) -> None:
    status, _, err = cli("validate", str(_blueprint_naming_csv(write_yaml)))
    assert status == 0, err
    training = Blueprint.model_json_schema()["$defs"]["TrainingConfig"]
    assert training["properties"]["loggers"]["items"]["enum"] == [
        "jsonl",
        "tensorboard",
        "wandb",
        "csv",
    ]


def test_without_its_entry_the_name_is_refused(cli, write_yaml) -> None:
    path = _blueprint_naming_csv(write_yaml)
    status, _, err = cli("validate", str(path))
    assert status == 2 and f"{path.name}:3: training.loggers[1]: " in err and "'csv'" in err


def test_a_run_writes_every_step_to_the_tracker(csv_tracker: TrackerEntry, tmp_path: Path) -> None:
    bp = tiny_blueprint(training={"loggers": ["jsonl", "csv"]})
    data = build_shards(bp, tmp_path / "data")
    run = tmp_path / "run"
    factory.train(bp, out=run, data=data, steps=STEPS, precision="off")

    rows = list(csv.reader((run / SCALARS).open(newline="")))
    written: dict[int, dict[str, float]] = {}
    for step, tag, value in rows:
        if not tag.startswith("notes/"):
            written.setdefault(int(step), {})[tag] = float(value)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    for record in steps:
        expected = {name: float(record[name]) for name in STEP_SCALARS}
        expected.update({f"max_vio/{k}": v for k, v in record["max_vio"].items()})
        expected.update({f"residual_rms/{k}": v for k, v in record["residual_rms"].items()})
        assert record["max_vio"] and record["residual_rms"]
        assert {k: written[record["step"]][k] for k in expected} == expected
    assert rows[-1][1:] == ["notes/run", "completed"]
