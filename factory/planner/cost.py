"""What a run costs and how often it breaks, from the plan's exact FLOPs (``docs/cost.md``).

Cost: the run takes ``steps`` times the step time the performance model
predicts (``factory.planner.performance``), or, where ``training.cluster.mfu``
overrides it, ``wall = flops / (world_size * peak * mfu)`` seconds at that share
of the GPU's peak dense BF16 rate. That is ``wall * world_size`` GPU-seconds,
drawing at most the GPU's TDP (board power only: no CPUs, network or cooling).
Either way the MFU reported is the run's FLOPs over the BF16 peak, so that the
two compare.

Failures: interruptions arrive at ``failures_per_gpu_hour * world_size`` per
hour (a Poisson process), so the job's MTBF is its inverse. A checkpoint every
``tau`` seconds of work costs ``delta`` blocked seconds each, and each failure
costs the work since the last durable checkpoint (``tau / 2`` on average) plus
a restart. Young (1974) minimises that first-order lost time at
``tau = sqrt(2 * delta * M)``; Daly (2006) adds the higher-order terms.
Asynchronous checkpointing blocks only for the copy to host memory, but its
checkpoint is durable only once the background write ends, which every failure
pays as extra rework. Intervals are whole steps (saves happen between steps), at
most the run, and a run also saves at its end. The share of the run lost is the lost
time over the job's whole wall-clock time (work plus lost), so it stays below 100%
even where a checkpoint takes longer than the training itself. Everything is first
order in (overhead / run), the regime where a run is worth starting.
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
    "lost_share",
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
    """Model FLOPs over the GPUs' dense BF16 peak for the wall-clock time below."""
    basis: str
    """Where the time comes from: ``predicted`` (the performance model) or
    ``training.cluster.mfu``."""
    peak_flops_per_gpu: float
    total_flops: float
    steps: int
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
    total_flops: float,
    steps: int,
    gpu: str,
    world_size: int,
    *,
    mfu: float | None = None,
    step_seconds: float | None = None,
) -> CostPlan:
    """Price ``total_flops`` on ``world_size`` GPUs of type ``gpu``, taking ``step_seconds``
    per step (a prediction) or running at ``mfu`` of the BF16 peak: exactly one of them."""
    if (mfu is None) == (step_seconds is None):
        raise ValueError("give exactly one of mfu and step_seconds")
    spec = GPU_SPECS[gpu]
    capacity = world_size * spec.bf16_dense_flops
    if mfu is not None:
        wall, basis = total_flops / (capacity * mfu), "training.cluster.mfu"
    else:
        assert step_seconds is not None
        wall, basis = steps * step_seconds, "predicted"
        mfu = total_flops / (capacity * wall)
    gpu_hours = wall * world_size / HOUR
    return CostPlan(
        gpu=gpu,
        world_size=world_size,
        mfu=mfu,
        basis=basis,
        peak_flops_per_gpu=spec.bf16_dense_flops,
        total_flops=total_flops,
        steps=steps,
        wall_seconds=wall,
        step_seconds=step_seconds if step_seconds is not None else wall / steps,
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


def lost_share(lost: float, work: float) -> float:
    """The share of the job's wall-clock time (``work`` plus ``lost``) that is lost: in [0, 1),
    however long the checkpoints take next to the run."""
    return lost / (work + lost) if lost > 0 else 0.0


@dataclass(frozen=True)
class CheckpointInterval:
    """One checkpoint interval, in whole steps, and what it loses over the run."""

    interval_seconds: float
    interval_steps: int
    """Saves happen between steps, and a run needs no interval longer than itself."""
    checkpoints: int
    """One every ``interval_steps`` steps and one at the end: ceil(steps / interval_steps)."""
    checkpoint_seconds: float
    """Time blocked writing checkpoints over the run."""
    failure_seconds: float
    """Rework plus restarts over the run."""
    lost_seconds: float
    lost_fraction: float
    """lost_seconds / (the failure-free wall time + lost_seconds): at most 1."""
    lost_gpu_hours: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _policy(every: int, cost: CostPlan, **model: float) -> CheckpointInterval:
    """A checkpoint every ``every`` optimizer steps (clamped to the run) and at the end."""
    steps = cost.steps
    every = min(max(every, 1), steps)
    interval = every * cost.step_seconds
    checkpoints = math.ceil(steps / every)
    run, delta, mtbf = model["run"], model["delta"], model["mtbf"]
    blocked = checkpoints * delta
    failed = run / mtbf * (interval / 2 + model["exposure"] + model["restart"])
    return CheckpointInterval(
        interval_seconds=interval,
        interval_steps=every,
        checkpoints=checkpoints,
        checkpoint_seconds=blocked,
        failure_seconds=failed,
        lost_seconds=blocked + failed,
        lost_fraction=lost_share(blocked + failed, run),
        lost_gpu_hours=(blocked + failed) * cost.world_size / HOUR,
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
    """The whole number of steps nearest Young's interval that loses least, but never shorter
    than one step nor (async) than the background write, which must end before the next
    checkpoint starts, and never longer than the run."""
    blueprint: CheckpointInterval
    """At the blueprint's training.checkpoint_interval (the whole run when that is longer)."""

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


def _best_steps(young: float, exposure: float, cost: CostPlan) -> set[int]:
    """Whole step counts near Young's interval, inside the feasible set: at least one step and
    (async) the background write, which must end before the next save; at most the run. For
    each checkpoint count near the optimum's, the shortest interval that needs no more saves
    (less rework for the same writes), and the step counts either side of Young's."""
    step, steps = cost.step_seconds, cost.steps
    shortest = min(max(1, math.ceil(exposure / step - 1e-9)), steps)
    ratio = min(max(young / step, 1.0), float(steps))  # no overflow for a vanishing step time
    counts = {max(1, math.floor(steps / ratio)), math.ceil(steps / ratio)}
    near = {math.floor(ratio), math.ceil(ratio), *(math.ceil(steps / n) for n in counts)}
    return {min(max(n, shortest), steps) for n in near}


def _mode(
    blocking: float, exposure: float, cost: CostPlan, mtbf: float, restart: float, every: int
) -> CheckpointMode:
    model = dict(
        run=cost.wall_seconds, delta=blocking, mtbf=mtbf, restart=restart, exposure=exposure
    )
    young = young_interval(blocking, mtbf)
    # Lost time is convex in a continuous interval, so the best feasible one is Young's clamped
    # to the feasible set; in whole steps, with a whole number of saves, it is one near it.
    candidates = [_policy(n, cost, **model) for n in sorted(_best_steps(young, exposure, cost))]
    return CheckpointMode(
        blocking_seconds=blocking,
        exposure_seconds=exposure,
        young_interval_seconds=young,
        daly_interval_seconds=daly_interval(blocking, mtbf),
        optimal=min(candidates, key=lambda policy: policy.lost_seconds),
        blueprint=_policy(every, cost, **model),
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
