"""The curation steps' optional compiled kernels: loaded on first use, None without numba.

``ngram_jit`` (the n-gram repetition rules) and ``minhash_jit`` (MinHash signatures)
import numba; numba is in the ``data`` extra, and every caller keeps its numpy path
for an environment without it. Compiled code is cached next to the modules, so a
process pays about a second to load it, once.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

__all__ = ["KERNELS", "compiled_kernels"]

KERNELS = ("ngram_jit", "minhash_jit")


@functools.cache
def compiled_kernels(name: str) -> ModuleType | None:
    """``factory.data.steps.<name>`` (one of :data:`KERNELS`), or None where numba won't import."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel module {name!r}; known: {KERNELS}")
    try:
        return importlib.import_module(f"factory.data.steps.{name}")
    except ImportError:
        return None
