"""``factory.planner.performance``: predicted step time, tokens/s per GPU and MFU.

A step runs ``num_microbatches`` micro-batches through the pipeline: the slowest
pipeline rank's micro-batch time ``t`` (``factory.planner.stage_time``) sets the pace,
the 1F1B schedule adds a bubble of ``(pp - 1) / vpp`` micro-batch times (interleaved
with ``vpp`` virtual stages), and after the last backward the data-parallel gradient
reduce-scatter and parameter all-gather that did not overlap with compute, then the
optimizer step:

    step = (num_microbatches + (pp - 1) / vpp) * t + exposed DP + optimizer

Every term is an ideal time at a data-sheet peak times a fitted coefficient
(``docs/performance.md`` has the equations and the fit).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from factory.planner.collectives import Links
from factory.planner.layout import Layout
from factory.planner.perf_constants import PerfConstants, perf_constants
from factory.planner.perf_terms import ModelTerms, model_terms
from factory.planner.stage_time import StageContext, Term, stage_terms
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.parallelism import GPU_SPECS, GPUSpec
from factory.schemas.precision_recipes import recipe_named
from factory.spec.activations import BF16

__all__ = ["Performance", "peak_format", "predict", "step_terms"]

_EMULATED_AT = "bf16"
"""The ``GPUSpec.dense_flops`` format whose peak a GEMM runs at where the chip has no tensor
cores for its recipe's format (factory emulates it)."""
_ADAM_BYTES = 4 + 2 * 4 + 2 * 4 + 2 * 4 + 2
"""Bytes an Adam step moves per parameter: read the fp32 gradient, read and write the fp32
master weight and both moments, write the BF16 weight."""


