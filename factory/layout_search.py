"""``search_layouts``: the fastest layouts of a blueprint on N GPUs, by predicted tokens/s.

Every combination of TP, CP, PP, virtual stages, EP, ETP, micro-batch and recompute that
divides N and the model (each layer type's own TP/CP/EP/ETP rules, the pipeline and
batch rules) is predicted (``factory.planner.performance``: a fraction of a millisecond
each); then, fastest first, each is rebuilt as a blueprint and kept only if
``factory validate`` accepts it and its peak rank fits the GPU's memory, until ``top``
are kept, each with validate's warnings (a ``runtime.*`` one: ``factory train`` refuses
the layout, which Megatron runs). Sequence parallelism is on wherever TP is (MoE layers
need it, ``runtime.moe_sequence_parallel``, and it only removes work). Virtual stages
need '|' in the pattern: a pattern without them gets evenly spaced ones where the layers
allow, except in a program's stage (``keep_pattern``), which cannot change the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from factory.checks import Finding, run_rules
from factory.layers.model_spec import expert_layer_types
from factory.planner.layout import Layout, data_parallel_size, resolve_layout
from factory.planner.memory import memory_per_rank
from factory.planner.perf_constants import perf_constants
from factory.planner.performance import Performance, inputs_of, predict, step_terms
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.parallelism import GPU_SPECS
from factory.spec.layer_type import LAYER_TYPES

__all__ = ["SearchResult", "search_layouts"]

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
MAX_VPP = 4


@dataclass(frozen=True)
class SearchResult:
    """One layout the search keeps."""

    blueprint: Blueprint
    overrides: list[str]
    """``--set`` overrides that turn the searched blueprint into this one."""
    performance: Performance
    memory_bytes: int
    """The peak rank's memory (``factory.planner.memory``)."""
    dominant: str
    """The breakdown entry that costs the most time."""
    warnings: tuple[tuple[str, Finding], ...] = ()
    """What ``factory validate`` warns about this layout, each with its rule's name."""


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def _patterns(model: ModelConfig, pp: int, keep_pattern: bool) -> Iterator[tuple[int, str]]:
    """(vpp, pattern) choices for ``pp`` stages: the pattern's own '|' segments, else an even
    split (vpp 1) and, unless ``keep_pattern``, evenly spaced pipes for each vpp the layers
    allow."""
    parsed = model.parsed_pattern
    if parsed.has_pipes:
        if len(parsed.segments) % pp == 0:
            yield len(parsed.segments) // pp, model.pattern
        return
    main, layers = parsed.main, parsed.num_layers
    if pp == 1 or layers % pp == 0:
        yield 1, model.pattern
    if keep_pattern:
        return
    for vpp in range(2, MAX_VPP + 1):
        pieces = pp * vpp
        if pp > 1 and layers % pieces == 0:
            size = layers // pieces
            piped = "|".join(main[i : i + size] for i in range(0, layers, size))
            tail = model.pattern[len(main) :]  # the MTP part ('/...'), unchanged
            yield vpp, piped + tail


def _layer_ok(model: ModelConfig, tp: int, cp: int) -> bool:
    used = [kind for kind in LAYER_TYPES.values() if kind.used_by(model)]
    return not any(kind.tp_rules(model, tp) or kind.cp_rules(model, tp, cp) for kind in used)


