"""``factory.plan``: everything the blueprint implies before a GPU is touched.

Parameters (exact), training FLOPs per token (Megatron's formula and our own
count), memory per rank (Megatron's accounting, and the model state factory's
own runtime holds, per pipeline rank), the resolved layout, and what the run
costs and loses to failures (``factory.planner.cost``), and how fast it is
predicted to train (``factory.planner.performance``), in one object whose
``to_dict()`` is the ``factory plan --json`` document.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from factory.planner.cost import CostPlan, FailurePlan, failure_plan, training_cost
from factory.planner.flops import FlopsPerToken, flops_per_token
from factory.planner.layout import Layout, resolve_layout
from factory.planner.memory import MemoryPlan, memory_per_rank
from factory.planner.params import ModelParams, count_params
from factory.planner.performance import Performance, predict
from factory.planner.runtime_memory import RuntimeState, runtime_state_by_stage
from factory.schemas.blueprint import Blueprint

__all__ = ["Plan", "plan"]


@dataclass(frozen=True)
class Plan:
    name: str
    params: ModelParams
    flops_per_token: FlopsPerToken
    memory: MemoryPlan
    runtime_state: list[RuntimeState]
    """Bytes of model state a rank of factory's runtime holds, per pipeline rank."""
    layout: Layout
    tokens_per_step: int
    steps: int
    total_training_flops: float
    """Training FLOPs of the whole run by our exact count."""
    cost: CostPlan
    """GPU-hours, days and energy of the run at the predicted step time (or at
    ``training.cluster.mfu`` where the blueprint sets it)."""
    failures: FailurePlan
    """Expected interruptions, checkpoint intervals and time lost (docs/cost.md)."""
    performance: Performance
    """Predicted step time, tokens/s per GPU, MFU and their breakdown (docs/performance.md)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": asdict(self.params),
            "flops_per_token": self.flops_per_token.to_dict(),
            "memory_per_rank_bytes": self.memory.to_dict(),
            "runtime_state_per_rank_bytes": _runtime_state(self.runtime_state),
            "layout": self.layout.to_dict(),
            "training": {
                "tokens_per_step": self.tokens_per_step,
                "steps": self.steps,
                "total_flops": self.total_training_flops,
            },
            "cost": self.cost.to_dict(),
            "failures": self.failures.to_dict(),
            "performance": self.performance.to_dict(),
        }


def plan(blueprint: Blueprint) -> Plan:
    """Plan a validated blueprint (from :func:`factory.load_blueprint`)."""
    layout = resolve_layout(blueprint)
    seq_len = blueprint.data.seq_len
    flops = flops_per_token(blueprint.model, seq_len)
    per_step, steps = blueprint.tokens_per_step, blueprint.training_steps
    params = count_params(blueprint.model)
    total = flops.exact * per_step * steps
    training, parallel = blueprint.training, blueprint.parallelism
    performance = predict(blueprint, layout)
    gpus = (total, steps, parallel.gpu, parallel.world_size)
    if training.cluster.mfu is not None:  # the user's MFU overrides the prediction
        cost = training_cost(*gpus, mfu=training.cluster.mfu)
    else:
        cost = training_cost(*gpus, step_seconds=performance.step_seconds)
    return Plan(
        name=blueprint.meta.name,
        params=params,
        flops_per_token=flops,
        memory=memory_per_rank(blueprint, layout),
        runtime_state=runtime_state_by_stage(blueprint, layout),
        layout=layout,
        tokens_per_step=per_step,
        steps=steps,
        total_training_flops=total,
        cost=cost,
        failures=failure_plan(cost, params.total, training.cluster, training.checkpoint_interval),
        performance=performance,
    )


def _runtime_state(stages: list[RuntimeState]) -> dict[str, Any]:
    """Each pipeline rank's state in whole bytes, and the rank that holds the most."""
    rows = [
        {
            "weights": round(state.weights),
            "gradients": round(state.gradients),
            "optimizer": round(state.optimizer),
            "total": round(state.total),
        }
        for state in stages
    ]
    peak = max(range(len(rows)), key=lambda r: rows[r]["total"])
    return {"by_pipeline_rank": rows, "peak_rank": peak}
