"""``factory train``: a proxy trains end to end; bad requests exit 2 before any work."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from factory.cli.app import main

    out = tmp_path_factory.mktemp("train") / "nano-proxy"
    assert main(["train", "nano", "--proxy", "--steps", "2", "--out", str(out)]) == 0
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


def test_the_checkpoint_holds_the_trained_weights(trained: Path) -> None:
    """The export is the model after its optimizer steps, not the initialisation."""
    import factory
    from factory.graph.weights import read_state_dict

    trained_state = read_state_dict(trained / "model")
    initial = factory.compile(factory.load_blueprint("nano"), proxy=True, seed=1234)
    initial_state = initial.model.state_dict()
    key = "backbone.embeddings.weight"
    assert key in trained_state
    assert not trained_state[key].equal(initial_state[key])


def test_reuses_built_shards(cli: Cli, trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    status, _, err = cli(
        "train",
        "nano",
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
