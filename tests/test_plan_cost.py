"""The plan's cost and failure sections (``factory.planner.cost``, ``docs/cost.md``)."""

from __future__ import annotations

import json
import math
import re
from functools import cache

import pytest
from conftest import PRESETS
from hypothesis import given, settings
from hypothesis import strategies as st

import factory
from factory.planner.cost import (
    CHECKPOINT_BYTES_PER_PARAM,
    daly_interval,
    failure_plan,
    lost_seconds,
    training_cost,
    young_interval,
)
from factory.proxy import derive_proxy
from factory.schemas.cluster import ClusterConfig
from factory.schemas.parallelism import GPU_SPECS

# delta (blocking seconds), M (MTBF seconds), R (restart seconds), run seconds: wide but sane
deltas = st.floats(0.01, 1e4)
mtbfs = st.floats(600.0, 1e8)
restarts = st.floats(0.0, 1e4)
runs = st.floats(1e4, 1e9)
fast = settings(max_examples=60, deadline=None, derandomize=True)


@cache
def _plan(name: str) -> factory.Plan:
    return factory.plan(factory.load_blueprint(name))


@fast
@given(deltas, mtbfs, restarts, runs, st.floats(0.5, 2.0).filter(lambda f: abs(f - 1) > 1e-3))
def test_young_interval_minimises_lost_time(delta, mtbf, restart, run, factor) -> None:
    model = dict(run=run, delta=delta, mtbf=mtbf, restart=restart)
    best = young_interval(delta, mtbf)
    assert lost_seconds(best, **model) <= lost_seconds(best * factor, **model)


@fast
@given(deltas, mtbfs, restarts, runs)
def test_young_interval_is_a_stationary_point(delta, mtbf, restart, run) -> None:
    model = dict(run=run, delta=delta, mtbf=mtbf, restart=restart)
    best, h = young_interval(delta, mtbf), 1e-4
    slope = (lost_seconds(best * (1 + h), **model) - lost_seconds(best * (1 - h), **model)) / 2
    assert abs(slope) <= 1e-6 * lost_seconds(best, **model)


@fast
@given(st.floats(1e-6, 1e-2), st.floats(1e3, 1e8))
def test_daly_agrees_with_young_when_checkpoints_are_cheap(ratio, mtbf) -> None:
    delta = ratio * mtbf
    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    assert abs(daly - young) <= 2 * math.sqrt(ratio) * young  # relative error O(sqrt(delta/M))
    assert daly_interval(3 * mtbf, mtbf) == mtbf  # delta >= 2M: checkpoint every MTBF


@fast
@given(st.floats(1e-8, 1e-3), st.floats(1.01, 10.0))
def test_lost_time_grows_with_the_failure_rate(rate, factor) -> None:
    cost = training_cost(1e24, 1000, "h100", 1024, mfu=0.4)
    low = ClusterConfig(failures_per_gpu_hour=rate)
    high = ClusterConfig(failures_per_gpu_hour=min(1.0, rate * factor))
    for mode in ("sync", "async"):
        a = failure_plan(cost, 10**10, low, 100).to_dict()[mode]
        b = failure_plan(cost, 10**10, high, 100).to_dict()[mode]
        assert b["optimal"]["lost_seconds"] > a["optimal"]["lost_seconds"]
        assert b["blueprint"]["lost_seconds"] > a["blueprint"]["lost_seconds"]


@fast
@given(st.floats(0.001, 1.0), st.floats(0.001, 1.0), st.sampled_from(sorted(GPU_SPECS)))
def test_cost_scales_as_one_over_mfu(u, v, gpu) -> None:
    a, b = (training_cost(3e23, 500, gpu, 256, mfu=mfu) for mfu in (u, v))
    assert a.gpu_hours * u == pytest.approx(b.gpu_hours * v, rel=1e-12)
    assert a.energy_mwh * u == pytest.approx(b.energy_mwh * v, rel=1e-12)
    assert a.wall_days * u == pytest.approx(b.wall_days * v, rel=1e-12)


@pytest.mark.parametrize("name", ["nano", "super", "ultra"])
def test_preset_numbers_are_finite_and_positive(name: str) -> None:
    doc = _plan(name).to_dict()
    numbers = [v for v in _leaves(doc["cost"]) + _leaves(doc["failures"]) if _is_number(v)]
    assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers)
    failures = doc["failures"]
    assert failures["sync"]["exposure_seconds"] == 0  # the only zero: sync has no async window
    for mode in ("sync", "async"):
        best, ours = failures[mode]["optimal"], failures[mode]["blueprint"]
        assert 0 < best["lost_seconds"] <= ours["lost_seconds"] * (1 + 1e-12)
        assert 0 < best["lost_fraction"] < 0.05  # the presets are worth running
    assert (
        failures["async"]["optimal"]["lost_seconds"] < failures["sync"]["optimal"]["lost_seconds"]
    )


