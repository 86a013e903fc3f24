"""Checkpoint averaging (``factory average``): the fp32 arithmetic bit for bit on crafted
checkpoints, the exponential weights as documented, the refusals (exit 2 naming the flag), a
program's stage, and the averaged export read back by transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from runtime_helpers import tiny_blueprint

import factory
from factory.graph.weights import read_state_dict
from factory.jobs.average import AverageRefused, average
from factory.jobs.train_request import CheckpointPolicy
from factory.runtime.averaging import average_checkpoints, checkpoint_weights
from factory.runtime.batches import build_shards
from factory.runtime.checkpoint import read_checkpoint, single_process_quiet


def crafted(folder: Path, step: int, master: torch.Tensor, fingerprint: str = "f") -> Path:
    """A checkpoint as training writes one for a bf16 model: ``w``'s fp32 master beside its
    bf16 copy, an fp32 parameter ``n`` (its own master) and an integer buffer ``count``."""
    path = folder / "checkpoints" / f"step_{step:08d}"
    state = {
        "model": {"w": master.bfloat16(), "n": master[0] * 3, "count": torch.tensor([step])},
        "optimizer": {
            "state": {"w": {"exp_avg": torch.ones_like(master)}},
            "masters": {"w": master.clone()},
        },
    }
    with single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    meta = {"blueprint": "crafted", "fingerprint": fingerprint, "position": {"step": step}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_equal_checkpoints_average_to_that_checkpoint_bit_for_bit(tmp_path: Path):
    master = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    paths = [crafted(tmp_path, step, master) for step in (2, 4, 6)]
    for decay in (1.0, 0.7):
        out = average_checkpoints(paths, decay)
        assert torch.equal(out["optimizer.masters.w"], master)
        assert torch.equal(out["model.w"], master.bfloat16())
        assert torch.equal(out["model.n"], master[0] * 3)
        assert torch.equal(out["model.count"], torch.tensor([6]))  # not floating: the newest's
        assert not any(key.startswith("optimizer.state") for key in out)


def test_two_checkpoints_average_to_their_fp32_mean_bit_for_bit(tmp_path: Path):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 33, generator=gen), torch.randn(64, 33, generator=gen) * 1e-3
    paths = [crafted(tmp_path, 2, a), crafted(tmp_path, 4, b)]
    mean = (a + b) / 2  # as fp32 computes it
    for group_bytes in (1, 1 << 30):  # one tensor per read, and all at once
        out = average_checkpoints(paths, group_bytes=group_bytes)
        assert torch.equal(out["optimizer.masters.w"], mean)
        assert torch.equal(out["model.w"], mean.bfloat16())  # from the masters, not the bf16s
        assert torch.equal(out["model.n"], (a[0] * 3 + b[0] * 3) / 2)
    assert not torch.equal(mean.bfloat16(), ((a.bfloat16() + b.bfloat16()) / 2).bfloat16())


def test_exponential_weights_are_decay_to_the_age_normalised(tmp_path: Path):
    assert checkpoint_weights(3, 0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7], abs=0)
    assert checkpoint_weights(4) == [0.25] * 4
    with pytest.raises(ValueError, match="0 < decay <= 1"):
        checkpoint_weights(2, 1.5)
    values = [torch.full((3,), v) for v in (1.0, 10.0, 100.0)]
    paths = [crafted(tmp_path, 2 * i + 2, v) for i, v in enumerate(values)]
    out = average_checkpoints(paths, decay=0.5)
    expected = (1.0 * 1 + 10.0 * 2 + 100.0 * 4) / 7
    assert torch.equal(
        out["optimizer.masters.w"], torch.full((3,), expected, dtype=torch.float64).float()
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained 8 steps with a checkpoint every 2 (all four kept)."""
    folder = tmp_path_factory.mktemp("average")
    bp = tiny_blueprint()
    data = build_shards(bp, folder / "data")
    run = folder / "run"
    factory.train(bp, out=run, data=data, steps=8, checkpoints=CheckpointPolicy(every=2, keep=5))
    return run


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from factory.runtime.averaging import MODEL, stored_tensors

    keys = [k for k in stored_tensors(checkpoint) if k.startswith(MODEL)]
    state = {k: torch.empty(stored_tensors(checkpoint)[k].shape) for k in keys}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return {k.removeprefix(MODEL): v for k, v in state.items()}


