"""Torch building blocks every layer type may use: norms, packed-document masks, and the
typed outputs of a forward pass. Below ``factory.layers`` and ``factory.graph``."""
