"""The built-in layer types, one folder each; importing this package registers them.

``M`` :mod:`~factory.layers.mamba`, ``*`` :mod:`~factory.layers.attention`,
``-`` :mod:`~factory.layers.mlp`, ``E`` :mod:`~factory.layers.moe`. A folder holds its
layer type's description (``spec.py``: tensors, FLOPs, activation memory,
tensor-parallel rules, proxy shrink, Hugging Face mapping) and its module
(``module.py``). :mod:`~factory.layers.mtp` is the MTP block's part of the spec, and
:mod:`~factory.layers.model_spec` assembles every layer's tensors into the model spec.
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
