"""The performance model (``factory.planner.performance``, ``docs/performance.md``): each
term behaves as its physics says, whatever the fitted constants."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

import factory
from factory.planner.collectives import Links
from factory.planner.layout import resolve_layout
from factory.planner.perf_constants import COEFFICIENTS, PerfConstants, perf_constants
from factory.planner.performance import Performance, predict
from factory.planner.stage_time import shape_efficiency
from factory.schemas.blueprint import Blueprint
from factory.schemas.parallelism import GPU_SPECS

fast = settings(max_examples=40, deadline=None, derandomize=True)
links = st.sampled_from(
    [
        Links(s.nvlink_domain, s.nvlink_bytes_per_s, s.network_bytes_per_s)
        for s in GPU_SPECS.values()
    ]
)


@cache
def _nano() -> Blueprint:
    return factory.load_blueprint("nano")


def _with(bp: Blueprint, **parallelism: object) -> Blueprint:
    """``bp`` with its layout changed (the planner reads it; validation is not the point)."""
    return bp.model_copy(update={"parallelism": bp.parallelism.model_copy(update=parallelism)})


def _predict(bp: Blueprint, constants: PerfConstants | None = None) -> Performance:
    return predict(bp, resolve_layout(bp), constants)


def _leaves(tree: dict) -> list[float]:
    out: list[float] = []
    for value in tree.values():
        out += _leaves(value) if isinstance(value, dict) else [value]
    return out


# --------------------------------------------------------------------------- collectives


@fast
@given(links, st.floats(1e3, 1e10), st.integers(1, 512), st.integers(1, 8))
def test_collectives_grow_with_bytes_and_vanish_alone(link, nbytes, size, stride) -> None:
    for time in (link.ring_seconds, link.all_to_all_seconds):
        assert time(nbytes, 1, stride) == 0.0
        assert time(nbytes, size, stride) <= time(2 * nbytes, size, stride)
        assert time(nbytes, size, stride) <= time(nbytes, size + 1, stride) * (1 + 1e-12)


@fast
@given(links, st.floats(1e3, 1e10), st.integers(2, 64))
def test_leaving_the_nvlink_domain_is_never_faster(link, nbytes, size) -> None:
    inside = link.ring_seconds(nbytes, size, 1)
    outside = link.ring_seconds(nbytes, size, link.nvlink_domain)
    assert inside <= outside


@fast
@given(st.floats(1, 1e6), st.floats(1, 1e6), st.floats(1, 1e6), st.floats(1, 1e4))
def test_gemm_shape_efficiency_is_a_fraction_growing_with_each_dimension(m, k, n, d0) -> None:
    eff = shape_efficiency(m, k, n, d0)
    assert 0 < eff < 1
    assert eff <= shape_efficiency(2 * m, k, n, d0)
    assert eff <= shape_efficiency(m, 2 * k, n, d0)
    assert eff <= shape_efficiency(m, k, 2 * n, d0)


# --------------------------------------------------------------------------- whole step


def test_one_gpu_communicates_nothing() -> None:
    bp = _with(_nano(), world_size=1, tp=1, ep=1, sequence_parallel=False, global_batch_size=8)
    perf = _predict(bp)
    assert not perf.breakdown["communication"]
    assert perf.breakdown["pipeline_bubble"] == 0


def test_breakdown_sums_to_the_step_and_mfu_is_defined_on_the_recipe_peak() -> None:
    bp = _nano()
    plan = factory.plan(bp)
    perf = plan.performance
    assert abs(sum(_leaves(perf.breakdown)) - perf.step_seconds) <= 1e-9 * perf.step_seconds
    expected = plan.flops_per_token.exact * perf.tokens_per_s_per_gpu / perf.peak_flops
    assert perf.mfu == expected
    assert perf.peak_flops == GPU_SPECS[bp.parallelism.gpu].dense_flops[perf.peak_format]
    assert plan.to_dict()["performance"]["tokens_per_s_per_gpu"] == perf.tokens_per_s_per_gpu


@fast
@given(st.sampled_from([1, 2, 4]), st.sampled_from([16, 64, 256]))
def test_the_bubble_vanishes_with_one_stage_and_shrinks_with_more_microbatches(pp, gbs) -> None:
    bp = _with(_nano(), world_size=32 * pp, pp=pp, global_batch_size=gbs)
    perf = _predict(bp)
    bubble = perf.breakdown["pipeline_bubble"]
    assert (bubble == 0) == (pp == 1)
    more = _predict(_with(bp, global_batch_size=4 * gbs))
    assert more.breakdown["pipeline_bubble"] / more.step_seconds <= bubble / perf.step_seconds


@fast
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([256, 1024]))
def test_more_gpus_never_add_compute_per_gpu_for_a_fixed_batch(dp_factor, gbs) -> None:
    bp = _with(_nano(), global_batch_size=gbs)
    wider = _with(bp, world_size=bp.parallelism.world_size * dp_factor)
    compute = sum(_predict(bp).breakdown["compute"].values())
    assert sum(_predict(wider).breakdown["compute"].values()) <= compute * (1 + 1e-12)


@fast
@given(st.sampled_from(COEFFICIENTS), st.floats(1.01, 10.0))
def test_a_larger_coefficient_never_makes_a_step_faster(name, factor) -> None:
    base = perf_constants()
    slower = replace(
        base, coefficients={**base.coefficients, name: base.coefficients[name] * factor}
    )
    for bp in (_nano(), _with(_nano(), world_size=128, pp=4, global_batch_size=64)):
        assert _predict(bp, slower).step_seconds >= _predict(bp, base).step_seconds


def test_communication_grows_with_the_group_it_spans() -> None:
    bp = _with(_nano(), global_batch_size=256)
    tp_comm = [
        _predict(_with(bp, tp=tp, world_size=8 * tp)).breakdown["communication"].get("tp", 0)
        for tp in (1, 2, 4, 8)
    ]
    assert tp_comm[0] == 0 and tp_comm == sorted(tp_comm)
    ep_comm = [
        _predict(_with(bp, tp=1, ep=ep, world_size=16)).breakdown["communication"].get("ep", 0)
        for ep in (1, 2, 8, 16)  # 16 leaves an H100's 8-GPU NVLink domain
    ]
    assert ep_comm[0] == 0 and ep_comm == sorted(ep_comm)


def test_recompute_only_adds_time() -> None:
    steps = [
        _predict(_with(_nano(), recompute=r)).step_seconds for r in ("none", "selective", "full")
    ]
    assert steps == sorted(steps)


def test_low_precision_is_faster_where_the_chip_has_it() -> None:
    def speed(gpu: str, recipe: str) -> float:
        bp = _with(_nano(), gpu=gpu)
        bp = bp.model_copy(update={"precision": bp.precision.model_copy(update={"recipe": recipe})})
        return _predict(bp).tokens_per_s_per_gpu

    assert speed("h100", "fp8") > speed("h100", "bf16")
    assert speed("gb200", "nvfp4") > speed("gb200", "mxfp8") > speed("gb200", "bf16")
    # Hopper has no MXFP8 tensor cores: the emulated GEMMs run at BF16 and add casts.
    assert speed("h100", "mxfp8") < speed("h100", "bf16")


def test_context_and_pipeline_traffic_appear_only_with_their_groups() -> None:
    bp = _with(_nano(), global_batch_size=256)
    comm = {
        cp: _predict(_with(bp, cp=cp, world_size=32 * cp)).breakdown["communication"]
        for cp in (1, 2, 4)
    }
    assert "cp" not in comm[1] and 0 < comm[2]["cp"] < comm[4]["cp"]
    assert "pp" not in comm[1]
    staged = _predict(_with(bp, pp=2, world_size=64)).breakdown["communication"]
    assert staged["pp"] > 0


def test_the_optimizer_step_shrinks_as_its_state_is_sharded_over_more_ranks() -> None:
    bp = _with(_nano(), global_batch_size=1024)
    optimizer = [_predict(_with(bp, world_size=32 * k)).breakdown["optimizer"] for k in (1, 2, 4)]
    assert optimizer[0] > optimizer[1] > optimizer[2] > 0
    whole = _predict(_with(bp, distributed_optimizer=False)).breakdown["optimizer"]
    assert whole > optimizer[0]


def test_softmax_exponentials_slow_attention_only_where_the_special_units_lag() -> None:
    """B300 doubles B200's exponential rate at the same BF16 peak and HBM: head_dim 64
    attention (more exponentials per FLOP) is faster there, head_dim 128 is not."""

    def attention_compute(head_dim: int, gpu: str) -> float:
        bp = _with(_nano(), gpu=gpu)
        attention = bp.model.attention.model_copy(update={"head_dim": head_dim})
        bp = bp.model_copy(update={"model": bp.model.model_copy(update={"attention": attention})})
        bp = bp.model_copy(update={"precision": bp.precision.model_copy(update={"recipe": "bf16"})})
        return _predict(bp).breakdown["compute"]["attention"]

    assert attention_compute(64, "b200") > attention_compute(64, "b300")
    assert attention_compute(128, "b200") == attention_compute(128, "b300")
    assert GPU_SPECS["b300"].exp_per_s == 2 * GPU_SPECS["b200"].exp_per_s
