"""Megatron's hybrid layer pattern: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE.

``|`` marks pipeline-stage boundaries inside the main pattern, and ``/``
separates the main pattern from one segment per MTP depth, exactly as in
Megatron-Core's ``hybrid_layer_allocation.py``: ``"M*M*/MM/MM"`` is a main
stack ``M*M*`` with two MTP depths whose inner pattern is ``MM``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEGATRON_SYMBOLS", "MTP_SEPARATOR", "PIPE", "HybridPattern", "PatternError"]

PIPE = "|"
MTP_SEPARATOR = "/"
MEGATRON_SYMBOLS = {
    "M": "Mamba-2",
    "*": "attention",
    "-": "MLP",
    "E": "mixture of experts",
    "G": "Gated DeltaNet",
    "D": "DeepSeek sparse attention",
    "+": "multi-latent attention",
}
"""Megatron-Core's layer symbols and what each is. Which of them factory builds is the layer
registry's to say (``factory.layers``); the ``model.pattern_symbols`` rule checks it."""


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
        for position, char in enumerate(text):
            if char.isspace() or not char.isprintable():
                raise PatternError(
                    f"unknown symbol {char!r} at position {position}; a layer is one "
                    "printable character",
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

    def symbols(self) -> set[str]:
        """Every layer symbol used anywhere, MTP segments included."""
        return set(self.main) | set("".join(self.mtp))
