"""The held-out loss is the same on one process and on two gloo processes (DP=2 under FSDP,
TP=2 with sequence parallelism, CP=2 across the held-out samples' document cuts): the same micro-batches dealt out, the sums summed over the
ranks, so the numbers agree up to the order of a sum (1e-6 relative); and a training's
``training.eval`` runs on every rank of a DP=2 run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from heldout_fixtures import add_heldout_sets
from runtime_helpers import GLOBAL, tiny_blueprint

import factory
from factory import compilation
from factory.data.shards.heldout import heldout_sets
from factory.distributed.local import run_ranks
from factory.planner.layout import resolve_layout
from factory.report.run_metrics import read_metrics
from factory.runtime.batches import build_shards
from factory.runtime.evaluation import Evaluation, evaluate
from factory.runtime.placement import lay_out, materialize_shards
from factory.runtime.ranks import joined_ranks
from factory.schemas.blueprint import Blueprint

TOKENS = 7 * 64  # seven samples: an odd number of micro-batches of two, dealt to two ranks
RTOL = 1e-6


def _blueprint(world: int, **parallelism: Any) -> Blueprint:
    bp = tiny_blueprint(
        parallelism={"world_size": world, "global_batch_size": 2 * GLOBAL, **parallelism},
        training={"steps": 1, "checkpoint_interval": 1, "eval": {"interval": 1, "tokens": TOKENS}},
    )
    data = bp.model_dump(exclude_unset=True)
    # No aux loss: with sequence parallelism each TP rank's would see half of each sequence.
    data["model"]["moe"].setdefault("router", {})["aux_loss"] = "none"
    return Blueprint.model_validate(data)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_heldout_sets(build_shards(_blueprint(1), tmp_path_factory.mktemp("dist-eval")))


def _sets(data: Path) -> dict[str, Path]:
    return {category: s.folder for category, s in heldout_sets(data).items()}


def _evaluate_rank(rank: int, world: int, bp: Blueprint, data: Path) -> Evaluation:
    with joined_ranks(resolve_layout(bp)) as ranks:
        compiled = compilation.compile(
            bp, device=ranks.device, seed=0, precision="off", deferred=True
        )
        lay_out(compiled, ranks)
        materialize_shards(compiled, ranks, 0)
        micro = bp.parallelism.micro_batch_size
        return evaluate(compiled.model, _sets(data), TOKENS, micro, bp.model.mtp_depth, ranks)


def _close(ours: Evaluation, theirs: Evaluation) -> None:
    assert ours.sets.keys() == theirs.sets.keys()
    pairs = zip(ours.sets.values(), theirs.sets.values(), strict=True)
    for a, b in [*pairs, (ours.overall, theirs.overall)]:
        assert a.tokens == b.tokens
        assert a.loss == pytest.approx(b.loss, rel=RTOL)
        assert a.mtp_losses == pytest.approx(b.mtp_losses, rel=RTOL)


@pytest.fixture(scope="module")
def one_process(data: Path) -> Evaluation:
    bp = _blueprint(1)
    compiled = factory.compile(bp, seed=0, precision="off")
    micro = bp.parallelism.micro_batch_size
    return evaluate(compiled.model, _sets(data), TOKENS, micro, bp.model.mtp_depth)


@pytest.mark.parametrize(
    "parallelism",
    [
        pytest.param({}, id="dp2-fsdp"),
        pytest.param({"tp": 2, "sequence_parallel": True, "etp": 1}, id="tp2-sp"),
        pytest.param({"cp": 2}, id="cp2"),
    ],
)
def test_two_processes_give_the_one_process_loss(
    parallelism: dict[str, Any], data: Path, one_process: Evaluation
) -> None:
    results = run_ranks(_evaluate_rank, 2, _blueprint(2, **parallelism), data, timeout=240)
    for result in results:  # every rank has the whole number
        _close(result, one_process)
    assert one_process.overall.mtp_losses  # the MTP depths are compared too


def _train_rank(rank: int, world: int, bp: Blueprint, out: Path, data: Path) -> None:
    factory.train(bp, out=out, data=data, precision="off", seed=0)


def test_a_dp2_training_records_the_one_process_heldout_loss(data: Path, tmp_path: Path) -> None:
    run_ranks(_train_rank, 2, _blueprint(2), tmp_path / "dp2", data, timeout=240)
    factory.train(_blueprint(1), out=tmp_path / "one", data=data, precision="off", seed=0)
    ours, theirs = (read_metrics(tmp_path / name).heldout for name in ("dp2", "one"))
    assert [(r.step, r.category, r.tokens) for r in ours] == [
        (r.step, r.category, r.tokens) for r in theirs
    ]
    assert [r.step for r in ours if r.category is None] == [1]
    for a, b in zip(ours, theirs, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)  # after an Adam step: its tolerance
