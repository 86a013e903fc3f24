"""Load weights into a built model from a checkpoint file or a Hugging Face folder.

A NemotronH checkpoint's names are the graph's, except that it stores each routed expert's
matrix apart (``experts.{e}.up_proj.weight``) where the graph stacks them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from factory.graph.hybrid_lm import HybridLM
from factory.layers.model_spec import ModelSpec
from factory.spec.tensors import TensorSpec

__all__ = [
    "CheckpointSlices",
    "WeightsError",
    "load_hf_state_dict",
    "load_weights",
    "read_state_dict",
    "take",
]

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


class CheckpointSlices:
    """A checkpoint read a part at a time, under our tensor names: a rank reads only the rows
    it holds (``factory.distributed.materialize``).

    Safetensors files (a file, or every one in a Hugging Face folder) are opened with
    ``safe_open`` and sliced in runs of consecutive indices, so what is read is what is kept;
    a routed expert is read from its own tensor (``experts.{e}.up_proj.weight``). A ``.pt``
    file has no partial reads: it is loaded whole, once.
    """

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._whole: dict[str, torch.Tensor] | None = None
        self._keys: dict[str, tuple[Any, str]] = {}
        if self.path.suffix in (".pt", ".pth"):
            self._whole = read_state_dict(self.path)
            return
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else [self.path]
        if not files or not all(file.is_file() for file in files):
            raise WeightsError(f"{self.path}: no .safetensors file")
        for file in files:
            handle = safe_open(str(file), framework="pt")
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                self._keys[_OUR_NAMES.get(key, key)] = (handle, key)

    def check(self, spec: ModelSpec) -> None:
        """Raise :class:`WeightsError` unless the checkpoint has every tensor of ``spec`` (but
        tied ones), each expert's too, in its shape; reads headers only."""
        problems = []
        for tensor in spec.tensors():
            if tensor.tied_to is not None:
                continue
            if tensor.expert_dim is None:
                wanted = {tensor.name: tensor.shape}
            else:
                owner, _, projection = tensor.name.rpartition(".")
                matrix = tensor.shape[1:]
                wanted = {f"{owner}.{e}.{projection}.weight": matrix
                          for e in range(tensor.shape[0])}  # fmt: skip
                if self._whole is not None:
                    wanted = {tensor.name: tensor.shape}
            for name, shape in wanted.items():
                found = self._shape(name)
                if found is None:
                    problems.append(f"missing {name}")
                elif found != tuple(shape):
                    problems.append(f"{name}: checkpoint {found} vs model {tuple(shape)}")
        if problems:
            raise WeightsError(
                f"{self.path}: checkpoint does not fit the model ({len(problems)} problems): "
                + "; ".join(problems[:5])
            )

    def _shape(self, name: str) -> tuple[int, ...] | None:
        if self._whole is not None:
            found = self._whole.get(name)
            return None if found is None else tuple(found.shape)
        if name not in self._keys:
            return None
        handle, key = self._keys[name]
        return tuple(handle.get_slice(key).get_shape())

    def _block(self, name: str, index: list[torch.Tensor | None]) -> torch.Tensor:
        if self._whole is not None:
            return take(self._whole[name], index)
        if name not in self._keys:
            raise WeightsError(f"{self.path}: no tensor {name}")
        handle, key = self._keys[name]
        return _read_runs(handle.get_slice(key), index)

    def read(self, tensor: TensorSpec, index: list[torch.Tensor | None]) -> torch.Tensor:
        return self._block(tensor.name, index)

    def read_expert(
        self, tensor: TensorSpec, expert: int, index: list[torch.Tensor | None]
    ) -> torch.Tensor:
        if self._whole is not None:
            return take(self._whole[tensor.name][expert], index)
        owner, _, projection = tensor.name.rpartition(".")
        return self._block(f"{owner}.{expert}.{projection}.weight", index)


_OUR_NAMES = {"backbone.embedding.weight": "backbone.embeddings.weight"}
"""Checkpoint names that differ from ours (older NemotronH checkpoints' embedding)."""


def take(values: torch.Tensor, index: list[torch.Tensor | None]) -> torch.Tensor:
    """``values`` at ``index``: per dimension, the indices wanted (None: all)."""
    for dim, rows in enumerate(index):
        if rows is not None:
            values = values.index_select(dim, rows.to(values.device))
    return values


def _read_runs(handle: Any, index: list[torch.Tensor | None]) -> torch.Tensor:
    """A safetensors slice at ``index``: the first indexed dimension read in runs of
    consecutive indices (what TP and FSDP shards are), the others selected after."""
    dims = len(handle.get_shape())
    first = next((d for d, rows in enumerate(index) if rows is not None), None)
    if first is None:
        return handle[tuple(slice(None) for _ in range(dims))]
    rows = index[first].tolist()
    pieces, start = [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end] != rows[end - 1] + 1:
            key = [slice(None)] * dims
            key[first] = slice(rows[start], rows[end - 1] + 1)
            pieces.append(handle[tuple(key)])
            start = end
    rest = [None] * (first + 1) + list(index[first + 1 :])
    return take(torch.cat(pieces, first), rest)
