"""``factory build``'s distributed check: the proxy on 2 gloo processes, on the smoke run's data.

The layout is data parallel over 2 ranks, with the experts split over them
(expert parallelism, folded onto the data-parallel ranks) when the blueprint has
MoE layers. The check trains with the blueprint's precision policy, as the smoke
run does, so the two runs' losses can be compared step by step. Tensor
parallelism is not part of it (its equality with one process under the policy
is ``tests/test_distributed_train.py``'s).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from factory.jobs.build_checks import run_losses
from factory.jobs.train import train
from factory.layers.model_spec import expert_layer_types
from factory.planner.layout import resolve_layout
from factory.proxy import derive_proxy
from factory.proxy_layout import proxy_with_layout

if TYPE_CHECKING:
    from factory.schemas.blueprint import Blueprint

__all__ = ["CHECK_WORLD_SIZE", "check_blueprint", "run_layout_check"]

CHECK_WORLD_SIZE = 2
CHECK_TIMEOUT_S = 900
"""The whole check, spawn to exit: a hung collective fails the build instead of stalling it."""


def check_blueprint(bp: Blueprint, proxy: Blueprint | None = None) -> Blueprint:
    """``bp``'s proxy (``proxy`` where the caller derived it: a program stage's) on
    :data:`CHECK_WORLD_SIZE` ranks: DP, with EP over them under MoE."""
    proxy = derive_proxy(bp) if proxy is None else proxy
    has_moe = bool(expert_layer_types(bp.model))
    degrees = {"pp": 1, "tp": 1, "ep": CHECK_WORLD_SIZE if has_moe else 1, "sp": False}
    laid_out = proxy_with_layout(proxy, CHECK_WORLD_SIZE, degrees)
    if laid_out is None:  # the proxy's experts do not split in two
        laid_out = proxy_with_layout(proxy, CHECK_WORLD_SIZE, {**degrees, "ep": 1})
    assert laid_out is not None  # plain data parallelism always validates
    return laid_out


def _train_rank(rank: int, world: int, bp: Blueprint, run: Path, data: Path, steps: int) -> None:
    train(bp, out=run, data=data, steps=steps)


def run_layout_check(
    bp: Blueprint,
    out: Path,
    steps: int,
    data: Path | None = None,
    proxy: Blueprint | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of the check layout (of ``proxy``, default ``bp``'s proxy) on
    ``data`` (default ``out/smoke/data``) into ``out/distributed``; return the layout and
    its LM losses."""
    from factory.distributed.local import run_ranks

    laid_out = check_blueprint(bp, proxy)
    run = out / "distributed"
    shutil.rmtree(run, ignore_errors=True)  # a few steps: rerun whole rather than resume
    data = data if data is not None else out / "smoke" / "data"
    run_ranks(_train_rank, CHECK_WORLD_SIZE, laid_out, run, data, steps, timeout=CHECK_TIMEOUT_S)
    par = laid_out.parallelism
    return {
        "world_size": par.world_size,
        "layout": {"dp": resolve_layout(laid_out).dp, "ep": par.ep, "tp": par.tp, "pp": par.pp},
        "steps": list(range(1, steps + 1)),
        "losses": run_losses(run),
    }
