"""``factory.compile``: a blueprint in, a runnable PyTorch training graph out.

The model is built from its spec (``factory.graph``), initialised by the spec's rules or
loaded from ``model.init``, and given the blueprint's precision policy. Nothing else: the
plan is ``factory.plan``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from factory.checks.runtime_rules import transformer_engine_problem
from factory.graph.block_compile import compile_blocks
from factory.graph.hybrid_lm import HybridLM
from factory.graph.init import initialize
from factory.graph.upcycle import upcycle
from factory.graph.weights import load_weights, read_state_dict
from factory.layers.model_spec import model_spec
from factory.precision import te_backend
from factory.precision.apply import PrecisionRuntime, apply_precision
from factory.precision.backends import PrecisionBackend, require_te
from factory.precision.policy import uses_low_precision
from factory.proxy import derive_proxy
from factory.schemas.blueprint import Blueprint

__all__ = ["Compiled", "compile", "compile_for_training"]


@dataclass
class Compiled:
    model: HybridLM
    blueprint: Blueprint
    """The blueprint the model was built from (the proxy's, when proxy=True)."""
    precision: PrecisionRuntime | None = None
    """The installed precision policy (None with precision="off" or an all-BF16 policy)."""


def compile(
    blueprint: Blueprint,
    device: str | torch.device = "cpu",
    proxy: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    precision: PrecisionBackend = "auto",
    deferred: bool = False,
) -> Compiled:
    """Build the model of ``blueprint``.

    ``device="meta"`` builds shapes only (no memory), which is how the full
    Ultra graph is checked on a laptop. ``proxy=True`` builds
    :func:`factory.proxy.derive_proxy`'s small model of the same blueprint.
    ``seed`` fixes the initialisation. The router stays in fp32 whatever ``dtype``.

    ``precision`` applies the blueprint's precision table to the graph:
    ``"emulate"`` quantizes in PyTorch (exact emulation, any device), ``"te"``
    maps onto Transformer Engine (CUDA, ``pip install factory[gpu]``), ``"auto"``
    takes TE where it is installed, the model is on CUDA and the layout has no tensor
    parallelism (factory does not split TE's linears yet), else emulation, and ``"off"``
    leaves every linear unquantized.

    ``deferred=True`` builds on the meta device whatever ``device`` is and leaves the
    values to the caller, who lays the model out first and then gives each rank only its
    shards (``factory.distributed.materialize``); ``device`` still picks the precision
    backend.
    """
    if precision == "te":
        require_te()  # fail before building anything
    if proxy:
        blueprint = derive_proxy(blueprint)
    with torch.device("meta"):
        model = HybridLM(blueprint.model)
    device = torch.device(device)
    if deferred:
        _cast_keeping_fp32(model, dtype)
    elif device.type != "meta":
        model = model.to_empty(device=device)
        if blueprint.model.tie_embeddings:  # to_empty makes new tensors; re-tie them
            model.lm_head.weight = model.backbone.embeddings.weight
        initialize(model, model_spec(blueprint.model), seed)
        if blueprint.model.init.checkpoint:
            load_weights(model, Path(blueprint.model.init.checkpoint))
        if blueprint.model.init.upcycle_from:
            state = read_state_dict(Path(blueprint.model.init.upcycle_from))
            upcycle(model, state, torch.Generator().manual_seed(seed + 1))
        _cast_keeping_fp32(model, dtype)
    runtime = _apply_precision(model, blueprint, device, precision, seed)
    return Compiled(model=model, blueprint=blueprint, precision=runtime)


def _apply_precision(
    model: HybridLM,
    blueprint: Blueprint,
    device: torch.device,
    backend: PrecisionBackend,
    seed: int,
) -> PrecisionRuntime | None:
    if backend == "off" or not uses_low_precision(blueprint):
        return None
    te_fits = transformer_engine_problem(blueprint) is None
    if backend == "te" or (backend == "auto" and te_fits and te_backend.usable(device)):
        return te_backend.apply_te(model, blueprint, seed=seed)
    return apply_precision(model, blueprint, seed=seed)


def _cast_keeping_fp32(model: HybridLM, dtype: torch.dtype) -> None:
    """Cast to ``dtype``, except the tensors the spec keeps in fp32 (the router)."""
    if dtype == torch.float32:
        return
    model.to(dtype)
    state = model.state_dict(keep_vars=True)
    for tensor in model_spec(model.cfg).tensors():
        if tensor.fp32:
            state[tensor.name].data = state[tensor.name].data.float()


def compile_for_training(compiled: Compiled) -> None:
    """``training.compile``: the blocks of ``compiled.model`` compiled (those its layout
    compiled already are kept), with or without a precision policy."""
    compile_blocks(compiled.model)
