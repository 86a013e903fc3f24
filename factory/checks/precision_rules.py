"""Rules on the ``precision`` section against the model, pipeline and tensor parallelism.

The high-precision layer counts follow Megatron's ``--first-last-layers-bf16``
(``docs/precision.md``); override globs are checked against the model spec's
GEMM names so that a typo cannot silently leave a layer in the default
format. Tensor parallelism quantizes each rank's part of a split linear with
the whole tensor's statistics, which equals one process only when every part is
whole blocks of its recipe (``docs/distributed.md``, 'Quantized linears under TP').
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase

from factory.checks.registry import Finding, recipe_checks, rule
from factory.dotted_paths import join_path
from factory.errors import did_you_mean
from factory.layers.model_spec import model_spec
from factory.precision.policy import (
    excluded_gemm_names,
    generalized_gemm_names,
    index_free,
    quantizable_gemm_names,
    resolve_policy,
    uses_low_precision,
)
from factory.schemas.blueprint import Blueprint
from factory.schemas.parallelism import GPU_SPECS
from factory.schemas.precision_recipes import PrecisionRecipe, RecipeCheck, recipe_named
from factory.spec.tensors import TensorSpec

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


@recipe_checks
def declared_by_recipe(
    recipe: PrecisionRecipe, bp: Blueprint, check: RecipeCheck
) -> Iterator[Finding]:
    """A check a precision recipe declares (``PrecisionRecipe.checks``), run when it is the
    blueprint's default recipe."""
    if check in recipe_named(bp.precision.recipe).checks:
        for found in check.check(bp):
            yield Finding(*found)


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


@rule("precision.hardware_support")
def hardware_support(bp: Blueprint) -> Iterator[Finding]:
    """A recipe's GEMMs need tensor cores for its format (GPU_SPECS' peaks); other GPUs would
    only emulate them."""
    gpu = bp.parallelism.gpu
    used = {bp.precision.recipe, *bp.precision.overrides.values()}
    for name in sorted(used):
        recipe = recipe_named(name)
        fmt, title = recipe.peak_format, recipe.title
        if fmt in GPU_SPECS[gpu].dense_flops:
            continue
        able = [other for other, spec in GPU_SPECS.items() if fmt in spec.dense_flops]
        generations = "/".join(sorted({GPU_SPECS[g].generation.title() for g in able}))
        need = f"a {generations} GPU ({', '.join(able)})" if able else "tensor cores no GPU has"
        yield Finding(
            "precision.recipe" if name == bp.precision.recipe else "precision.overrides",
            f"{title} GEMMs need {need}; {gpu} GPUs have no {title} tensor cores",
            "warning",
        )


@rule("precision.tp_blocks")
def tp_blocks(bp: Blueprint) -> Iterator[Finding]:
    """Tensor parallelism gives each rank whole blocks of every quantized linear it splits."""
    par = bp.parallelism
    if par.tp == 1 or not uses_low_precision(bp):
        return
    blocks = _split_blocks(bp)
    seen = set()
    for layer in model_spec(bp.model).layers:
        whole = set(layer.type.tp_whole_linears(bp.model, par.tp))
        for t in layer.tensors:
            recipe, block = blocks.get(t.gemm_name, ("", 1)) if t.gemm else ("", 1)
            if block == 1 or t.expert_dim is not None:  # not a GEMM, or per-tensor scales
                continue
            findings = []
            if t.tp is not None and t.module.rpartition(".")[2] not in whole:
                findings += _feature_split(t, par.tp, f"{block}-element {recipe}", block)
            if layer.type.routes_experts and par.sequence_parallel:
                findings += _token_split(bp, t, f"{block}-token {recipe}", block)
            for finding in findings:  # once for all the layers alike
                if finding.message not in seen:
                    seen.add(finding.message)
                    yield finding


def _split_blocks(bp: Blueprint) -> dict[str, tuple[str, int]]:
    """GEMM name -> its recipe and the recipe's block (1: per-tensor scales, or none)."""
    p = bp.precision
    return {
        row.name: (row.recipe, recipe_named(row.recipe).split_block(p.options_for(row.recipe)))
        for row in resolve_policy(bp)
    }


def _feature_split(t: TensorSpec, tp: int, blocks: str, block: int) -> list[Finding]:
    """Each rank's share of every segment ``t`` splits must be whole blocks."""
    assert t.tp is not None
    what = "rows" if t.tp.dim == 0 else "columns"
    packed = " of a packed segment" if len(t.tp.segments) > 1 else ""
    return [
        Finding(
            "parallelism.tp",
            f"{index_free(t.name)}: tp={tp} gives each rank {width // tp} of the {width} {what}"
            f"{packed}, not whole {blocks} blocks, so the ranks cannot quantize it as one "
            "process does; choose a tp that leaves whole blocks, or keep it in bf16 with "
            "precision.overrides",
        )
        for width in t.tp.segments or (t.shape[t.tp.dim],)
        if width % tp == 0 and (width // tp) % block
    ]


def _token_split(bp: Blueprint, t: TensorSpec, blocks: str, block: int) -> list[Finding]:
    """A linear of a routing layer other than its routed experts (the shared expert, LatentMoE's
    projections) sees each rank's share of every sequence under sequence parallelism, and
    quantizes the tokens in blocks too (wgrad's blocks, and the Hadamard transform's tiles)."""
    par = bp.parallelism
    share = bp.data.seq_len // (par.cp * par.tp)
    if not share or share % block == 0:
        return []
    return [
        Finding(
            "data.seq_len",
            f"{index_free(t.module)}: sequence parallelism gives each of tp={par.tp} ranks "
            f"{share} tokens of every sequence (seq_len {bp.data.seq_len}), not whole {blocks} "
            f"blocks; make seq_len a multiple of {par.cp * par.tp * block}",
        )
    ]
