"""Rules on the ``precision`` section against the model and pipeline.

The high-precision layer counts follow Megatron's ``--first-last-layers-bf16``
(``docs/precision.md``); override globs are checked against the model spec's
GEMM names so that a typo cannot silently leave a layer in the default
format.
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase

from factory.checks.registry import Finding, rule
from factory.dotted_paths import join_path
from factory.errors import did_you_mean
from factory.precision.policy import (
    excluded_gemm_names,
    generalized_gemm_names,
    quantizable_gemm_names,
    uses_low_precision,
)
from factory.schemas.blueprint import Blueprint

__all__: list[str] = []


@rule("precision.high_precision_layers")
def high_precision_layers(bp: Blueprint) -> Iterator[Finding]:
    """BF16 layer counts fit the stack and the first/last pipeline stage; indices exist."""
    hp, num_layers, pp = bp.precision.high_precision, bp.model.num_layers, bp.parallelism.pp
    if hp.first + hp.last > num_layers:
        yield Finding(
            "precision.high_precision",
            f"high_precision first + last = {hp.first} + {hp.last} = {hp.first + hp.last} "
            f"exceeds num_layers ({num_layers})",
        )
    per_stage = num_layers // pp
    for field in ("first", "last"):
        count = getattr(hp, field)
        if count > per_stage:
            yield Finding(
                f"precision.high_precision.{field}",
                f"high_precision.{field}={count} must be at most num_layers // pp = "
                f"{num_layers} // {pp} = {per_stage}",
            )
    for k, index in enumerate(hp.layers):
        if not 0 <= index < num_layers:
            yield Finding(
                f"precision.high_precision.layers[{k}]",
                f"layer index {index} is outside [0, {num_layers})",
            )


@rule("precision.delayed_scaling_first_last")
def delayed_scaling_first_last(bp: Blueprint) -> Iterator[Finding]:
    """FP8 delayed scaling cannot keep first/last layers in BF16 (Megatron raises)."""
    prec = bp.precision
    hp = prec.high_precision
    if prec.recipe == "fp8" and prec.fp8.scaling == "delayed" and (hp.first or hp.last):
        yield Finding(
            "precision.fp8.scaling",
            f"fp8 delayed scaling is incompatible with first/last BF16 layers "
            f"(high_precision first={hp.first}, last={hp.last}); use tensorwise scaling",
        )


@rule("precision.override_globs")
def override_globs(bp: Blueprint) -> Iterator[Finding]:
    """Every override glob matches at least one quantisable linear module."""
    if not bp.precision.overrides:
        return
    names = quantizable_gemm_names(bp.model)
    for glob in bp.precision.overrides:
        if any(fnmatchcase(name, glob) for name in names):
            continue
        excluded = [name for name in excluded_gemm_names(bp.model) if fnmatchcase(name, glob)]
        if excluded:
            hint = f"; it matches {excluded[0]!r}, which is never quantised (stays BF16/FP32)"
        else:
            hint = did_you_mean(glob, generalized_gemm_names(bp.model))
        yield Finding(
            join_path("precision.overrides", glob),
            f"override {glob!r} matches none of the {len(names)} linear modules{hint}",
        )


@rule("precision.switch_to_bf16_unused")
def switch_to_bf16_unused(bp: Blueprint) -> Iterator[Finding]:
    """Switching to BF16 late does nothing when every GEMM already runs in BF16."""
    prec = bp.precision
    if prec.switch_to_bf16 is None:
        return
    if not uses_low_precision(bp):
        yield Finding(
            "precision.switch_to_bf16",
            f"switch_to_bf16 (after_fraction={prec.switch_to_bf16.after_fraction}) has nothing "
            "to switch: the recipe and every override are already bf16",
            "warning",
        )


_BLACKWELL_ONLY = {"nvfp4": "NVFP4", "mxfp8": "MXFP8"}


@rule("precision.hardware_support")
def hardware_support(bp: Blueprint) -> Iterator[Finding]:
    """NVFP4 and MXFP8 GEMMs need Blackwell (SM100+); Hopper GPUs would only emulate them."""
    gpu = bp.parallelism.gpu
    if gpu not in ("h100", "h200"):
        return
    used = {bp.precision.recipe, *bp.precision.overrides.values()}
    for recipe in sorted(used & _BLACKWELL_ONLY.keys()):
        yield Finding(
            "precision.recipe" if recipe == bp.precision.recipe else "precision.overrides",
            f"{_BLACKWELL_ONLY[recipe]} GEMMs need a Blackwell GPU (b200, b300, gb200, gb300); "
            f"{gpu} GPUs have no {_BLACKWELL_ONLY[recipe]} tensor cores",
            "warning",
        )
