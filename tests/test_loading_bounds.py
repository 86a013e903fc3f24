"""Every size a blueprint gives is bounded: absurd values are schema errors, not planner crashes."""

from __future__ import annotations

import pytest
from blueprint_factory import make
from pydantic import ValidationError

from factory.schemas import base

BOUNDS = [
    ("model.hidden_size", base.MAX_HIDDEN_SIZE),
    ("model.vocab_size", base.MAX_VOCAB_SIZE),
    ("model.max_seq_len", base.MAX_SEQ_LEN),
    ("model.attention.heads", base.MAX_HEADS),
    ("model.mamba.state_size", base.MAX_HEAD_DIM),
    ("model.mlp.intermediate_size", base.MAX_INTERMEDIATE_SIZE),
    ("model.moe.num_experts", base.MAX_EXPERTS),
    ("model.moe.shared_expert_intermediate_size", base.MAX_INTERMEDIATE_SIZE),
    ("parallelism.world_size", base.MAX_WORLD_SIZE),
    ("parallelism.ep", base.MAX_WORLD_SIZE),
    ("parallelism.global_batch_size", base.MAX_BATCH_SIZE),
    ("data.seq_len", base.MAX_SEQ_LEN),
    ("data.tokens", base.MAX_TOKENS),
    ("training.steps", base.MAX_STEPS),
    ("training.seed", base.MAX_SEED),
    ("precision.high_precision.last", base.MAX_LAYERS),
    ("precision.fp8.margin", base.MAX_MARGIN),
]


@pytest.mark.parametrize(("path", "bound"), BOUNDS)
def test_the_bound_is_allowed_and_one_more_is_not(path: str, bound: int) -> None:
    make(**{path: bound})
    with pytest.raises(ValidationError, match=f"less than or equal to {bound}"):
        make(**{path: bound + 1})


def test_the_pattern_is_bounded_in_layers() -> None:
    make(**{"model.pattern": "M" * base.MAX_LAYERS, "model.mamba.heads": 16})
    with pytest.raises(ValidationError, match=f"at most {base.MAX_LAYERS}"):
        make(**{"model.pattern": "M" * (base.MAX_LAYERS + 1)})
    with pytest.raises(ValidationError, match="at most 65536 characters"):
        make(**{"model.pattern": "|" * (base.MAX_PATTERN_LENGTH + 1)})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "inf"])
def test_floats_must_be_finite(value: object) -> None:
    with pytest.raises(ValidationError, match="finite number"):
        make(**{"training.optimizer.lr": value})


@pytest.mark.parametrize(
    ("text", "count"),
    [("8.2T", 8_200_000_000_000), ("1_000_000", 10**6), ("1.5b", 1_500_000_000), ("7", 7)],
)
def test_counts_are_parsed_exactly(text: str, count: int) -> None:
    assert make(**{"data.tokens": text}).data.tokens == count


@pytest.mark.parametrize("text", ["1.0000001K", "9" * 80 + "T", "0.5", "1" * 5000])
def test_bad_counts_are_validation_errors(text: str) -> None:
    with pytest.raises(ValidationError):
        make(**{"data.tokens": text})
