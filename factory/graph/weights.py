"""Load weights into a built model from a checkpoint file or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

from factory.exports.hf import load_hf_state_dict
from factory.graph.model import HybridLM

__all__ = ["WeightsError", "load_weights"]


class WeightsError(ValueError):
    """The checkpoint does not fit the model: names or shapes differ."""


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors under our parameter names, from an HF folder, a .safetensors file or a .pt file."""
    if path.is_dir() or path.suffix == ".safetensors":
        return load_hf_state_dict(path)
    if path.suffix in (".pt", ".pth"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        return state.get("model", state)
    raise WeightsError(f"{path}: expected a folder, a .safetensors or a .pt file")


@torch.no_grad()
def load_weights(model: HybridLM, path: Path, ignore: tuple[str, ...] = ()) -> None:
    """Copy every tensor into ``model``; any missing, unexpected or mis-shaped tensor is an error."""
    state = read_state_dict(Path(path))
    own = model.state_dict()
    if model.cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("backbone.embeddings.weight"))
    missing = sorted(k for k in own if k not in state and not k.startswith(ignore))
    unexpected = sorted(k for k in state if k not in own and not k.startswith(ignore))
    shapes = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    )
    problems = [
        *(f"missing {k}" for k in missing[:5]),
        *(f"unexpected {k}" for k in unexpected[:5]),
        *shapes[:5],
    ]
    if problems:
        counts = f"{len(missing)} missing, {len(unexpected)} unexpected, {len(shapes)} mis-shaped"
        raise WeightsError(
            f"{path}: checkpoint does not fit the model ({counts}): " + "; ".join(problems)
        )
    for name, tensor in own.items():
        if name in state:
            tensor.copy_(state[name].to(tensor.dtype))
