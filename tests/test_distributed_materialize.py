"""A model built on meta, laid out, then filled rank by rank holds one process's values exactly.

Each layout's ranks fill only their shards (``factory.distributed.materialize``): from the
spec's init rules, every tensor is drawn from the seed and its name (experts one by one), and
from a Hugging Face checkpoint each rank reads only its slices. Gathered whole on rank 0, the
weights equal ``factory.compile``'s (or the checkpoint's) bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import tiny_blueprint

import factory
from factory.distributed.local import run_ranks
from factory.distributed.mesh import build_meshes
from factory.exports.hf import write_hf_checkpoint
from factory.planner.layout import resolve_layout
from factory.runtime.placement import full_weights, lay_out, materialize_shards
from factory.runtime.ranks import DistributedRanks
from factory.schemas.blueprint import Blueprint

TIMEOUT = 240
LAYOUTS = {
    "dp2-fsdp": (2, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True, "etp": 1}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "cp2": (2, {"cp": 2}),
}


def _blueprint(world: int, checkpoint: str | None = None, **parallelism: Any) -> Blueprint:
    bp = tiny_blueprint(parallelism={"world_size": world, "global_batch_size": 8, **parallelism})
    data = bp.model_dump(exclude_unset=True)
    data["model"]["pattern"] = "ME|M*E" if parallelism.get("pp", 1) > 1 else "MEM*E"
    if checkpoint is not None:
        data["model"].setdefault("init", {})["checkpoint"] = checkpoint
    return Blueprint.model_validate(data)


def _gathered(rank: int, world: int, bp: Blueprint) -> dict[str, torch.Tensor] | None:
    ranks = DistributedRanks(build_meshes(resolve_layout(bp), "cpu"))
    compiled = factory.compile(bp, seed=7, precision="off", deferred=True)
    lay_out(compiled, ranks)
    materialize_shards(compiled, ranks, seed=7)
    return full_weights(compiled.model, ranks)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_draws_one_process_initial_values(layout: str) -> None:
    world, parallelism = LAYOUTS[layout]
    bp = _blueprint(world, **parallelism)
    got = run_ranks(_gathered, world, bp, timeout=TIMEOUT)[0]
    want = factory.compile(_blueprint(1), seed=7, precision="off").model.state_dict()
    _assert_equal(got, want)


def test_each_rank_reads_its_slices_of_a_checkpoint(tmp_path: Path) -> None:
    source = factory.compile(_blueprint(1), seed=3, precision="off").model
    write_hf_checkpoint(source, _blueprint(1), tmp_path / "hf")
    bp = _blueprint(2, checkpoint=str(tmp_path / "hf"), tp=2, sequence_parallel=True, etp=1)
    got = run_ranks(_gathered, 2, bp, timeout=TIMEOUT)[0]
    _assert_equal(got, source.state_dict())
