"""Upcycling: a model seeded from a checkpoint of a related one (``model.init.upcycle_from``).

The blueprint's pattern is the source's with some layers replaced by a layer type that
upcycles from the one they replace (``LayerType.upcycles_from``: a MoE from the dense MLP
at the same place, He et al. 2024, arXiv:2410.07524, in ``factory/layers/moe/upcycle.py``).
Each such layer is seeded by its layer type's ``upcycle``; every other tensor is copied by
name. Where the source's tensors at a place are not the blueprint's, the parameter only
one layer type's mixer has (``LayerType.checkpoint_marker``) names what it holds there.
"""

from __future__ import annotations

import torch

from factory.graph.blocks import Block
from factory.graph.hybrid_lm import HybridLM
from factory.spec.layer_type import LAYER_TYPES, UpcycleError, layer_type

__all__ = ["UpcycleError", "upcycle"]


def _names_under(state: dict[str, torch.Tensor], mixer: str) -> set[str]:
    return {name for name in state if name.startswith(f"{mixer}.")}


def _source_symbol(state: dict[str, torch.Tensor], mixer: str) -> str:
    """The pattern symbol of the mixer stored under ``mixer`` in the source, by the first
    layer type whose marker it holds (a name another layer type's mixer may share: asked
    only where the source's tensors are not the blueprint's), or '?'."""
    return next(
        (
            symbol
            for symbol, kind in LAYER_TYPES.items()
            if kind.checkpoint_marker is not None and f"{mixer}.{kind.checkpoint_marker}" in state
        ),
        "?",
    )


@torch.no_grad()
def upcycle(model: HybridLM, source: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Overwrite ``model`` (built in fp32) from a ``source`` state dict.

    ``generator`` draws what an upcycled layer needs at random. Raises
    :class:`UpcycleError` when the source does not fit; the module docstring has the rule.
    """
    state = dict(source)
    if model.cfg.tie_embeddings and "backbone.embeddings.weight" in state:
        state.setdefault("lm_head.weight", state["backbone.embeddings.weight"])
    own, seeded = model.state_dict(), dict[str, Block]()
    for name, block in model.named_modules():
        if not isinstance(block, Block):
            continue
        mixer, wanted = f"{name}.mixer", layer_type(block.symbol)
        if wanted.upcycles_from is not None:
            seed = layer_type(wanted.upcycles_from)
            if seed.checkpoint_marker and f"{mixer}.{seed.checkpoint_marker}" not in state:
                raise UpcycleError(
                    f"source layer {name} is {_source_symbol(state, mixer)!r}, not the "
                    f"{seed.title or seed.name} layer ({seed.symbol!r}) that "
                    f"{wanted.title or wanted.name} layers ({block.symbol!r}) upcycle from at "
                    f"the same place"
                )
            seeded[mixer] = block
        elif _names_under(state, mixer) != _names_under(own, mixer):
            found = _source_symbol(state, mixer)
            if found not in (block.symbol, "?"):
                raise UpcycleError(
                    f"layer {name} is {block.symbol!r} in the blueprint but {found!r} in the "
                    f"source: the source pattern must be the blueprint's with the upcycled "
                    f"layers as the layers they upcycle from"
                )
    _copy_by_name(model, state, tuple(f"{prefix}." for prefix in seeded))
    for prefix, block in seeded.items():
        layer_type(block.symbol).upcycle(block.mixer, state, prefix, model.cfg, generator)


def _copy_by_name(model: HybridLM, state: dict[str, torch.Tensor], skip: tuple[str, ...]) -> None:
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(skip)}
    theirs = {k for k in state if not k.startswith(skip)}
    missing = sorted(own.keys() - theirs)
    unexpected = sorted(theirs - own.keys())
    shapes = [
        f"{k}: source {tuple(state[k].shape)} vs model {tuple(t.shape)}"
        for k, t in own.items()
        if k in state and state[k].shape != t.shape
    ]
    if missing or unexpected or shapes:
        problems = [
            *(f"missing {k}" for k in missing[:5]),
            *(f"unexpected {k}" for k in unexpected[:5]),
            *shapes[:5],
        ]
        raise UpcycleError(
            f"the source does not fit outside the upcycled layers ({len(missing)} missing, "
            f"{len(unexpected)} unexpected, {len(shapes)} mis-shaped): " + "; ".join(problems)
        )
    for name, tensor in own.items():
        tensor.copy_(state[name].to(tensor.dtype))