def test_the_cost_is_at_the_predicted_step_time_unless_an_mfu_is_given() -> None:
    plan = _plan("nano")
    cost, steps = plan.cost, plan.steps
    assert cost.basis == "predicted"
    assert cost.step_seconds == plan.performance.step_seconds
    assert cost.wall_seconds == pytest.approx(steps * plan.performance.step_seconds, rel=1e-12)
    # the MFU both ways is the run's FLOPs over the BF16 peak of its GPUs for that time
    peak = 32 * GPU_SPECS["h100"].bf16_dense_flops
    assert cost.mfu == pytest.approx(plan.total_training_flops / (peak * cost.wall_seconds))
    with pytest.raises(ValueError, match="exactly one"):
        training_cost(1e24, 10, "h100", 8)


def test_nano_cost_by_hand() -> None:
    bp = factory.load_blueprint("nano", ["training.cluster.mfu=0.38"])
    plan = factory.plan(bp)
    cost, failures = plan.cost, plan.failures
    # 32 H100s at 989 TFLOP/s and 38% MFU (the blueprint's override), 700 W each
    assert (cost.world_size, cost.gpu, cost.mfu, cost.basis) == (
        32,
        "h100",
        0.38,
        "training.cluster.mfu",
    )
    wall = plan.total_training_flops / (32 * 989e12 * 0.38)
    assert cost.wall_seconds == pytest.approx(wall, rel=1e-12)
    assert cost.gpu_hours == pytest.approx(wall * 32 / 3600, rel=1e-12)
    assert cost.wall_days == pytest.approx(wall / 86400, rel=1e-12)
    assert cost.energy_mwh == pytest.approx(wall * 32 / 3600 * 700 / 1e6, rel=1e-12)
    assert cost.step_seconds * bp.training_steps == pytest.approx(wall, rel=1e-12)
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs
    rate = 419 / (16384 * 54 * 24)
    mtbf_h = 1 / (rate * 32)
    assert failures.job_mtbf_hours == pytest.approx(mtbf_h, rel=1e-12)
    assert failures.expected_interruptions == pytest.approx(wall / 3600 / mtbf_h, rel=1e-12)
    # 31,577,940,288 parameters x (2 bf16 + 4 master + 4 + 4 Adam) bytes
    assert CHECKPOINT_BYTES_PER_PARAM == 14
    assert failures.checkpoint_bytes == 31_577_940_288 * 14 == 442_091_164_032
    write = 442_091_164_032 / (32 * 2e12 / 16384)
    assert failures.write_seconds == pytest.approx(write, rel=1e-12)
    assert failures.host_copy_seconds == pytest.approx(442_091_164_032 / 32 / 64e9, rel=1e-12)
    tau = math.sqrt(2 * write * mtbf_h * 3600)
    assert failures.sync.young_interval_seconds == pytest.approx(tau, rel=1e-12)
    # Young's 35,923 s is 825.0 steps of 43.54 s; 826 whole steps lose less than 825
    best = failures.sync.optimal
    assert tau / cost.step_seconds == pytest.approx(825.02, abs=0.01)
    assert best.interval_steps == 826 and isinstance(best.interval_steps, int)
    assert best.interval_seconds == pytest.approx(826 * cost.step_seconds, rel=1e-12)
    assert best.checkpoints == math.ceil(bp.training_steps / 826) == 1203
    lost = 1203 * write + wall / (mtbf_h * 3600) * (best.interval_seconds / 2 + 600)
    assert best.lost_seconds == pytest.approx(lost, rel=1e-12)
    assert best.lost_fraction == pytest.approx(lost / (wall + lost), rel=1e-12)
    # the blueprint's 1,000 steps, at the MFU's step time; a last save at the end
    assert failures.sync.blueprint.interval_steps == bp.training.checkpoint_interval == 1000
    ours = 1000 * cost.step_seconds
    assert failures.sync.blueprint.interval_seconds == pytest.approx(ours, rel=1e-12)
    assert failures.sync.blueprint.checkpoints == math.ceil(bp.training_steps / 1000) == 994


