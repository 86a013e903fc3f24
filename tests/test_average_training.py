"""``training.average``: an EMA of the fp32 masters kept while training. It changes no loss and
no weight, follows its documented formula bit for bit (checked against the masters of a
checkpoint per step), resumes after SIGKILL bit for bit, lands in RUN/averaged/ema/ with an
export transformers loads, and is checked at validate (test_average_distributed.py: on two
gloo processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from average_helpers import (
    DECAY,
    STEPS,
    blueprint,
    expected_average,
    read,
    same_state,
    train,
)
from runtime_helpers import tiny_blueprint
from safetensors.torch import load_file

from factory.checks import run_rules
from factory.exports.megatron_refusals import not_carried
from factory.runtime.averaging import AVERAGE, MODEL
from factory.runtime.batches import build_shards

DRIVER = Path(__file__).with_name("runtime_driver.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(blueprint(), tmp_path_factory.mktemp("average-data"))


@pytest.fixture(scope="module")
def averaged_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(blueprint(), tmp_path_factory.mktemp("with") / "run", data)


def test_the_average_changes_no_step_and_follows_its_formula(
    averaged_run: Path, data: Path, tmp_path: Path
):
    plain = train(blueprint(average=False), tmp_path / "plain", data)
    records = [json.loads((run / "train.json").read_text())["records"]
               for run in (plain, averaged_run)]  # fmt: skip
    assert [r["loss"] for r in records[0]] == [r["loss"] for r in records[1]]
    for step in range(1, STEPS + 1):  # every checkpoint's weights, bit for bit
        name = f"step_{step:08d}"
        assert same_state(
            read(plain / "checkpoints" / name, MODEL),
            read(averaged_run / "checkpoints" / name, MODEL),
        )
    final = averaged_run / "checkpoints" / f"step_{STEPS:08d}"
    expected = expected_average(averaged_run)
    assert same_state(read(final, AVERAGE), expected)
    assert not same_state(expected, {k: read(final, MODEL)[k] for k in expected})
    # RUN/averaged/ema: the average as an averaged checkpoint, and its export.
    folder = averaged_run / "averaged" / "ema"
    written = read(folder / "checkpoint", MODEL)
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    frozen = read(final, MODEL).keys() - expected.keys()  # the expert biases: the final ones
    assert frozen and all(torch.equal(written[k], read(final, MODEL)[k]) for k in frozen)
    record = json.loads((folder / "average.json").read_text())
    assert record["steps"] == [STEPS] and record["weighting"]["ema"] == DECAY
    exported = load_file(folder / "model" / "model.safetensors")
    name = "backbone.layers.0.mixer.in_proj.weight"
    assert torch.equal(exported[name], expected[name])
    transformers = pytest.importorskip("transformers")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "model", output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"]


def _drive(tmp: Path, data: Path, run_dir: Path, **spec: Any) -> subprocess.CompletedProcess:
    full = {"blueprint": blueprint().model_dump(mode="json"), "data": str(data),
            "run_dir": str(run_dir), "steps": STEPS, "precision": "off", **spec}  # fmt: skip
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(full))
    return subprocess.run(
        [sys.executable, str(DRIVER), str(path)], capture_output=True, text=True, timeout=240
    )


def test_a_run_with_the_average_resumes_after_sigkill_bit_for_bit(data: Path, tmp_path: Path):
    whole = _drive(tmp_path, data, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = _drive(tmp_path, data, tmp_path / "killed", kill={"step": 5})  # after step 4's
    assert killed.returncode == -9, killed.stderr
    resumed = _drive(tmp_path, data, tmp_path / "killed", resume=True)
    assert resumed.returncode == 0, resumed.stderr
    final = f"checkpoints/step_{STEPS:08d}"
    for prefix in (AVERAGE, MODEL):
        assert same_state(read(tmp_path / "whole" / final, prefix),
                          read(tmp_path / "killed" / final, prefix))  # fmt: skip


def test_validate_refuses_a_bad_decay_and_a_start_past_the_run():
    with pytest.raises(ValueError, match="decay"):
        tiny_blueprint(training={"average": {"decay": 1.0}})
    bp = tiny_blueprint(training={"steps": 8, "average": {"decay": 0.9, "start": 8}})
    findings = [f for _, f in run_rules(bp) if f.path == "training.average.start"]
    assert findings and "past the run's last step (8 steps" in findings[0].message
    assert not [f for _, f in run_rules(tiny_blueprint(training={"average": {"decay": 0.9}}))
                if f.path.startswith("training.average")]  # fmt: skip


def test_the_megatron_export_says_it_does_not_carry_the_average():
    with_average = [path for path, _ in not_carried(blueprint())]
    assert "training.average" in with_average
    assert "training.average" not in [path for path, _ in not_carried(blueprint(average=False))]
