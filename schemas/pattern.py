"""Megatron's hybrid layer pattern: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE.

``|`` marks pipeline-stage boundaries inside the main pattern, and ``/``
separates the main pattern from one segment per MTP depth, exactly as in
Megatron-Core's ``hybrid_layer_allocation.py``: ``"M*M*/MM/MM"`` is a main
stack ``M*M*`` with two MTP depths whose inner pattern is ``MM``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import factory.layers  # noqa: F401  (registers the built-in layer types)
from factory.spec.layer_type import LAYER_TYPES

__all__ = ["HybridPattern", "PatternError", "layer_symbols"]


def layer_symbols() -> dict[str, str]:
    """Registered layer symbols mapped to their layer-type names (``factory.layers``)."""
    return {symbol: kind.name for symbol, kind in LAYER_TYPES.items()}


PIPE = "|"
MTP_SEPARATOR = "/"
# Symbols Megatron knows but factory does not build, so the error can say why.
_MEGATRON_ONLY = {
    "G": "Gated DeltaNet",
    "D": "DeepSeek sparse attention",
    "+": "multi-latent attention",
}


class PatternError(ValueError):
    """A malformed pattern; ``position`` is the 0-based offset of the offending character."""

    def __init__(self, message: str, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


@dataclass(frozen=True)
class HybridPattern:
    """A parsed hybrid pattern.

    ``segments`` are the ``|``-separated pipeline segments of the main stack
    (a single segment when there is no ``|``); ``mtp`` holds one inner pattern
    per MTP depth.
    """

    text: str
    segments: tuple[str, ...]
    mtp: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> HybridPattern:
        if not text or not text.strip():
            raise PatternError("the pattern is empty")
        known = layer_symbols()
        for position, char in enumerate(text):
            if char in known or char in (PIPE, MTP_SEPARATOR):
                continue
            if char in _MEGATRON_ONLY:
                raise PatternError(
                    f"symbol {char!r} at position {position} ({_MEGATRON_ONLY[char]}) is "
                    "Megatron's but not built by factory; use " + " ".join(known) + " | /",
                    position,
                )
            legend = ", ".join(f"{symbol} ({name})" for symbol, name in known.items())
            raise PatternError(
                f"unknown symbol {char!r} at position {position}; "
                f"known symbols: {legend}, | (pipeline), / (MTP)",
                position,
            )
        main, *mtp = text.split(MTP_SEPARATOR)
        for depth, inner in enumerate(mtp, start=1):
            if PIPE in inner:
                raise PatternError(
                    f"MTP segment {depth} ({inner!r}) contains '|'; "
                    "pipes belong to the main pattern"
                )
            if not inner:
                raise PatternError(f"MTP segment {depth} is empty")
        segments = tuple(main.split(PIPE))
        if not main.replace(PIPE, ""):
            raise PatternError("the main pattern has no layers")
        return cls(text=text, segments=segments, mtp=tuple(mtp))

    @property
    def main(self) -> str:
        """The main stack without pipeline boundaries: one character per layer."""
        return "".join(self.segments)

    @property
    def num_layers(self) -> int:
        return len(self.main)

    @property
    def has_pipes(self) -> bool:
        return len(self.segments) > 1

    @property
    def mtp_depth(self) -> int:
        return len(self.mtp)

    def layer_types(self) -> list[str]:
        """Layer-type names of the main stack, in order."""
        names = layer_symbols()
        return [names[c] for c in self.main]

    def counts(self) -> dict[str, int]:
        """Number of main-stack layers of each type (types absent from the pattern are 0)."""
        found = Counter(self.main)
        return {name: found.get(symbol, 0) for symbol, name in layer_symbols().items()}

    def symbols(self) -> set[str]:
        """Every layer symbol used anywhere, MTP segments included."""
        return set(self.main) | set("".join(self.mtp))