def test_async_interval_waits_for_the_background_write() -> None:
    cost = training_cost(1e24, 10**6, "h100", 1024, mfu=0.4)  # steps of about 2.5 s
    slow = ClusterConfig(checkpoint_write_gb_per_s_per_gpu=0.001, host_copy_gb_per_s=10_000)
    plan = failure_plan(cost, 10**11, slow, 100).async_
    assert max(plan.young_interval_seconds, cost.step_seconds) < plan.exposure_seconds
    # the fewest whole steps that cover the write
    steps = plan.optimal.interval_steps
    assert (steps - 1) * cost.step_seconds < plan.exposure_seconds <= steps * cost.step_seconds


def test_best_interval_is_at_least_one_step() -> None:
    cost = training_cost(1e24, 10, "h100", 8, mfu=0.4)  # 10 steps of about 10 hours each
    plan = failure_plan(cost, 10**9, ClusterConfig(), 100)
    for mode in (plan.sync, plan.async_):
        assert mode.young_interval_seconds < cost.step_seconds
        assert mode.optimal.interval_seconds == cost.step_seconds
        assert mode.optimal.interval_steps == 1


def test_best_interval_is_at_most_the_run() -> None:
    cost = training_cost(1e18, 100, "b200", 8, mfu=0.5)  # a minute's run: failures are unlikely
    plan = failure_plan(cost, 10**8, ClusterConfig(), 10)
    assert plan.sync.young_interval_seconds > cost.wall_seconds
    assert plan.sync.optimal.interval_seconds == cost.wall_seconds
    assert plan.sync.optimal.checkpoints == 1