@dataclass(frozen=True)
class Performance:
    """The predicted speed of one layout (``factory plan --json``'s ``performance``)."""

    gpu: str
    recipe: str
    peak_format: str
    """The format whose dense peak MFU divides by: the recipe's, or 'bf16' where the GPU has
    no tensor cores for it (the emulated GEMMs run at the BF16 peak)."""
    peak_flops: float
    step_seconds: float
    tokens_per_s_per_gpu: float
    mfu: float
    """The plan's exact model FLOPs per token (no recompute) x tokens/s per GPU / peak_flops."""
    breakdown: dict[str, Any] = field(default_factory=dict)
    """Seconds of one step by component; the leaves sum to step_seconds."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "recipe": self.recipe,
            "peak_format": self.peak_format,
            "peak_flops_per_gpu": self.peak_flops,
            "step_seconds": self.step_seconds,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "breakdown_seconds": self.breakdown,
        }


def peak_format(recipe: str, gpu: GPUSpec) -> str:
    """The format a recipe's GEMMs run at on ``gpu``: the recipe's ``peak_format`` (mor runs
    its FP8 choice on FP8 tensor cores); a format without tensor cores is emulated at BF16."""
    wanted = recipe_named(recipe).peak_format
    return wanted if wanted in gpu.dense_flops else _EMULATED_AT


@dataclass(frozen=True)
class StepInputs:
    """What a prediction reads beyond the layout, as plain values."""

    terms: ModelTerms
    gpu: str
    recipe: str
    bf16_layers: frozenset[int]
    recompute: str
    distributed_optimizer: bool


def _context(inputs: StepInputs, layout: Layout, model: ModelConfig, d0: float) -> StageContext:
    spec = GPU_SPECS[inputs.gpu]
    fmt = peak_format(inputs.recipe, spec)
    quantizes = recipe_named(inputs.recipe).quantizes
    return StageContext(
        model=model,
        terms=inputs.terms,
        tokens=layout.micro_batch_size * inputs.terms.seq_len / layout.cp,
        tp=layout.tp,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        recompute=inputs.recompute,
        generation=spec.generation,
        bf16_peak=spec.bf16_dense_flops,
        low_peak=spec.dense_flops[fmt],
        quantizes=quantizes,
        emulated=quantizes and fmt == _EMULATED_AT,
        hbm=spec.hbm_bytes_per_s,
        links=Links(spec.nvlink_domain, spec.nvlink_bytes_per_s, spec.network_bytes_per_s),
        d0=d0,
        exp_rate=spec.exp_per_s,
    )


def _seconds(terms: list[Term], coefficients: dict[str, float]) -> float:
    return sum(coefficients[c] * s for _, _, c, s in terms)


def _params_on_rank(
    ctx: StageContext, layers: list[int], last: bool, first: bool
) -> tuple[float, float]:
    """(dense, expert) parameters a rank holds after TP and EP x ETP sharding."""
    dense = expert = 0.0
    blocks = [ctx.terms.main[i] for i in layers]
    if last:
        blocks += [block for block, _ in ctx.terms.mtp]
    for block in blocks:
        dense += block.tp_params / ctx.tp + block.replicated_params
        expert += block.expert_params / (ctx.ep * ctx.etp)
    table = ctx.terms.vocab_size * ctx.terms.hidden_size / ctx.tp
    return dense + table * (first + last), expert


def _dp_terms(
    ctx: StageContext,
    layout: Layout,
    params: tuple[float, float],
    mb_seconds: float,
    inputs: StepInputs,
    c: float,
) -> list[Term]:
    """Gradient reduce-scatter (overlapped with the last micro-batch's backward) and parameter
    all-gather (with the first one's forward), or one all-reduce without the distributed
    optimizer; what does not fit in its window is exposed. Then the optimizer step."""
    dense, expert = params
    links = ctx.links
    dense_group, expert_group = layout.dp * layout.cp, layout.edp
    dense_stride, expert_stride = layout.tp * layout.cp, layout.etp * layout.ep
    rs = links.ring_seconds(BF16 * dense, dense_group, dense_stride)
    rs += links.ring_seconds(BF16 * expert, expert_group, expert_stride)
    ag = rs if inputs.distributed_optimizer else 0.0
    if not inputs.distributed_optimizer:
        rs *= 2  # an all-reduce is a reduce-scatter and an all-gather, both in backward
    # Exposed time in ideal seconds of the comm coefficient c: max(0, c*x - window) / c.
    exposed = max(0.0, rs - 2 / 3 * mb_seconds / c) + max(0.0, ag - mb_seconds / 3 / c)
    shards = (dense_group, expert_group) if inputs.distributed_optimizer else (1, 1)
    adam = _ADAM_BYTES * (dense / shards[0] + expert / shards[1]) / ctx.hbm
    return [("communication", "dp", "comm", exposed), ("optimizer", "adam", "memory", adam)]


def step_terms(
    inputs: StepInputs, layout: Layout, model: ModelConfig, constants: PerfConstants
) -> list[Term]:
    """Every term of one step on the slowest pipeline rank (``constants`` pick that rank and
    the DP overlap windows; each term's seconds are still ideal)."""
    ctx = _context(inputs, layout, model, constants.gemm_shape_d0)
    coef = constants.coefficients
    per_rank = []
    for rank in range(layout.pp):
        layers = layout.layer_indices_on_rank(rank)
        last = rank == layout.pp - 1
        terms = stage_terms(ctx, layers, inputs.bf16_layers, last)
        per_rank.append((_seconds(terms, coef), rank, layers, terms))
    mb_seconds, rank, layers, stage = max(per_rank, key=lambda r: r[0])
    m, bubble = layout.num_microbatches, (layout.pp - 1) / layout.vpp
    step = [(g, k, c, s * m) for g, k, c, s in stage]
    step += [("pipeline_bubble", "1f1b", c, s * bubble) for _, _, c, s in stage]
    if layout.pp > 1:  # activations forward, gradients back, once per virtual stage
        nbytes = (
            BF16 * ctx.tokens / (ctx.tp if ctx.sequence_parallel else 1) * ctx.terms.hidden_size
        )
        crosses = layout.world_size > ctx.links.nvlink_domain
        p2p = 2 * layout.vpp * ctx.links.p2p_seconds(nbytes, crosses)
        step.append(("communication", "pp", "comm", p2p * (m + bubble)))
    params = _params_on_rank(ctx, layers, rank == layout.pp - 1, rank == 0)
    step += _dp_terms(ctx, layout, params, mb_seconds, inputs, coef["comm"])
    return step


def _breakdown(terms: list[Term], coefficients: dict[str, float]) -> dict[str, Any]:
    """Seconds by group, split by key where the group has several (compute by layer type,
    communication by kind)."""
    nested: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for group, key, c, s in terms:
        nested[group][key] += coefficients[c] * s
    out: dict[str, Any] = {}
    for group in (
        "compute",
        "communication",
        "recompute",
        "pipeline_bubble",
        "optimizer",
        "overhead",
    ):
        keys = nested.get(group, {})
        if group in ("compute", "communication", "recompute"):
            out[group] = {k: v for k, v in keys.items() if v}
        else:
            out[group] = sum(keys.values())
    return out


def inputs_of(blueprint: Blueprint) -> StepInputs:
    """The prediction's inputs that come from the blueprint, not the layout."""
    precision, parallel = blueprint.precision, blueprint.parallelism
    return StepInputs(
        terms=model_terms(blueprint.model, blueprint.data.seq_len),
        gpu=parallel.gpu,
        recipe=precision.recipe,
        bf16_layers=precision.high_precision.indices(blueprint.model.num_layers),
        recompute=parallel.recompute,
        distributed_optimizer=parallel.distributed_optimizer,
    )


def predict(
    blueprint: Blueprint, layout: Layout, constants: PerfConstants | None = None
) -> Performance:
    """The predicted speed of ``blueprint`` laid out as ``layout``."""
    constants = constants or perf_constants()
    inputs = inputs_of(blueprint)
    terms = step_terms(inputs, layout, blueprint.model, constants)
    coef = constants.coefficients
    step = _seconds(terms, coef)
    spec = GPU_SPECS[inputs.gpu]
    fmt = peak_format(inputs.recipe, spec)
    tokens_per_s = layout.global_batch_size * inputs.terms.seq_len / step / layout.world_size
    peak = spec.dense_flops[fmt]
    return Performance(
        gpu=inputs.gpu,
        recipe=inputs.recipe,
        peak_format=fmt,
        peak_flops=peak,
        step_seconds=step,
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=inputs.terms.flops_per_token * tokens_per_s / peak,
        breakdown=_breakdown(terms, coef),
    )
