"""Rules on the ``model`` section that span more than one sub-section.

Single-field constraints (positive sizes, a parseable pattern) are pydantic
validators in ``factory.schemas.model``; what lives here needs two or more
values at once: the pattern against the layer types and sections it needs, and
the MTP blocks against the main stack. A layer type's own rules (heads against
groups, the router against the expert count, ...) are written in its
``spec.py`` with ``layer_check`` and run here, each under its own name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from factory.checks.registry import Finding, layer_checks, rule
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.pattern import (
    MEGATRON_SYMBOLS,
    MTP_SEPARATOR,
    PIPE,
    HybridPattern,
    PatternError,
)
from factory.spec.layer_type import LAYER_TYPES, LayerFinding, LayerType

__all__ = ["unbuilt_symbol", "used_symbols"]


def used_symbols(model: ModelConfig) -> set[str]:
    """Layer symbols the model builds: the main stack plus the MTP inner pattern.

    Characters of a malformed ``model.mtp.pattern`` are ignored here; the
    ``model.mtp_pattern`` rule reports them.
    """
    return (set(model.parsed_pattern.main) | set(model.mtp_pattern)) & set(LAYER_TYPES)


def _count(model: ModelConfig, symbol: str) -> int:
    """Layers of one type, MTP inner layers counted once per depth."""
    return model.parsed_pattern.main.count(symbol) + model.mtp_depth * model.mtp_pattern.count(
        symbol
    )


def unbuilt_symbol(text: str) -> str | None:
    """Why ``text``, a parsed pattern, names a layer that has no registered layer type (None
    when every symbol has one)."""
    for position, char in enumerate(text):
        if char in LAYER_TYPES or char in (PIPE, MTP_SEPARATOR):
            continue
        known = " ".join(LAYER_TYPES)
        if char in MEGATRON_SYMBOLS:
            return (
                f"symbol {char!r} at position {position} ({MEGATRON_SYMBOLS[char]}) is "
                f"Megatron's but not built by factory; use {known} | /"
            )
        legend = ", ".join(f"{symbol} ({kind.name})" for symbol, kind in LAYER_TYPES.items())
        return (
            f"unknown symbol {char!r} at position {position}; "
            f"known symbols: {legend}, | (pipeline), / (MTP)"
        )
    return None


@rule("model.pattern_symbols")
def pattern_symbols(bp: Blueprint) -> Iterator[Finding]:
    """Every symbol of the pattern is a registered layer type."""
    if (problem := unbuilt_symbol(bp.model.pattern)) is not None:
        yield Finding("model.pattern", problem)


@rule("model.layer_sections")
def layer_sections(bp: Blueprint) -> Iterator[Finding]:
    """Every layer type in the pattern (main or MTP) has its config section."""
    model = bp.model
    for symbol in sorted(used_symbols(model)):
        kind = LAYER_TYPES[symbol]
        section = kind.section
        if section is not None and getattr(model, section) is None:
            yield Finding(
                f"model.{section}",
                f"the pattern has {_count(model, symbol)} {symbol!r} ({kind.name}) "
                f"layers but model.{section} is not set",
            )


@rule("model.unused_sections")
def unused_sections(bp: Blueprint) -> Iterator[Finding]:
    """A layer section that no layer uses is probably a pattern typo."""
    used = used_symbols(bp.model)
    for symbol, kind in LAYER_TYPES.items():
        section = kind.section
        if section is not None and getattr(bp.model, section) is not None and symbol not in used:
            yield Finding(
                f"model.{section}",
                f"model.{section} is set but the pattern has no {symbol!r} layers; it is ignored",
                "warning",
            )


@rule("model.mtp_segments")
def mtp_segments(bp: Blueprint) -> Iterator[Finding]:
    """All '/' MTP segments of the pattern are identical (Megatron requires it)."""
    mtp = bp.model.parsed_pattern.mtp
    different = sorted(set(mtp) - {mtp[0]}) if mtp else []
    if different:
        yield Finding(
            "model.pattern",
            f"all {len(mtp)} MTP segments must be identical: segment 1 is {mtp[0]!r} but "
            f"{', '.join(repr(s) for s in different)} also appear",
        )


@rule("model.mtp_consistent")
def mtp_consistent(bp: Blueprint) -> Iterator[Finding]:
    """A model.mtp section agrees with the '/' segments of the pattern.

    Only values written explicitly are compared: the section's depth and
    pattern have defaults, and a blueprint that writes just
    ``mtp: {repeated: true}`` next to a '/' pattern is consistent.
    """
    parsed, mtp = bp.model.parsed_pattern, bp.model.mtp
    if mtp is None or not parsed.mtp:
        return
    written = mtp.model_fields_set
    if "depth" in written and mtp.depth != parsed.mtp_depth:
        yield Finding(
            "model.mtp.depth",
            f"model.mtp.depth={mtp.depth} but the pattern has {parsed.mtp_depth} '/' MTP segments",
        )
    if "pattern" in written and mtp.pattern != parsed.mtp[0]:
        yield Finding(
            "model.mtp.pattern",
            f"model.mtp.pattern={mtp.pattern!r} but the pattern's MTP segments are "
            f"{parsed.mtp[0]!r}",
        )


@rule("model.mtp_pattern")
def mtp_pattern(bp: Blueprint) -> Iterator[Finding]:
    """model.mtp.pattern is one inner block: known symbols, no '|' or '/'."""
    mtp = bp.model.mtp
    if mtp is None:
        return
    for char in (PIPE, MTP_SEPARATOR):
        if char in mtp.pattern:
            yield Finding(
                "model.mtp.pattern",
                f"model.mtp.pattern={mtp.pattern!r} contains {char!r}; it is one MTP block's "
                "inner pattern (pipes and MTP separators belong to model.pattern)",
            )
            return
    try:
        HybridPattern.parse(mtp.pattern)
    except PatternError as err:
        yield Finding("model.mtp.pattern", f"model.mtp.pattern={mtp.pattern!r}: {err}")
        return
    if (problem := unbuilt_symbol(mtp.pattern)) is not None:
        yield Finding("model.mtp.pattern", f"model.mtp.pattern={mtp.pattern!r}: {problem}")


@rule("model.rope_unused")
def rope_unused(bp: Blueprint) -> Iterator[Finding]:
    """RoPE settings do nothing without position_embedding: rope."""
    model = bp.model
    if model.position_embedding != "none":
        return
    for field in ("rope_base", "rope_fraction"):
        if field in model.model_fields_set:
            yield Finding(
                f"model.{field}",
                f"{field}={getattr(model, field)} is ignored because position_embedding is 'none'",
                "warning",
            )


@layer_checks
def declared_by_layer_type(
    kind: LayerType, bp: Blueprint, check: Callable[[Blueprint], Iterator[LayerFinding]]
) -> Iterator[Finding]:
    """A check a layer type declares with ``layer_check`` (in its ``spec.py``)."""
    for found in check(bp):
        yield Finding(*found)