def test_a_run_averages_into_a_checkpoint_and_an_export_transformers_loads(
    trained: Path, cli, tmp_path: Path
):
    status, out, err = cli("average", str(trained), "--last", "2")
    assert status == 0, err
    folder = trained / "averaged" / "last2"
    assert f"-> {folder}" in out
    record = json.loads((folder / "average.json").read_text())
    assert record == {"stage": "train", "steps": [6, 8], "weights": [0.5, 0.5],
                      "weighting": "uniform"}  # fmt: skip
    six = model_tensors(trained / "checkpoints" / "step_00000006")
    eight = model_tensors(trained / "checkpoints" / "step_00000008")
    averaged = model_tensors(folder / "checkpoint")
    assert averaged.keys() == six.keys()
    assert all(torch.equal(averaged[k], (six[k] + eight[k]) / 2) for k in six)
    # The averaged checkpoint reads as a training checkpoint's weights do.
    meta = json.loads((trained / "checkpoints" / "step_00000008" / "meta.json").read_text())
    state = {"model": {k: torch.empty_like(v) for k, v in six.items()}}
    read_checkpoint(folder / "checkpoint", state, meta["fingerprint"])
    assert all(torch.equal(state["model"][k], averaged[k]) for k in six)
    # Its HF export: the same tensors, copied by `factory export hf --averaged`.
    exported = read_state_dict(folder / "model")
    assert all(torch.equal(exported[k], averaged[k]) for k in exported)
    status, _, err = cli(
        "export", "hf", str(trained), "--averaged", "last2", "--out", str(tmp_path / "hf")
    )
    assert status == 0, err
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        folder / "model" / "model.safetensors"
    ).read_bytes()
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"]
    loaded = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}  # its prefix
    name = "layers.0.mixer.in_proj.weight"
    assert torch.equal(loaded[name], averaged[f"backbone.{name}"])
    status, _, err = cli("export", "hf", str(trained), "--averaged", "last3", "--out", "o")
    assert status == 2 and "--averaged: no averaged checkpoint 'last3'" in err


def test_exponential_average_of_a_run(trained: Path):
    result = average(trained, steps=[4, 8], ema=0.5, export=False)
    assert result.folder == trained / "averaged" / "steps4_8-ema0.5"
    assert result.weights == pytest.approx((1 / 3, 2 / 3)) and result.model is None
    four = model_tensors(trained / "checkpoints" / "step_00000004")
    eight = model_tensors(trained / "checkpoints" / "step_00000008")
    got = model_tensors(result.folder / "checkpoint")
    for k in four:
        expected = (four[k].double() * 0.5 + eight[k].double()) / 1.5
        assert torch.equal(got[k], expected.float())


@pytest.mark.parametrize(
    ("args", "flag", "says"),
    [
        (["--last", "5"], "--last", "5 checkpoints asked for, but the run has 4 checkpoints "
                                    "kept (steps 2, 4, 6, 8)"),
        (["--last", "0"], "--last", "0 checkpoints asked for"),
        (["--steps", "4,5"], "--steps", "no checkpoint of step 5; the run has 4 checkpoints"),
        (["--last", "2", "--ema", "1.5"], "--ema", "the decay must be in (0, 1]"),
        (["--last", "2", "--name", "../x"], "--name", "is not a folder name"),
        (["--last", "2", "--steps", "2"], "--last", "one of them"),
        (["--last", "2", "--stage", "sft"], "--stage", "no stage 'sft'"),
    ],
)  # fmt: skip
def test_bad_arguments_exit_2_naming_the_flag(trained: Path, cli, args, flag, says):
    status, _, err = cli("average", str(trained), *args)
    assert status == 2
    assert f"{flag}: " in err and says in err


def test_not_a_run_folder_and_other_models_are_refused(trained: Path, cli, tmp_path: Path):
    status, _, err = cli("average", str(tmp_path), "--last", "1")
    assert status == 2 and "RUN: " in err and "not a run folder" in err
    run = tmp_path / "run"
    shutil.copytree(trained / "checkpoints", run / "checkpoints")
    meta_file = run / "checkpoints" / "step_00000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "fingerprint": "0" * 64}))
    with pytest.raises(AverageRefused, match="step 4 holds another model than step 8") as refused:
        average(run, steps=[4, 8], export=False)
    assert refused.value.argument == "--steps"
    # Without model/ (the run has not finished) the export has no config to take.
    with pytest.raises(AverageRefused, match="--no-export writes the averaged checkpoint alone"):
        average(run, last=1)
    assert not (run / "averaged").exists()  # refused before anything was written


def test_a_program_averages_within_one_stage(trained: Path, cli, tmp_path: Path):
    run = tmp_path / "program"
    for stage in ("pretrain", "sft"):
        shutil.copytree(trained / "checkpoints", run / stage / "checkpoints")
        shutil.copytree(trained / "model", run / stage / "model")
    stages = [{"name": s, "status": "completed", "steps": 8} for s in ("pretrain", "sft")]
    (run / "program.json").write_text(json.dumps({"blueprint": "tiny", "stages": stages}))
    status, _, err = cli("average", str(run), "--last", "2", "--stage", "pretrain", "--no-export")
    assert status == 0, err
    assert (run / "pretrain" / "averaged" / "last2" / "checkpoint" / "meta.json").is_file()
    assert not (run / "pretrain" / "averaged" / "last2" / "model").exists()
    status, _, err = cli("average", str(run), "--last", "3")  # the final stage by default
    assert status == 0, err
    assert (
        json.loads((run / "sft" / "averaged" / "last3" / "average.json").read_text())["stage"]
        == "sft"
    )
    status, _, err = cli("export", "hf", str(run), "--averaged", "last3", "--out",
                         str(tmp_path / "hf"))  # fmt: skip
    assert status == 0, err


def test_a_damaged_checkpoint_exits_1_naming_it(trained: Path, cli, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(trained / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step_00000006" / ".metadata").write_bytes(b"not a pickle")
    status, _, err = cli("average", str(run), "--last", "2", "--no-export")
    assert status == 1 and "step_00000006: cannot be read" in err
