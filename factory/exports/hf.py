"""Hugging Face checkpoints: write and read ``config.json`` + ``model.safetensors``.

Tensor names are the released Nemotron 3 checkpoints' (architecture.md §6.3):
``backbone.*``, ``lm_head.weight``, ``mtp.layers.*``, and one tensor per
routed expert (``mixer.experts.{e}.up_proj.weight``), which transformers merges
into its 3D expert weights on load. Our graph already uses these names, so the
mapping is the identity except for splitting and merging the experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from factory.exports.hf_config import hf_config
from factory.graph.model import HybridLM
from factory.io import staged_directory
from factory.schemas.blueprint import Blueprint

__all__ = ["export_hf", "load_hf_state_dict", "to_checkpoint_state_dict"]

_EXPERTS = re.compile(r"^(.*\.mixer\.experts)\.(up_proj|down_proj|gate_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj|gate_proj)\.weight$")


def to_checkpoint_state_dict(model: HybridLM) -> dict[str, torch.Tensor]:
    """Our state dict with 3D expert weights split into per-expert matrices; tied head dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = _EXPERTS.match(name)
        if match:
            prefix, proj = match.groups()
            for e, matrix in enumerate(tensor.unbind(0)):
                out[f"{prefix}.{e}.{proj}.weight"] = matrix.contiguous()
        elif name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        else:
            out[name] = tensor.contiguous()
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


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file, or every one in a folder, into our names (experts merged to 3D)."""
    from safetensors.torch import load_file

    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.replace("backbone.embedding.weight", "backbone.embeddings.weight")
            match = _PER_EXPERT.match(name)
            if match:
                prefix, index, proj = match.groups()
                experts.setdefault((prefix, proj), {})[int(index)] = tensor
            else:
                out[name] = tensor
    for (prefix, proj), by_index in experts.items():
        out[f"{prefix}.{proj}"] = torch.stack([by_index[i] for i in sorted(by_index)])
    return out
