"""What a run costs and how often it breaks, from the plan's exact FLOPs (``docs/cost.md``).

Cost: at ``training.cluster.mfu`` of the GPU's peak dense BF16 rate, the run's
FLOPs take ``wall = flops / (world_size * peak * mfu)`` seconds, i.e.
``wall * world_size`` GPU-seconds, and draw at most the GPU's TDP (board power
only: no CPUs, network or cooling).

Failures: interruptions arrive at ``failures_per_gpu_hour * world_size`` per
hour (a Poisson process), so the job's MTBF is its inverse. A checkpoint every
``tau`` seconds of work costs ``delta`` blocked seconds each, and each failure
costs the work since the last durable checkpoint (``tau / 2`` on average) plus
a restart. Young (1974) minimises that first-order lost time at
``tau = sqrt(2 * delta * M)``; Daly (2006) adds the higher-order terms.
Asynchronous checkpointing blocks only for the copy to host memory, but its
checkpoint is durable only once the background write ends, which every failure
pays as extra rework. Everything is first order in (overhead / run), the regime
where a run is worth starting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from factory.planner.memory import OPTIM_BYTES, WEIGHT_BYTES
from factory.schemas.cluster import ClusterConfig
from factory.schemas.parallelism import GPU_SPECS

__all__ = [
    "CHECKPOINT_BYTES_PER_PARAM",
    "CheckpointInterval",
    "CostPlan",
    "FailurePlan",
    "daly_interval",
    "failure_plan",
    "lost_seconds",
    "training_cost",
    "young_interval",
]

CHECKPOINT_BYTES_PER_PARAM = WEIGHT_BYTES + OPTIM_BYTES
"""A Megatron distributed-optimizer checkpoint holds bf16 weights, the fp32 master copy and
Adam's two fp32 moments (docs/memory.md, 'Model state'), once each: 14 bytes per parameter.
Gradients are not saved."""
HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True)
class CostPlan:
    """GPU time, wall-clock time and energy of the whole run at a given MFU."""

    gpu: str
    world_size: int
    mfu: float
    peak_flops_per_gpu: float
    total_flops: float
    wall_seconds: float
    step_seconds: float
    """Wall seconds per optimizer step at this MFU."""
    wall_days: float
    gpu_hours: float
    tdp_watts: float
    energy_mwh: float
    """GPU board power at TDP over the run, MWh; no CPUs, network, storage or cooling (PUE)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def training_cost(
    total_flops: float, steps: int, gpu: str, world_size: int, mfu: float
) -> CostPlan:
    """Price ``total_flops`` on ``world_size`` GPUs of type ``gpu`` running at ``mfu``."""
    spec = GPU_SPECS[gpu]
    wall = total_flops / (world_size * spec.bf16_dense_flops * mfu)
    gpu_hours = wall * world_size / HOUR
    return CostPlan(
        gpu=gpu,
        world_size=world_size,
        mfu=mfu,
        peak_flops_per_gpu=spec.bf16_dense_flops,
        total_flops=total_flops,
        wall_seconds=wall,
        step_seconds=wall / steps,
        wall_days=wall / DAY,
        gpu_hours=gpu_hours,
        tdp_watts=spec.tdp_watts,
        energy_mwh=gpu_hours * spec.tdp_watts / 1e6,  # GPU-hours x W = Wh; 1e6 Wh = 1 MWh
    )


# --------------------------------------------------------------------------- intervals


def young_interval(delta: float, mtbf: float) -> float:
    """Young (1974): the work between checkpoints that minimises first-order lost time."""
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly (2006): Young's interval with the higher-order terms; M once delta >= 2M."""
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def lost_seconds(
    interval: float, *, run: float, delta: float, mtbf: float, restart: float, exposure: float = 0
) -> float:
    """Seconds lost over ``run`` seconds of work: blocked checkpoint writes plus, per failure,
    half an interval of rework, ``exposure`` (work not yet durable) and the restart."""
    return run / interval * delta + run / mtbf * (interval / 2 + exposure + restart)


