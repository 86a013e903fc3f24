"""Hugging Face checkpoints: write and read ``config.json`` + ``model.safetensors``.

Tensor names are the released Nemotron 3 checkpoints' (``docs/architecture.md``):
``backbone.*``, ``lm_head.weight``, ``mtp.layers.*``, and one tensor per
routed expert (``mixer.experts.{e}.up_proj.weight``), which transformers merges
into its 3D expert weights on load. Our graph already uses these names, so the
mapping is the identity except for splitting and merging the experts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from factory import compilation
from factory.exports.hf_config import hf_config
from factory.graph.weights import load_weights
from factory.io import staged_directory
from factory.layers.model_spec import model_spec
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig

__all__ = ["export_hf", "to_checkpoint_state_dict", "write_hf_checkpoint", "write_hf_folder"]


Weights = nn.Module | Mapping[str, torch.Tensor]
"""A model, or its state dict under the model's own names (a run's gathered weights)."""


def _state(weights: Weights) -> Mapping[str, torch.Tensor]:
    return weights.state_dict() if isinstance(weights, nn.Module) else weights


def to_checkpoint_state_dict(weights: Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``weights`` under the checkpoint's names, read from the model spec: a tensor with an
    expert dimension becomes one matrix per expert (``experts.{e}.up_proj.weight``), a tied
    head is dropped, and tensors NemotronH always has but this model lacks are zeros."""
    spec = model_spec(cfg)
    state = _state(weights)
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
        for name, shape in layer.type.hf_zero_tensors(cfg, f"{layer.prefix}.mixer"):
            out[name] = torch.zeros(shape, dtype=torch.float32)  # the router's dtype
    return out


def write_hf_checkpoint(weights: Weights, bp: Blueprint, out: Path) -> Path:
    """Write ``out/config.json`` and ``out/model.safetensors`` (atomically: all or nothing)
    from ``bp``'s model or its weights."""
    state = _state(weights)
    # The model's dtype: its first tensor that the spec does not keep in fp32 (the router).
    kept = {t.name for t in model_spec(bp.model).tensors() if t.fp32}
    first = next(v for name, v in state.items() if name not in kept and v.is_floating_point())
    config = hf_config(bp, dtype=str(first.dtype).removeprefix("torch."))
    return write_hf_folder(state, bp.model, config, out)


def write_hf_folder(
    weights: Weights, cfg: ModelConfig, config: Mapping[str, object], out: Path
) -> Path:
    """Write ``out/config.json`` (``config``, the NemotronH config of ``cfg``) and
    ``out/model.safetensors`` (``weights`` under the checkpoint's names), atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu() for k, v in to_checkpoint_state_dict(weights, cfg).items()}
    with staged_directory(out) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    return out


def export_hf(
    blueprint: Blueprint, out: Path, *, seed: int = 0, weights: Path | None = None
) -> Path:
    """``factory export hf``: ``blueprint``'s model, initialised from ``seed`` or read from
    the checkpoint ``weights`` (``.safetensors``, ``.pt`` or a Hugging Face folder), as a
    Hugging Face checkpoint in ``out``. What NemotronH cannot express is refused
    (:class:`~factory.exports.hf_config.ExportError`) before anything is built."""
    hf_config(blueprint)
    compiled = compilation.compile(blueprint, seed=seed, precision="off")  # weights only
    if weights is not None:
        load_weights(compiled.model, weights)
    return write_hf_checkpoint(compiled.model, compiled.blueprint, out)
