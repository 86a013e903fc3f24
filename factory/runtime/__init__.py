"""A minimal single-process training runtime for CPU proxies.

``batches`` turns built data shards into micro-batches, ``schedule`` is the
learning rate of a blueprint's ``training.schedule`` at a step, and ``loop``
trains a compiled model with AdamW, clipping, accumulation and the precision
runtime's late switch. Why it exists: claims about a blueprint's numerics
(NVFP4 vs BF16, Hadamard, stochastic rounding) need real training runs with
the blueprint's optimizer and data, not single steps.

Nothing here is imported by ``import factory``: ``batches`` and ``loop`` need
torch, and the torch-free commands must stay torch-free.
"""
