"""The base class every blueprint section derives from, and shared field types.

Every size a blueprint gives has an upper bound here. The bounds are far above
any model anyone trains (several times the largest published value) but small
enough that the planner's arithmetic stays exact and finite: without them a
width of 10**400 validates and then overflows a float in the memory planner.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_EXPERTS",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN_SIZE",
    "MAX_INTERMEDIATE_SIZE",
    "MAX_LAYERS",
    "MAX_MARGIN",
    "MAX_PATTERN_LENGTH",
    "MAX_SEED",
    "MAX_SEQ_LEN",
    "MAX_STEPS",
    "MAX_TOKENS",
    "MAX_VOCAB_SIZE",
    "MAX_WORLD_SIZE",
    "BatchSize",
    "Count",
    "ExpertCount",
    "HeadCount",
    "HeadDim",
    "HiddenSize",
    "IntermediateSize",
    "LayerCount",
    "LayerIndex",
    "PositiveInt",
    "RankCount",
    "Section",
    "Seed",
    "SeqLen",
    "StepCount",
    "TokenCount",
    "VocabSize",
]


class Section(BaseModel):
    """A blueprint section: unknown keys are errors, and values never change after validation.

    Attribute docstrings become JSON Schema descriptions, so editors show them
    as hover text when a blueprint is checked against ``schemas/*.schema.json``.
    Infinity and NaN are refused: YAML spells them ``.inf``/``.nan``, and no
    setting means either (they also turn the planner's sums into nonsense).
    """

    alternatives: ClassVar[tuple[tuple[str, ...], ...]] = ()
    """Groups of fields of which a document gives at most one (``steps`` or ``tokens``): a
    program stage that writes one of a group drops the others it would inherit."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=False,  # factory.json_schema reads them when writing schemas
        validate_default=True,
        allow_inf_nan=False,
    )


# Upper bounds of the sizes a blueprint may give; the published maximum is in brackets.
MAX_HIDDEN_SIZE = 2**17
"""Model width d: 131072 (largest published: ~25k)."""
MAX_INTERMEDIATE_SIZE = 2**20
"""MLP, expert, shared-expert and latent widths: 1048576 (published: ~100k)."""
MAX_HEADS = 2**14
"""Attention heads, KV heads, Mamba heads and groups: 16384 (published: 256)."""
MAX_HEAD_DIM = 2**14
"""Per-head widths, SSM state size, conv kernel and other small per-layer sizes: 16384."""
MAX_VOCAB_SIZE = 2**22
"""Vocabulary: 4194304 (published: ~260k)."""
MAX_SEQ_LEN = 2**24
"""Sequence lengths and context: 16777216 tokens (published: 1M-10M)."""
MAX_LAYERS = 2**14
"""Layers of the main stack, MTP depth, layer indices: 16384 (published: ~130)."""
MAX_PATTERN_LENGTH = 2**16
"""Characters of a hybrid pattern: layers plus '|' and '/' separators."""
MAX_EXPERTS = 2**14
"""Routed experts, top-k and expert groups: 16384 (published: 512)."""
MAX_WORLD_SIZE = 2**20
"""GPUs and every parallel size: 1048576 (largest clusters: ~10^5)."""
MAX_BATCH_SIZE = 2**24
"""Sequences per micro-batch or optimizer step: 16777216 (published: ~10^4)."""
MAX_STEPS = 2**40
"""Optimizer steps and checkpoint intervals: ~1.1e12 (published: ~10^6)."""
MAX_TOKENS = 10**16
"""Token budgets: 10 quadrillion (published: ~36T)."""
MAX_MARGIN = 128
"""FP8 scale headroom in powers of two; E4M3 and E5M2 span at most 30 binades."""
MAX_SEED = 2**63 - 1
"""Seeds are non-negative 64-bit integers (what numpy and torch accept)."""


PositiveInt = Annotated[int, Field(ge=1)]
"""Unbounded; blueprint fields use one of the bounded kinds below."""
HiddenSize = Annotated[int, Field(ge=1, le=MAX_HIDDEN_SIZE)]
IntermediateSize = Annotated[int, Field(ge=1, le=MAX_INTERMEDIATE_SIZE)]
HeadCount = Annotated[int, Field(ge=1, le=MAX_HEADS)]
HeadDim = Annotated[int, Field(ge=1, le=MAX_HEAD_DIM)]
VocabSize = Annotated[int, Field(ge=1, le=MAX_VOCAB_SIZE)]
SeqLen = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN)]
LayerCount = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYERS - 1)]
ExpertCount = Annotated[int, Field(ge=1, le=MAX_EXPERTS)]
RankCount = Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
StepCount = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)
_COUNT_PATTERN = r"^\s*[0-9][0-9_]*(\.[0-9]+)?\s*[KMBGTkmbgt]?\s*$"


def _parse_count(value: object) -> object:
    """Accept ``25T``, ``8.2T``, ``1_000_000`` or a plain integer for large counts.

    Token budgets run to 10^13; writing them out invites a missing zero.
    Anything that is not a recognisable count is passed through for pydantic
    to reject with its usual message. The arithmetic is exact (Fraction, not
    float): a float overflows on a long string of digits and rounds '8.2T'.
    """
    if isinstance(value, str):
        match = _COUNT_RE.match(value)
        if match is None:
            return value
        number, suffix = match.groups()
        if len(number) > 64:  # beyond any bound: let pydantic refuse the string
            return value
        scaled = Fraction(number.replace("_", "")) * _SUFFIXES.get(suffix.upper(), 1)
        if scaled.denominator != 1:
            raise ValueError(f"{value!r} is not a whole number")
        return int(scaled)
    return value


def _count_schema(maximum: int | None) -> WithJsonSchema:
    integer: dict[str, object] = {"type": "integer", "minimum": 1}
    if maximum is not None:
        integer["maximum"] = maximum
    return WithJsonSchema(
        {
            "anyOf": [integer, {"type": "string", "pattern": _COUNT_PATTERN}],
            "examples": [8192, "25T", "1.5B"],
        }
    )


Count = Annotated[int, BeforeValidator(_parse_count), Field(ge=1), _count_schema(None)]
"""A positive integer that may be written with a K/M/B/T suffix."""
TokenCount = Annotated[
    int, BeforeValidator(_parse_count), Field(ge=1, le=MAX_TOKENS), _count_schema(MAX_TOKENS)
]
"""A token budget: a Count of at most MAX_TOKENS."""
