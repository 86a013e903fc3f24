"""Hugging Face checkpoints: write and read ``config.json`` + ``model.safetensors``.

Tensor names are the released Nemotron 3 checkpoints' (``docs/architecture.md``):
``backbone.*``, ``lm_head.weight``, ``mtp.layers.*``, and one tensor per
routed expert (``mixer.experts.{e}.up_proj.weight``), which transformers merges
into its 3D expert weights on load. Our graph already uses these names, so the
mapping is the identity except for splitting and merging the experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from factory.exports.hf_config import hf_config
from factory.graph.model import HybridLM
from factory.io import staged_directory
from factory.layers.model_spec import model_spec
from factory.schemas.blueprint import Blueprint

__all__ = ["export_hf", "to_checkpoint_state_dict"]


def to_checkpoint_state_dict(model: HybridLM) -> dict[str, torch.Tensor]:
    """Our state dict under the checkpoint's names, read from the model spec: a tensor with an
    expert dimension becomes one matrix per expert (``experts.{e}.up_proj.weight``), a tied
    head is dropped, and tensors NemotronH always has but this model lacks are zeros."""
    spec = model_spec(model.cfg)
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for tensor in spec.tensors():
        value = state[tensor.name]
        if tensor.tied_to is not None:
            continue
        if tensor.expert_dim is not None:
            owner, _, projection = tensor.name.rpartition(".")
            for e, matrix in enumerate(value.unbind(tensor.expert_dim)):
                out[f"{owner}.{e}.{projection}.weight"] = matrix.contiguous()
        else:
            out[tensor.name] = value.contiguous()
    for layer in spec.layers:
        for name, shape in layer.type.hf_zero_tensors(model.cfg, f"{layer.prefix}.mixer"):
            out[name] = torch.zeros(shape, dtype=torch.float32)  # the router's dtype
    return out


def export_hf(model: HybridLM, bp: Blueprint, out: Path) -> Path:
    """Write ``out/config.json`` and ``out/model.safetensors`` (atomically: all or nothing)."""
    from safetensors.torch import save_file

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = hf_config(bp, dtype=dtype)
    tensors = {k: v.detach().cpu() for k, v in to_checkpoint_state_dict(model).items()}
    with staged_directory(out) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    return out
