"""Which kernel computes an operation on a device, and why a slower one was taken.

Every operation with more than one implementation (the Mamba scan, conv and gated
norm, attention, the MoE dispatch, the LM-head loss, the quantized GEMMs) has a
``*_kernel(device) -> KernelChoice`` function next to its dispatch, which answers
from the same test the dispatch itself makes, so the report cannot disagree with
what runs. A run prints the choices of its model in its first lines
(``factory.graph.kernel_report``); a fallback always says why, never silently.

This module imports nothing heavy: the choices are plain records.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KernelChoice"]


@dataclass(frozen=True)
class KernelChoice:
    """One operation's implementation on one device."""

    op: str
    """What is computed, short and stable: ``"ssd scan"``, ``"causal conv"``, ``"attention"``."""
    kernel: str
    """The implementation that runs: ``"mamba_ssm Triton (mamba_chunk_scan_combined)"``,
    ``"PyTorch chunked"``."""
    fallback: str | None = None
    """Why the fastest implementation for this device was not taken (a package missing, a
    device without the instruction, a shape the kernel refuses); None when it was, and on
    CPU, where the PyTorch path is the reference by design."""

    def describe(self) -> str:
        """One line: ``op: kernel`` and, for a fallback, its reason."""
        line = f"{self.op}: {self.kernel}"
        return line if self.fallback is None else f"{line} (fallback: {self.fallback})"
