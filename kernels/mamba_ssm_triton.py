"""mamba_ssm's Triton kernels without its CUDA extension: the one place they are imported from.

PyPI publishes mamba-ssm as a source archive whose ``mamba_ssm/__init__.py`` imports the
compiled selective-scan extension unguarded. Built without it (``MAMBA_SKIP_CUDA_BUILD=TRUE
MAMBA_FORCE_BUILD=TRUE pip wheel --no-deps --no-build-isolation mamba-ssm``: README, "GPU
kernels"), ``import mamba_ssm`` fails, yet the Triton modules this project uses (the SSD scan
``ops.triton.ssd_combined``, the gated RMSNorm ``ops.triton.layernorm_gated``) need only torch,
Triton, einops, packaging and each other. So :func:`triton_module` puts a bare package object
for ``mamba_ssm`` (its ``__path__``, its ``__init__`` not run) into ``sys.modules``, imports the
module under it, and takes the bare package out again. Leaving it there would change what
``import mamba_ssm`` means to everyone else: transformers' NemotronH picks mamba_ssm's
kernels, on any device, whenever that import succeeds when its modeling module loads.

Imported lazily, on the first CUDA tensor a dispatch sees (or by a test on CPU under Triton's
interpreter); a module that does not import is remembered with the reason, which the kernel
report prints as the fallback's cause.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from types import ModuleType

import torch

__all__ = ["DEVICE_TYPES", "serves", "triton_module", "unavailable"]

PACKAGE = "mamba_ssm"

DEVICE_TYPES = {"cuda"}
"""Device types whose tensors the field's Triton kernels (mamba_ssm's and
``factory.kernels.causal_conv``'s) serve. Tests add ``"cpu"`` under ``TRITON_INTERPRET=1``."""


def serves(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels (when they import)."""
    return torch.device(device).type in DEVICE_TYPES


@functools.cache
def _load(name: str) -> ModuleType | str:
    """``mamba_ssm.<name>``, or why it does not import."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        return "mamba_ssm is not installed (README, 'GPU kernels': the build without CUDA)"
    registered = PACKAGE in sys.modules
    if not registered:  # the package object without running __init__ (module docstring)
        sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)
    try:
        return importlib.import_module(f"{PACKAGE}.{name}")
    except Exception as error:  # ImportError, or Triton failing to initialise
        return f"{PACKAGE}.{name} does not import ({type(error).__name__}: {error})"
    finally:
        if not registered:
            del sys.modules[PACKAGE]


def triton_module(name: str) -> ModuleType | None:
    """``mamba_ssm.<name>`` (``"ops.triton.ssd_combined"``), None when it does not import."""
    loaded = _load(name)
    return loaded if isinstance(loaded, ModuleType) else None


def unavailable(name: str) -> str | None:
    """Why ``mamba_ssm.<name>`` does not import; None when it does."""
    loaded = _load(name)
    return loaded if isinstance(loaded, str) else None