def test_cli_plan_shows_cost_and_json_has_the_keys(cli) -> None:
    # Nano's pretraining: phase 1 (23.5T) then phase 2 (1.5T), on one layout
    phase1, phase2 = ("nano", "--stage", "phase1"), ("nano", "--stage", "phase2")
    status, out, err = cli("plan", *phase1)
    assert status == 0, err
    summary = " ".join(out.split())
    assert re.search(
        r"cost: [\d,]+ GPU-hours, [\d,.]+ days on 32 x h100 at [\d.]+% MFU \(predicted\)", summary
    )
    mfu = ("--set", "training.cluster.mfu=0.38")
    status, out, err = cli("plan", *phase1, *mfu)
    summary = " ".join(out.split())
    assert (
        "cost: 361,421 GPU-hours, 470.6 days on 32 x h100 at 38% MFU (training.cluster.mfu)"
        in summary
    )
    assert "Failures and checkpoints" in out
    # the two phases cost what the 25T pretraining in one stage did: 384,490 GPU-hours
    hours = [json.loads(cli("plan", *p, *mfu, "--json")[1])["cost"] for p in (phase1, phase2)]
    assert round(sum(cost["gpu_hours"] for cost in hours)) == 384_490
    status, out, err = cli("plan", *phase1, "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert {"gpu_hours", "wall_days", "energy_mwh", "mfu", "tdp_watts"} <= doc["cost"].keys()
    failures = doc["failures"]
    assert {"job_mtbf_hours", "expected_interruptions", "checkpoint_bytes"} <= failures.keys()
    for mode in ("sync", "async"):
        assert {"young_interval_seconds", "daly_interval_seconds"} <= failures[mode].keys()
        assert {"interval_steps", "lost_fraction", "lost_gpu_hours"} <= failures[mode][
            "optimal"
        ].keys()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("mfu: 1.5", "training.cluster.mfu: Input should be less than or equal to 1"),
        ("mfu: 0", "training.cluster.mfu: Input should be greater than or equal to 0.001"),
        ("restart_minutes: -1", "training.cluster.restart_minutes: Input should be greater"),
    ],
)
def test_bad_cluster_values_are_located(cli, write_yaml, value: str, message: str) -> None:
    path = write_yaml(f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  cluster:\n    {value}\n")
    status, _, err = cli("validate", str(path))
    assert status == 2
    assert f"{path.name}:4: {message}" in err


def _leaves(node: object) -> list[object]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    return [node]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@fast
@given(
    st.floats(1e6, 1e26),
    st.integers(1, 2000),
    st.integers(1, 4096),
    st.floats(1e-8, 1.0),
    st.floats(0.001, 1000.0),
    st.integers(1, 10**6),
)
def test_lost_share_is_a_fraction_and_intervals_are_whole_steps_in_the_run(
    flops, steps, world, rate, write_bw, every
) -> None:
    """However short the run next to a checkpoint (a CPU proxy priced on GPUs: one save takes
    45 times its training), at most all of the job's time is lost, and intervals are whole
    steps no longer than the run."""
    cost = training_cost(flops, steps, "h100", world, mfu=0.4)
    cluster = ClusterConfig(failures_per_gpu_hour=rate, checkpoint_write_gb_per_s_per_gpu=write_bw)
    plan = failure_plan(cost, 10**9, cluster, every)
    for mode in (plan.sync, plan.async_):
        for policy in (mode.optimal, mode.blueprint):
            assert 0 <= policy.lost_fraction < 1
            assert isinstance(policy.interval_steps, int) and 1 <= policy.interval_steps <= steps
            assert policy.checkpoints == math.ceil(steps / policy.interval_steps)
        assert mode.blueprint.interval_steps == min(every, steps)


@fast
@given(st.floats(1e18, 1e24), st.integers(1, 300), st.floats(1e-6, 1e-2), st.floats(0.01, 10.0))
def test_the_best_interval_is_within_one_save_of_every_whole_step_count(
    flops, steps, rate, write_bw
) -> None:
    """Brute force over every feasible interval: the model's best loses at most one more save
    than the true best (whole saves make lost time jagged in the interval)."""
    cost = training_cost(flops, steps, "h100", 64, mfu=0.4)
    cluster = ClusterConfig(failures_per_gpu_hour=rate, checkpoint_write_gb_per_s_per_gpu=write_bw)
    plan = failure_plan(cost, 10**10, cluster, 1)
    for name, mode in (("sync", plan.sync), ("async", plan.async_)):
        feasible = [
            getattr(failure_plan(cost, 10**10, cluster, k), "async_" if name == "async" else name)
            for k in range(1, steps + 1)
            if k * cost.step_seconds >= mode.exposure_seconds * (1 - 1e-9) or k == steps
        ]
        truth = min(m.blueprint.lost_seconds for m in feasible)
        assert mode.optimal.lost_seconds <= truth + mode.blocking_seconds * (1 + 1e-9)


def test_a_run_shorter_than_one_save_is_one_checkpoint_and_mostly_lost() -> None:
    """The Nano proxy priced on one H100 at 38% MFU: 0.06 s of training, a 2.6 s write."""
    bp = factory.load_blueprint("nano", ["training.cluster.mfu=0.38"])
    plan = factory.plan(derive_proxy(bp))
    cost, sync = plan.cost, plan.failures.sync
    assert sync.blocking_seconds > 10 * cost.wall_seconds
    assert (sync.optimal.interval_steps, sync.optimal.checkpoints) == (300, 1)
    assert (sync.blueprint.interval_steps, sync.blueprint.checkpoints) == (100, 3)
    for policy in (sync.optimal, sync.blueprint):
        assert 0.9 < policy.lost_fraction < 1


EXPONENT = re.compile(r"\d[eE][+-]?\d")


@pytest.mark.parametrize(
    "args",
    [
        ("nano",),
        ("super",),
        ("ultra",),
        ("nano", "--proxy"),
        ("nano", "--stage", "phase1"),
        ("super", "--stage", "long_context"),
        ("ultra", "--stage", "sft"),
        ("nano", "--stage", "sft", "--proxy"),
    ],
)
def test_cli_plan_figures_read_right(cli, args: tuple[str, ...]) -> None:
    """No exponent, no share above 100%, whole steps and checkpoints, piped at 80 columns:
    a program's plan (its stages and totals) and one stage's."""
    status, out, err = cli("plan", *args)
    assert status == 0, err
    assert not EXPONENT.search(out)
    shares = [float(p.replace(",", "")) for p in re.findall(r"([\d,.]+)%", out)]
    assert all(0 <= share <= 100 for share in shares)
    # a stage's plan shows its MFU and shares; a program's table and a proxy's plan do not
    assert shares or "--proxy" in args or "--stage" not in args
    assert not re.search(r"\d\.\d+ (steps|checkpoints)", out)
    assert max(len(line) for line in out.splitlines()) <= 80


def test_cli_plan_of_a_proxy_says_gpu_cost_does_not_apply(cli) -> None:
    status, out, err = cli("plan", "nano", "--stage", "phase1", "--proxy")
    assert status == 0, err
    assert "not applicable" in out and "trains on CPU" in out
    assert "GPU-hours" in out and "GPU time" not in out  # named as not applicable, not priced
    status, out, err = cli("plan", "nano", "--stage", "phase1")
    assert "not applicable" not in out and "GPU time" in out
    # the program's plan: its table leaves the priced columns out, its summary says why
    status, out, err = cli("plan", "nano", "--proxy")
    assert status == 0, err
    assert "not applicable, the proxy trains on CPU" in " ".join(out.split())
    assert "GPU-hours" not in out and "GPU time" not in out