def _expert_grids(model: ModelConfig, ranks: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs whose grid divides ``ranks`` (the GPUs of one pipeline stage)."""
    routed = expert_layer_types(model)
    if not routed:
        return [(1, tp)]
    pairs = []
    for etp in _divisors(ranks, min(ranks, 8)):
        if any(kind.etp_rules(model, etp) for kind in routed):
            continue
        for ep in _divisors(ranks // etp):
            if not any(kind.ep_rules(model, ep) for kind in routed):
                pairs.append((ep, etp))
    return pairs


def _candidates(bp: Blueprint, gpus: int, keep_pattern: bool) -> Iterator[dict[str, Any]]:
    """Every layout the structural rules allow, as parallelism fields (and a pattern)."""
    model, seq, gbs = bp.model, bp.data.seq_len, bp.parallelism.global_batch_size
    domain = GPU_SPECS[bp.parallelism.gpu].nvlink_domain
    for tp in _divisors(gpus, min(gpus, domain)):
        for cp in _divisors(gpus // tp):
            if (cp > 1 and seq % (2 * cp)) or (seq // cp) % tp or not _layer_ok(model, tp, cp):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = data_parallel_size(gpus, tp, cp, pp)
                grids = _expert_grids(model, gpus // pp, tp)
                for vpp, pattern in _patterns(model, pp, keep_pattern):
                    for mbs in MICRO_BATCHES:
                        if gbs % (mbs * dp):
                            continue
                        microbatches = gbs // (mbs * dp)
                        if vpp > 1 and (microbatches < pp or microbatches % pp):
                            continue
                        for ep, etp in grids:
                            for recompute in RECOMPUTE:
                                yield {
                                    "tp": tp, "cp": cp, "pp": pp, "ep": ep, "etp": etp,
                                    "micro_batch_size": mbs, "recompute": recompute,
                                    "sequence_parallel": tp > 1, "pattern": pattern,
                                }  # fmt: skip


def _with_layout(bp: Blueprint, fields: dict[str, Any], gpus: int, models: dict) -> Blueprint:
    """``bp`` with the candidate's layout (no validation: the planner reads it as is)."""
    parallel = {k: v for k, v in fields.items() if k != "pattern"}
    parallel["world_size"] = gpus
    for derived in ("vpp", "dp"):  # a written value asserts the old layout's
        if getattr(bp.parallelism, derived) is not None:
            parallel[derived] = None
    pattern = fields["pattern"]
    if pattern not in models:  # a fresh model, so its parsed pattern is not a stale copy
        models[pattern] = ModelConfig.model_validate(
            {**bp.model.model_dump(exclude_unset=True), "pattern": pattern}
        )
    return bp.model_copy(
        update={
            "model": models[pattern],
            "parallelism": bp.parallelism.model_copy(update=parallel),
        }
    )


def _overrides(bp: Blueprint, found: Blueprint) -> list[str]:
    out = []
    if found.model.pattern != bp.model.pattern:
        out.append(f"model.pattern={found.model.pattern}")
    before, after = bp.parallelism, found.parallelism
    for name in ("world_size", "gpu", "tp", "cp", "pp", "ep", "etp", "sequence_parallel"):
        if getattr(before, name) != getattr(after, name):
            out.append(f"parallelism.{name}={str(getattr(after, name)).lower()}")
    for name in ("micro_batch_size", "recompute"):
        if getattr(before, name) != getattr(after, name):
            out.append(f"parallelism.{name}={getattr(after, name)}")
    return out


def _dominant(perf: Performance) -> str:
    leaves: list[tuple[float, str]] = []
    for group, value in perf.breakdown.items():
        if isinstance(value, dict):
            leaves += [(v, f"{group}: {k}") for k, v in value.items()]
        else:
            leaves.append((value, group.replace("_", " ")))
    return max(leaves)[1]


def _predicted(bp: Blueprint, layout: Layout) -> float:
    """Predicted step seconds, without building the full Performance."""
    constants = perf_constants()
    terms = step_terms(inputs_of(bp), layout, bp.model, constants)
    return sum(constants.coefficients[c] * s for _, _, c, s in terms)


def search_layouts(
    blueprint: Blueprint,
    gpus: int,
    gpu: str | None = None,
    top: int = 10,
    keep_pattern: bool = False,
) -> list[SearchResult]:
    """The ``top`` fastest layouts of ``blueprint`` on ``gpus`` GPUs (of type ``gpu``, else
    the blueprint's) that validate and fit, fastest first. ``keep_pattern``: never add '|'
    to the pattern for virtual stages (a program's stage shares the model of the others)."""
    base = blueprint
    if gpu is not None:
        parallel = blueprint.parallelism.model_copy(update={"gpu": gpu})
        base = blueprint.model_copy(update={"parallelism": parallel})
    models: dict[str, ModelConfig] = {}
    ranked = []
    for fields in _candidates(base, gpus, keep_pattern):
        candidate = _with_layout(base, fields, gpus, models)
        layout = resolve_layout(candidate)
        ranked.append((_predicted(candidate, layout), len(ranked), candidate, layout))
    ranked.sort(key=lambda r: (r[0], r[1]))
    capacity = GPU_SPECS[base.parallelism.gpu].memory_bytes
    kept: list[SearchResult] = []
    for _, _, candidate, layout in ranked:
        if len(kept) == top:
            break
        checked = Blueprint.model_validate(candidate.model_dump(exclude_unset=True))
        found = run_rules(checked)
        if any(f.severity == "error" for _, f in found):
            continue
        memory = memory_per_rank(checked, layout).total
        if memory > capacity:
            continue
        perf = predict(checked, layout)
        overrides = _overrides(blueprint, checked)
        warnings = tuple((r.name, f) for r, f in found)
        kept.append(SearchResult(checked, overrides, perf, memory, _dominant(perf), warnings))
    return kept
