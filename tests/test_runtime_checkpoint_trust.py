"""A checkpoint folder is read as data: each pickle in it that would run code is refused as
a checkpoint that cannot be read, and the code does not run; what factory writes (every
precision recipe's state included) reads back."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from runtime_helpers import MICRO, tiny_blueprint

import factory
from factory.runtime.batches import build_shards
from factory.runtime.checkpoint import CheckpointDamaged, Checkpointer, read_checkpoint
from factory.runtime.checkpoint_trust import load_local
from factory.runtime.fit import fit
from factory.runtime.loader import ShardLoader
from factory.runtime.run_options import RunOptions


class _RunsCode:
    """Unpickled, it makes the folder ``marker``: proof that the pickle's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


@dataclass
class _Stats:
    """State a quantizer might keep as an object instead of plain data."""

    calls: int


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((3, 4), value)}, "optimizer": {"step": torch.tensor(value)}}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A checkpoint as factory writes it: DCP tensors, rank 0's plain state, meta.json."""
    local = {"rng": {"torch": torch.get_rng_state()}, "precision": {"history": [1.5], "n": 2}}
    return Checkpointer(tmp_path / "checkpoints").save(1, _state(1.0), local, {"fingerprint": "f"})


def test_what_factory_writes_reads_back(checkpoint: Path) -> None:
    state = _state(0.0)
    _, local = read_checkpoint(checkpoint, state, "f")
    assert torch.equal(state["model"]["w"], torch.full((3, 4), 1.0))
    assert local["precision"] == {"history": [1.5], "n": 2}
    assert torch.equal(local["rng"]["torch"], torch.get_rng_state())


def test_a_state_resume_would_refuse_fails_its_save(tmp_path: Path) -> None:
    """A rank's state holding anything but plain data (a dataclass, say) is refused when it
    is saved, and leaves no checkpoint: not found out at a resume hours later."""
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    local = {"precision": {"stats": _Stats(3)}}
    with pytest.raises(TypeError, match=r"a rank's own state must hold only tensors, numbers"):
        checkpointer.save(1, _state(1.0), local, {"fingerprint": "f"})
    assert not list((tmp_path / "checkpoints").iterdir())


def _refused(checkpoint: Path, marker: Path, says: str) -> None:
    with pytest.raises(CheckpointDamaged) as refused:
        read_checkpoint(checkpoint, _state(0.0), "f")
    line = str(refused.value)
    assert line.startswith(f"{checkpoint}: cannot be read (UnpicklingError: ") and says in line
    assert "refused unread" in line and "\n" not in line and "weights_only=False" not in line
    assert not marker.exists()


def test_a_rank_file_that_would_run_code_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"rng": _RunsCode(marker)}, buffer)
    (checkpoint / "rank0.pt").write_bytes(buffer.getvalue())
    _refused(checkpoint, marker, "rank0.pt holds more than tensors, numbers, strings")


def test_dcp_metadata_that_would_run_code_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """torch.distributed.checkpoint unpickles ``.metadata`` with ``pickle.load``; factory
    reads it with an unpickler that finds DCP's own classes only."""
    marker = tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _refused(checkpoint, marker, ".metadata names posix.mkdir, which no DCP metadata holds")


def test_a_dcp_entry_stored_as_a_pickle_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """DCP stores a value that is not a tensor with torch.save and reads it back with
    ``weights_only=False``; factory never stores one, so it reads none."""
    marker = tmp_path / "ran"
    planted = _state(1.0)
    planted["model"]["w"] = _RunsCode(marker)
    for stale in checkpoint.glob("*.distcp"):
        stale.unlink()
    with warnings.catch_warnings():  # one process, overwriting: as meant
        warnings.simplefilter("ignore")
        dcp.save(planted, checkpoint_id=str(checkpoint), no_dist=True)
    _refused(checkpoint, marker, "model.w is stored as a pickle, not a tensor")


def test_metadata_naming_a_file_outside_the_folder_is_refused(checkpoint: Path) -> None:
    with open(checkpoint / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # the test's own file, written just now
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _refused(checkpoint, checkpoint / "never", "names a data file '../../elsewhere.distcp' outside")


RECIPES = {
    "nvfp4": {"recipe": "nvfp4"},
    "fp8 delayed": {"recipe": "fp8", "fp8": {"scaling": "delayed"}},
    "mor": {"recipe": "mor"},
}
"""Every recipe whose quantizers keep state: random generators, amax histories, counts."""


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shards(tiny_blueprint(), tmp_path_factory.mktemp("trust-data"))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipes_precision_state_is_plain_data(
    recipe: str, shards: Path, tmp_path: Path
) -> None:
    """The rank's own file of a real run reads back with ``weights_only=True``, equal to the
    precision runtime's state it was written from."""
    precision = {**RECIPES[recipe], "high_precision": {"first": 0, "last": 0, "layers": []}}
    compiled = factory.compile(tiny_blueprint(precision=precision), seed=0, precision="emulate")
    options = RunOptions(run_dir=tmp_path / "run", checkpoint_every=2)
    with ShardLoader(shards, MICRO, seed=3) as loader:
        fit(compiled, loader, 2, options)
    assert compiled.precision is not None
    written = compiled.precision.state_dict()
    local = load_local(tmp_path / "run" / "checkpoints" / "step_00000002" / "rank0.pt")
    assert any(written["quantizers"].values())  # the recipe has state to keep
    assert _equal(local["precision"], written)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b
