"""A tiny blueprint the runtime tests train, and its shards (shared by the runtime test files)."""

from __future__ import annotations

from typing import Any

import factory
from factory.proxy import derive_proxy
from factory.schemas.blueprint import Blueprint

SEQ, MICRO, GLOBAL, STEPS = 64, 2, 4, 8


def tiny_blueprint(**sections: dict[str, Any]) -> Blueprint:
    """The Super proxy at width 64, five layers (every type but MLP), 4 x 64-token steps.

    Keeps Super's NVFP4 policy (all but the last layer), MTP and LatentMoE.
    ``sections`` update top-level sections key by key.
    """
    data = derive_proxy(factory.load_blueprint("super"), width=64).model_dump(exclude_unset=True)
    data["model"]["pattern"] = "MEM*E"
    data["precision"]["high_precision"] = {"first": 0, "last": 1, "layers": []}
    data["data"].update(seq_len=SEQ, tokens=STEPS * GLOBAL * SEQ)
    data["parallelism"].update(micro_batch_size=MICRO, global_batch_size=GLOBAL)
    data["training"].update(steps=STEPS, optimizer={"lr": 1e-2, "min_lr": 1e-3})
    for name, values in sections.items():
        data[name].update(values)
    return Blueprint.model_validate(data)
