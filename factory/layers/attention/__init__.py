"""``*`` causal grouped-query self-attention: one folder owns the layer type.

``spec.py`` is its registered :class:`~factory.spec.layer_type.LayerType` (tensors, FLOPs,
activation memory, tensor-parallel rules, proxy shrink, Hugging Face mapping), torch-free;
``module.py`` is its ``nn.Module`` (imported when a graph is built); its config section
is typed in ``factory.schemas.model``.
"""

from __future__ import annotations

from factory.layers.attention.spec import SelfAttention

__all__ = ["SelfAttention"]
