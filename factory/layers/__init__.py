"""The built-in layer types, one module each; importing this package registers them.

``M`` :mod:`~factory.layers.mamba`, ``*`` :mod:`~factory.layers.attention`,
``-`` :mod:`~factory.layers.mlp`, ``E`` :mod:`~factory.layers.moe`, and the
MTP block in :mod:`~factory.layers.mtp`. Each declares its tensors, FLOPs,
activation memory, initialisation, Hugging Face mapping and proxy shrink on a
:class:`~factory.spec.layer_type.LayerType`.
"""

from __future__ import annotations

# Registration order is the order plans list layer types in: M * - E.
# (pyproject.toml exempts this file from import sorting for that reason).
from factory.layers import mamba
from factory.layers import attention
from factory.layers import mlp
from factory.layers import moe
from factory.layers import mtp

__all__ = ["attention", "mamba", "mlp", "moe", "mtp"]
