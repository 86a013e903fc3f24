"""``factory.runtime``: batches, the LR schedule and the training loop on a tiny Super proxy."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_helpers import GLOBAL, MICRO, SEQ, STEPS, tiny_blueprint
from shard_reference import read_shard

import factory
from factory.data.shards.shard_reader import read_samples
from factory.runtime.batches import build_shards
from factory.runtime.fit import fit
from factory.runtime.loader import ShardLoader
from factory.runtime.schedule import learning_rate
from factory.schemas.training import TrainingConfig
from factory.spec.layer_type import layer_type


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Super recipe curated and packed at SEQ tokens (one build for the session)."""
    return build_shards(tiny_blueprint(), tmp_path_factory.mktemp("super-data"))


@pytest.fixture(scope="session")
def samples(shards: Path) -> tuple[np.ndarray, np.ndarray]:
    return read_samples(shards)


@pytest.fixture
def batches(shards: Path) -> Iterator[ShardLoader]:
    with ShardLoader(shards, MICRO, seed=7) as loader:
        yield loader


def _take(stream: ShardLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(stream)
    return [(b.input_ids, b.loss_mask) for b in (next(it) for _ in range(n))]


def test_batches_carry_the_shards_tokens_and_masks(
    shards: Path, samples: tuple[np.ndarray, np.ndarray], batches: ShardLoader
) -> None:
    tokens, mask = samples
    assert tokens.shape[1] == SEQ and tokens.dtype == np.int64 and mask.dtype == bool
    first = read_shard(sorted((shards / "shards").glob("*.tar"))[0])[0]
    assert np.array_equal(tokens[0], first.tokens) and np.array_equal(mask[0], first.loss_mask)
    assert 0.2 < mask.mean() < 1.0  # prompts and padding are masked out, responses are not
    ids, loss_mask = _take(batches, 1)[0]
    assert ids.shape == loss_mask.shape == (MICRO, SEQ)
    rows = [int(np.flatnonzero((tokens == row.numpy()).all(axis=1))[0]) for row in ids]
    assert torch.equal(loss_mask, torch.from_numpy(mask[rows]))


def test_schedule_warms_up_holds_and_decays_to_min_lr() -> None:
    training = TrainingConfig.model_validate(
        {"optimizer": {"lr": 1.0, "min_lr": 0.1}, "schedule": {"warmup_fraction": 0.1}}
    )
    rates = [learning_rate(s, 100, training) for s in range(100)]
    assert rates[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert rates[10:80] == [1.0] * 70  # WSD: stable until the last 20%
    assert rates[80] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(1 / 20)))  # minus_sqrt
    assert rates[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))
    cosine = TrainingConfig.model_validate(
        {
            "optimizer": {"lr": 1.0, "min_lr": 0.1},
            "schedule": {"kind": "cosine", "warmup_fraction": 0.1},
        }
    )
    assert learning_rate(10, 100, cosine) == 1.0 and learning_rate(
        99, 100, cosine
    ) == pytest.approx(0.1)


def test_tiny_run_learns_and_is_bit_reproducible(batches: ShardLoader) -> None:
    bp = tiny_blueprint()
    runs = [factory.compile(bp, seed=0, precision="off") for _ in range(2)]
    results = [fit(compiled, batches, STEPS) for compiled in runs]
    first, second = ([r.loss for r in res.records] for res in results)
    assert first == second  # exact, not approximate
    for a, b in zip(
        runs[0].model.state_dict().values(), runs[1].model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    losses = results[0].lm_losses
    assert not results[0].diverged and len(losses) == STEPS
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5
    assert [r.tokens_seen for r in results[0].records] == [
        GLOBAL * SEQ * (s + 1) for s in range(STEPS)
    ]


def test_switch_to_bf16_happens_at_its_token_fraction(batches: ShardLoader) -> None:
    bp = tiny_blueprint(precision={"switch_to_bf16": {"after_fraction": 0.5, "scope": "forward"}})
    compiled = factory.compile(bp, seed=0, precision="emulate")
    runtime = compiled.precision
    assert runtime is not None and runtime.ops
    result = fit(compiled, batches, 4)  # half of the STEPS * GLOBAL * SEQ tokens: 4 steps
    assert [r.switched_to_bf16 for r in result.records] == [False, False, False, True]
    assert runtime.switched
    assert all(not op.quantize_forward and op.quantize_backward for op in runtime.ops)


def test_nvfp4_run_stays_finite_and_near_unquantized(batches: ShardLoader) -> None:
    bp = tiny_blueprint()
    quantized = fit(factory.compile(bp, seed=0, precision="emulate"), batches, 3)
    baseline = fit(factory.compile(bp, seed=0, precision="off"), batches, 3)
    assert not quantized.diverged and all(r.finite for r in quantized.records)
    assert quantized.lm_losses != baseline.lm_losses  # the policy is really applied
    for q, b in zip(quantized.lm_losses, baseline.lm_losses, strict=True):
        assert abs(q - b) < 0.02 * b


def test_compiled_blocks_train_as_the_eager_model(batches: ShardLoader) -> None:
    on = tiny_blueprint(training={"compile": True, "steps": 3})
    compiled = factory.compile(on, seed=0, precision="off")
    result = fit(compiled, batches, 3)
    eager = fit(factory.compile(tiny_blueprint(), seed=0, precision="off"), batches, 3)
    blocks = compiled.model.backbone.layers
    static = [layer_type(b.symbol).compiles(b) for b in blocks]
    assert [b._compiled_call_impl is not None for b in blocks] == static
    assert not result.diverged and len(result.lm_losses) == 3
    for c, e in zip(result.lm_losses, eager.lm_losses, strict=True):
        assert abs(c - e) <= 1e-4 * e


def test_a_non_finite_loss_stops_the_run(batches: ShardLoader) -> None:
    compiled = factory.compile(tiny_blueprint(), seed=0, precision="off")
    with torch.no_grad():
        compiled.model.lm_head.weight[0, 0] = float("nan")
    result = fit(compiled, batches, STEPS)
    # No run folder, so no checkpoint to roll back to: the run stops before any update.
    assert result.diverged and result.records == []
    assert [e.monitor for e in result.events] == ["non_finite"]
