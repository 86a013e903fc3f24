"""Who carries out a precision policy, and whether that backend is installed (torch-free).

``factory.compile(..., precision=BACKEND)`` applies the policy with one of
:data:`PrecisionBackend`: the PyTorch emulation (``factory.precision.apply``),
Transformer Engine (``factory.precision.te_backend``), whichever fits
(``auto``), or none. Whether TE is installed is answered here without importing
it or torch, so a training request is refused before any work.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Literal

__all__ = ["PrecisionBackend", "available", "require_te"]

PrecisionBackend = Literal["auto", "emulate", "te", "off"]
"""Who carries out the precision policy (``factory.compile``): ``emulate`` quantizes in PyTorch,
``te`` maps onto Transformer Engine, ``auto`` takes TE where it is usable, ``off`` quantizes
nothing."""


def available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported (without importing it)."""
    if "transformer_engine.pytorch" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def require_te() -> None:
    """Raise a clear ImportError when TE is missing."""
    if not available():
        raise ImportError(
            "precision='te' needs NVIDIA Transformer Engine, which is not installed: "
            "pip install 'factory[gpu]' on a CUDA machine, or use precision='emulate'"
        )
