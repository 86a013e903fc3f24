"""``factory train``: a proxy trains end to end; bad requests exit 2 before any work."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from preset_stages import stage_alone

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def nano(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Nano's phase 1 alone: one run of one stage, in the flat run folder (the program's
    stages are tests/test_train_program.py's)."""
    return str(stage_alone("nano", "phase1", tmp_path_factory.mktemp("blueprints")))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, nano: str) -> Path:
    from factory.cli.app import main

    out = tmp_path_factory.mktemp("train") / "nano-proxy"
    assert main(["train", nano, "--proxy", "--steps", "2", "--out", str(out)]) == 0
    return out


def test_writes_records_checkpoint_and_data(trained: Path) -> None:
    summary = json.loads((trained / "train.json").read_text())
    assert summary["blueprint"] == "nano-proxy" and summary["diverged"] is False
    assert [r["step"] for r in summary["records"]] == [0, 1]
    assert all(r["finite"] for r in summary["records"])
    tokens = summary["records"][-1]["tokens_seen"]
    assert tokens == 2 * 8 * 256  # two steps of the proxy's global batch of 8 x 256
    assert (trained / "model" / "config.json").is_file()
    assert (trained / "model" / "model.safetensors").is_file()
    assert (trained / "data" / "manifest.json").is_file()
    assert not (trained / "data" / ".work").exists()


def test_the_checkpoint_holds_the_trained_weights(trained: Path, nano: str) -> None:
    """The export is the model after its optimizer steps, not the initialisation."""
    import factory
    from factory.graph.weights import read_state_dict

    trained_state = read_state_dict(trained / "model")
    initial = factory.compile(factory.load_blueprint(nano), proxy=True, seed=1234)
    initial_state = initial.model.state_dict()
    key = "backbone.embeddings.weight"
    assert key in trained_state
    assert not trained_state[key].equal(initial_state[key])


def test_reuses_built_shards(cli: Cli, trained: Path, tmp_path: Path, nano: str) -> None:
    out = tmp_path / "again"
    status, _, err = cli(
        "train",
        nano,
        "--proxy",
        "--steps",
        "1",
        "--data",
        str(trained / "data"),
        "--out",
        str(out),
    )
    assert status == 0, err
    assert not (out / "data").exists()
    assert len(json.loads((out / "train.json").read_text())["records"]) == 1


def test_refuses_a_model_too_big_for_the_machine(cli: Cli, tmp_path: Path) -> None:
    status, _, err = cli("train", "nano", "--steps", "1", "--out", str(tmp_path / "x"))
    assert status == 2
    assert "31,577,940,288 parameters" in err and "--proxy" in err
    assert not (tmp_path / "x").exists()


def test_bad_precision_and_unknown_keys_exit_2(cli: Cli, tmp_path: Path) -> None:
    status, _, err = cli("train", "nano", "--proxy", "--precision", "fp3", "--out", str(tmp_path))
    assert status == 2 and "--precision" in err
    status, out, err = cli("train", "nano", "--proxy", "--set", "model.hidden_sise=3")
    assert status == 2
    assert "did you mean 'hidden_size'" in out + err


def test_te_without_transformer_engine_exits_2(cli: Cli, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    status, _, err = cli(
        "train", "nano", "--proxy", "--precision", "te", "--out", str(tmp_path / "x")
    )
    assert status == 2 and "factory[gpu]" in err
    assert not (tmp_path / "x").exists()


def test_writes_checkpoints_metrics_and_report(trained: Path) -> None:
    lines = (trained / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds[0] == "run" and kinds.count("step") == 2 and kinds[-1] == "end"
    assert (trained / "checkpoints" / "step_00000002" / "meta.json").is_file()
    page = (trained / "report" / "report.html").read_text()
    assert "data:image/png;base64," in page


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def test_rerunning_into_the_folder_resumes_and_continues(
    cli: Cli, trained: Path, tmp_path: Path, nano: str
) -> None:
    out = _copy_run(trained, tmp_path)
    status, _, err = cli("train", nano, "--proxy", "--steps", "3", "--out", str(out))
    assert status == 0, err
    steps = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert [s["step"] for s in steps] == [0, 1, 2]  # steps 0 and 1 were not run again


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("damage", ["truncate", "other_blueprint"])
def test_a_bad_checkpoint_exits_2_and_damages_nothing(
    cli: Cli, trained: Path, tmp_path: Path, damage: str, nano: str
) -> None:
    out = _copy_run(trained, tmp_path)
    checkpoint = out / "checkpoints" / "step_00000002"
    if damage == "truncate":
        shard = next(checkpoint.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        args: tuple[str, ...] = (nano, "--proxy")
    else:
        other = stage_alone("super", "phase1", tmp_path)
        args = (str(other), "--proxy", "--data", str(trained / "data"))
    before = _tree(out)
    status, _, err = cli("train", *args, "--steps", "3", "--out", str(out))
    assert status == 2, err
    assert "step_00000002" in err
    assert ("cannot be read" if damage == "truncate" else "written for another model") in err
    assert _tree(out) == before


def test_resume_with_nothing_to_resume_exits_2(
    cli: Cli, trained: Path, tmp_path: Path, nano: str
) -> None:
    out = tmp_path / "fresh"
    status, _, err = cli(
        "train", nano, "--proxy", "--steps", "1", "--data", str(trained / "data"),
        "--out", str(out), "--resume",
    )  # fmt: skip
    assert status == 2 and "no complete checkpoint to resume from" in err


def test_data_that_does_not_verify_exits_2(
    cli: Cli, trained: Path, tmp_path: Path, nano: str
) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(trained / "data", data)
    shard = sorted((data / "shards").glob("*.tar"))[0]
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 0xFF  # one flipped bit inside a sample
    shard.write_bytes(bytes(raw))
    out = tmp_path / "run"
    status, _, err = cli(
        "train", nano, "--proxy", "--steps", "1", "--data", str(data), "--out", str(out)
    )
    assert status == 2 and shard.name in err