@dataclass(frozen=True)
class CheckpointInterval:
    """One checkpoint interval and what it loses over the run."""

    interval_seconds: float
    interval_steps: float
    checkpoints: float
    checkpoint_seconds: float
    """Time blocked writing checkpoints over the run."""
    failure_seconds: float
    """Rework plus restarts over the run."""
    lost_seconds: float
    lost_fraction: float
    """lost_seconds / the failure-free wall time."""
    lost_gpu_hours: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _policy(interval: float, steps: float, world: int, **model: float) -> CheckpointInterval:
    """``interval`` seconds of work (``steps`` optimizer steps) between checkpoints."""
    run, delta = model["run"], model["delta"]
    lost = lost_seconds(interval, **model)
    blocked = run / interval * delta
    return CheckpointInterval(
        interval_seconds=interval,
        interval_steps=steps,
        checkpoints=run / interval,
        checkpoint_seconds=blocked,
        failure_seconds=lost - blocked,
        lost_seconds=lost,
        lost_fraction=lost / run,
        lost_gpu_hours=lost * world / HOUR,
    )


# --------------------------------------------------------------------------- failures


@dataclass(frozen=True)
class CheckpointMode:
    """Synchronous or asynchronous checkpointing: what blocks, the optimum, the blueprint's."""

    blocking_seconds: float
    """Training stops this long per checkpoint (the whole write; async: the host copy)."""
    exposure_seconds: float
    """Work a failure loses on top of the half interval (async: the background write)."""
    young_interval_seconds: float
    daly_interval_seconds: float
    optimal: CheckpointInterval
    """At Young's interval, but never shorter than one step nor (async) than the background
    write, which must end before the next checkpoint starts, and never longer than the run."""
    blueprint: CheckpointInterval
    """At the blueprint's training.checkpoint_interval."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class FailurePlan:
    """Expected interruptions, checkpoint costs and time lost, synchronous and asynchronous."""

    failures_per_gpu_hour: float
    job_mtbf_hours: float
    expected_interruptions: float
    restart_seconds: float
    checkpoint_bytes: int
    checkpoint_bytes_per_param: int
    write_seconds: float
    """One checkpoint's write to storage at world_size x the per-GPU bandwidth."""
    host_copy_seconds: float
    """One GPU's share of the checkpoint copied to host memory."""
    sync: CheckpointMode
    async_: CheckpointMode

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["async"] = out.pop("async_")
        return out


def _mode(
    blocking: float, exposure: float, cost: CostPlan, mtbf: float, restart: float, every: int
) -> CheckpointMode:
    model = dict(
        run=cost.wall_seconds, delta=blocking, mtbf=mtbf, restart=restart, exposure=exposure
    )
    young = young_interval(blocking, mtbf)
    step, world = cost.step_seconds, cost.world_size
    # Lost time is convex in the interval, so the best feasible one is Young's clamped to the
    # feasible set: at least one step (saves happen between steps) and, async, the write; at
    # most the whole run (one checkpoint, at the end).
    best = min(max(young, exposure, step), cost.wall_seconds)
    return CheckpointMode(
        blocking_seconds=blocking,
        exposure_seconds=exposure,
        young_interval_seconds=young,
        daly_interval_seconds=daly_interval(blocking, mtbf),
        optimal=_policy(best, best / step, world, **model),
        blueprint=_policy(every * step, every, world, **model),
    )


def failure_plan(
    cost: CostPlan, params: int, cluster: ClusterConfig, checkpoint_interval: int
) -> FailurePlan:
    """Interruptions and checkpoint overheads of the run priced by ``cost``."""
    world = cost.world_size
    mtbf = HOUR / (cluster.failures_per_gpu_hour * world)
    size = params * CHECKPOINT_BYTES_PER_PARAM
    # Megatron's fully parallel save spreads the deduplicated state over all ranks, so each
    # GPU writes (and, async, copies to host) about size / world_size bytes.
    write = size / (world * cluster.checkpoint_write_gb_per_s_per_gpu * 1e9)
    copy = size / world / (cluster.host_copy_gb_per_s * 1e9)
    restart = cluster.restart_minutes * 60
    return FailurePlan(
        failures_per_gpu_hour=cluster.failures_per_gpu_hour,
        job_mtbf_hours=mtbf / HOUR,
        expected_interruptions=cost.wall_seconds / mtbf,
        restart_seconds=restart,
        checkpoint_bytes=size,
        checkpoint_bytes_per_param=CHECKPOINT_BYTES_PER_PARAM,
        write_seconds=write,
        host_copy_seconds=copy,
        sync=_mode(write, 0.0, cost, mtbf, restart, checkpoint_interval),
        async_=_mode(copy, write, cost, mtbf, restart, checkpoint_interval),
    )
