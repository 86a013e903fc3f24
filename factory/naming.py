"""Names of the graph's quantisable linear modules, without torch.

Precision overrides are globs over module names, and a glob that matches
nothing is almost always a typo that would silently leave a layer in the
default format. Checking them needs the names before any graph exists, so
this module derives them from a :class:`ModelConfig` alone.

Names follow the Hugging Face NemotronH checkpoint keys without ``backbone.``
and ``.weight``: ``layers.{i}.mixer.in_proj``, ``mtp.layers.{j}.eh_proj``.
Two departures, both deliberate:

* Routed experts are listed once per projection (``layers.{i}.mixer.experts.up_proj``),
  the grouped linear that runs them, not once per expert: 512 experts would
  otherwise make every listing and glob match 512 times larger for nothing,
  since all experts of a layer always share a format.
* The router (``mixer.gate``), the embeddings and ``lm_head`` are not
  listed: they stay in BF16/FP32 whatever the recipe says.
  :func:`excluded_module_names` lists them so a glob aimed at them can be
  told why it matches nothing.
"""

from __future__ import annotations

import re

from factory.schemas.model import ModelConfig

__all__ = [
    "excluded_module_names",
    "generalize",
    "generalized_names",
    "layer_index_of",
    "linear_module_names",
]

_MAMBA = ("in_proj", "out_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MAIN_LAYER = re.compile(r"^layers\.(\d+)\.")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def _mlp(activation: str) -> tuple[str, ...]:
    """Projections of a (possibly gated) MLP; swiglu adds the gate matrix."""
    gated = ("gate_proj",) if activation == "swiglu" else ()
    return (*gated, "up_proj", "down_proj")


def _mixer_linears(model: ModelConfig, symbol: str) -> list[str]:
    """Linear-module suffixes (relative to ``.mixer``) of one layer of type ``symbol``."""
    if symbol == "M":
        return list(_MAMBA)
    if symbol == "*":
        return list(_ATTENTION)
    if symbol == "-":
        return list(_mlp(model.mlp.activation if model.mlp else "relu2"))
    if symbol == "E":
        moe = model.moe
        activation = moe.activation if moe else "relu2"
        names = [f"experts.{p}" for p in _mlp(activation)]
        if moe is not None and moe.shared_expert_intermediate_size > 0:
            names += [f"shared_experts.{p}" for p in _mlp(activation)]
        if moe is not None and moe.latent_size is not None:
            names += ["fc1_latent_proj", "fc2_latent_proj"]
        return names
    return []


def _layer_slots(model: ModelConfig) -> list[tuple[str, str, bool]]:
    """(prefix, symbol, is_first_inner_mtp_layer) for every main and stored MTP layer."""
    slots = [(f"layers.{i}", symbol, False) for i, symbol in enumerate(model.layout.main)]
    inner = model.mtp_pattern
    for outer in range(model.mtp_stored_blocks):
        for k, symbol in enumerate(inner):
            slots.append((f"mtp.layers.{outer * len(inner) + k}", symbol, k == 0))
    return slots


def linear_module_names(model: ModelConfig) -> list[str]:
    """Every quantisable linear of the model, main stack first, then the stored MTP blocks.

    MTP blocks are flattened as in the checkpoint: inner layer ``k`` of block
    ``outer`` is ``mtp.layers.{outer * len(inner_pattern) + k}``, and the
    block's ``eh_proj`` sits on its first inner layer.
    """
    names: list[str] = []
    for prefix, symbol, first_inner in _layer_slots(model):
        if first_inner:
            names.append(f"{prefix}.eh_proj")
        names += [f"{prefix}.mixer.{suffix}" for suffix in _mixer_linears(model, symbol)]
    return names


def excluded_module_names(model: ModelConfig) -> list[str]:
    """Weights that look like linears but are never quantised: embeddings, head and routers."""
    gates = [f"{prefix}.mixer.gate" for prefix, symbol, _ in _layer_slots(model) if symbol == "E"]
    return ["embeddings", "lm_head", *gates]


def layer_index_of(name: str) -> int | None:
    """The main-stack layer index of a module name, or None (MTP, head, embeddings)."""
    match = _MAIN_LAYER.match(name)
    return int(match.group(1)) if match else None


def generalize(name: str) -> str:
    """Replace every numeric index by '*': 'layers.3.mixer.in_proj' -> 'layers.*.mixer.in_proj'."""
    return _INDEX.sub("*", name)


def generalized_names(model: ModelConfig) -> list[str]:
    """Distinct index-free spellings of the linear names, for did-you-mean suggestions.

    Both the full form ('layers.*.mixer.out_proj') and the short form people
    write in overrides ('*.mixer.out_proj') are offered, so a typo in either
    finds its closest correct glob.
    """
    out: dict[str, None] = {}
    for name in linear_module_names(model):
        full = generalize(name)
        out[full] = None
        out["*" + full.split("*", 1)[1]] = None
    return list(out)
