"""Load weights into a built model from a checkpoint file or a Hugging Face folder.

A NemotronH checkpoint's names are the graph's, except that it stores each routed expert's
matrix apart (``experts.{e}.up_proj.weight``) where the graph stacks them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from factory.graph.hybrid_lm import HybridLM

__all__ = ["WeightsError", "load_hf_state_dict", "load_weights", "read_state_dict"]

_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj|gate_proj)\.weight$")
"""A routed expert's matrix under a Hugging Face checkpoint's name; ours stacks the experts."""


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
