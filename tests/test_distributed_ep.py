"""Expert parallelism on 2 gloo ranks against one process (``factory.distributed.parallelize``).

Each rank builds the tiny Super proxy (seed 0), shards its experts with EP=2 and
feeds its own slice of a batch; the same rank also runs the unsharded model as
the single-process reference. The loss is additive over tokens (a fixed random
probe of the logits plus the aux loss weighted by the slice's share of the
sequences), so the reference gradient of a dense parameter is the sum over
ranks, and an expert's is the one its owning rank holds. Workers return the
largest differences (relative for gradients and routed-expert outputs, whose
sizes span orders); the assertions run here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from runtime_helpers import tiny_blueprint
from torch.distributed.tensor import DTensor

import factory
from factory.distributed.local import run_ranks
from factory.distributed.mesh import build_meshes
from factory.distributed.parallelize import apply_expert_parallel
from factory.layers.moe.expert_parallel import local_experts
from factory.layers.moe.module import MoE
from factory.planner.layout import resolve_layout

WORLD, BATCH, SEQ, TIMEOUT = 2, 2, 64, 120
TOL = 1e-5


def _blueprint(capacity_factor: float | None = None) -> Any:
    moe = tiny_blueprint().model.moe.model_dump()
    moe["capacity_factor"] = capacity_factor
    return tiny_blueprint(model={"moe": moe}, parallelism={"world_size": WORLD, "ep": WORLD})


def _loss(out: Any, probes: list[torch.Tensor], share: float) -> torch.Tensor:
    heads = [out.logits, *out.mtp_logits]
    loss = sum((h * p).sum() for h, p in zip(heads, probes, strict=True))
    return loss + share * out.aux_loss


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: gradients and MoE outputs differ in size by orders."""
    return _maxdiff(a, b) / max(b.abs().max().item(), 1e-30)


def _run(model: Any, ids: torch.Tensor, probes: list[torch.Tensor], rows: slice) -> dict:
    """Forward and backward on ``ids[rows]``: the heads' outputs, each MoE layer's routed-expert
    output [B, S, latent] (what EP computes; at init it is far too small next to the shared
    expert and the residual stream to show in the logits) and the layers' loads."""
    routed: list[torch.Tensor] = []
    batch = ids[rows].shape[0]

    def record(y: torch.Tensor) -> torch.Tensor:
        routed.append(y.detach().view(batch, SEQ, -1))
        return y

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    dispatchers = [m.dispatcher for m in moes]
    hooks = []
    for moe, dispatcher in zip(moes, dispatchers, strict=True):
        if dispatcher is None:
            hooks.append(moe.experts.register_forward_hook(lambda _m, _i, y: record(y)))
        else:
            moe.dispatcher = lambda *args, inner=dispatcher: record(inner(*args))
    out = model(ids[rows])
    _loss(out, [p[rows] for p in probes], batch / ids.shape[0]).backward()
    for hook in hooks:
        hook.remove()
    for moe, dispatcher in zip(moes, dispatchers, strict=True):
        moe.dispatcher = dispatcher
    heads = [h.detach() for h in (out.logits, *out.mtp_logits)]
    return {"heads": heads, "routed": routed, "loads": out.tokens_per_expert}


def _case(rank: int, skew: bool, capacity_factor: float | None) -> dict[str, Any]:
    """One comparison of EP against the reference on this rank (see the module docstring).

    ``capacity_factor`` set: the reference runs each rank's slice on its own, since the
    capacity is per rank; otherwise it runs the whole batch at once.
    """
    bp = _blueprint(capacity_factor)
    ep_model = factory.compile(bp, precision="off", seed=0).model.train()
    ref_model = factory.compile(bp, precision="off", seed=0).model.train()
    if skew:  # every token picks rank 0's experts: rank 1 receives nothing
        for moe in (*ep_model.modules(), *ref_model.modules()):
            if isinstance(moe, MoE):
                moe.gate.e_score_correction_bias.data[: bp.model.moe.num_experts // WORLD] = 100.0
    ep_mesh = build_meshes(resolve_layout(bp), "cpu").expert["ep"]
    apply_expert_parallel(ep_model, ep_mesh)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, bp.model.vocab_size, (WORLD * BATCH, SEQ), generator=gen)
    shape = (WORLD * BATCH, SEQ, bp.model.vocab_size)
    probes = [torch.randn(shape, generator=gen) for _ in range(1 + bp.model.mtp_depth)]
    chunks = [slice(r * BATCH, (r + 1) * BATCH) for r in range(WORLD)]

    got = _run(ep_model, ids, probes, chunks[rank])
    if capacity_factor is None:
        want = _run(ref_model, ids, probes, slice(None))
        want["heads"] = [h[chunks[rank]] for h in want["heads"]]
        want["routed"] = [y[chunks[rank]] for y in want["routed"]]
        loads = {k: v.clone() for k, v in got["loads"].items()}
        for load in loads.values():  # local loads add up to the whole batch's
            dist.all_reduce(load)
    else:
        want = [_run(ref_model, ids, probes, part) for part in chunks][rank]
        loads = got["loads"]

    moe = bp.model.moe
    result: dict[str, Any] = {
        "outputs": max(map(_maxdiff, got["heads"], want["heads"])),
        "routed": max(map(_relative, got["routed"], want["routed"])),
        "loads": max(_maxdiff(loads[k], want["loads"][k]) for k in loads),
        "load_per_rank": [
            sum(v.view(WORLD, -1)[r].sum().item() for v in loads.values()) for r in range(WORLD)
        ],
        "dense": 0.0,
        "experts": 0.0,
        "expert_grad_max": 0.0,
        "dtensor_experts": 0,
    }
    if capacity_factor is not None:  # MoE.capacity on this rank's BATCH * SEQ tokens
        capacity = math.ceil(capacity_factor * BATCH * SEQ * moe.top_k / moe.num_experts)
        result["dropped"] = all(v.max().item() > capacity for v in got["loads"].values())

    mine = local_experts(WORLD, ep_mesh.get_local_rank(), moe.num_experts)
    reference = dict(ref_model.named_parameters())
    for name, param in ep_model.named_parameters():
        ref = reference[name]
        assert (param.grad is None) == (ref.grad is None), name
        if param.grad is None:
            continue
        if isinstance(param, DTensor):
            assert param.shape == ref.shape and param.requires_grad == ref.requires_grad
            grad, expected = param.grad.to_local(), ref.grad[mine.start : mine.stop]
            result["experts"] = max(result["experts"], _relative(grad, expected))
            result["expert_grad_max"] = max(result["expert_grad_max"], grad.abs().max().item())
            result["dtensor_experts"] += 1
        else:
            grad = param.grad.clone()
            dist.all_reduce(grad)
            result["dense"] = max(result["dense"], _relative(grad, ref.grad))
    return result


def _experts_linear_hook(rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """The layer's ``experts.linear`` runs the expert GEMMs on the local shards."""
    bp = _blueprint()
    model = factory.compile(bp, precision="off", seed=0).model.eval()
    apply_expert_parallel(model, build_meshes(resolve_layout(bp), "cpu").expert["ep"])
    calls: list[tuple[str, tuple[int, ...]]] = []

    def linear(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append((name, tuple(w.shape)))
        return torch.bmm(x, w.transpose(1, 2))

    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.experts.linear = linear
    with torch.no_grad():
        model(torch.zeros(1, SEQ, dtype=torch.long))
    return calls


def _refusal(rank: int) -> str:
    """E % EP != 0 is refused before anything changes."""
    bp = _blueprint()
    moe_cfg = bp.model.moe.model_dump() | {"num_experts": 3, "top_k": 1}
    model = factory.compile(
        tiny_blueprint(model={"moe": moe_cfg}), device="meta", precision="off"
    ).model
    mesh = build_meshes(resolve_layout(bp), "cpu").expert["ep"]
    with pytest.raises(ValueError) as err:
        apply_expert_parallel(model, mesh)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(
        moe.dispatcher is None and not isinstance(moe.experts.up_proj, DTensor) for moe in layers
    )
    return str(err.value)


def _dropless_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "dropless": _case(rank, skew=False, capacity_factor=None),
        "linear": _experts_linear_hook(rank),
        "refusal": _refusal(rank),
    }


def _skew_capacity_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "skew": _case(rank, skew=True, capacity_factor=None),
        "capacity": _case(rank, skew=False, capacity_factor=1.0),
    }


@pytest.fixture(scope="module")
def dropless() -> list[dict[str, Any]]:
    return run_ranks(_dropless_worker, WORLD, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def skew_capacity() -> list[dict[str, Any]]:
    return run_ranks(_skew_capacity_worker, WORLD, timeout=TIMEOUT)


def _check_matches(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["dtensor_experts"] == 3 * 2, (rank, r)  # 3 MoE layers x (up, down)
        assert r["outputs"] < TOL, (rank, r)
        assert r["routed"] < TOL, (rank, r)
        assert r["loads"] == 0, (rank, r)
        assert r["dense"] < TOL, (rank, r)
        assert r["experts"] < TOL, (rank, r)


def test_ep_matches_single_process(dropless: list[dict[str, Any]]) -> None:
    results = [r["dropless"] for r in dropless]
    _check_matches(results)
    assert all(r["expert_grad_max"] > 0 for r in results)  # both ranks' experts were used
    assert all(min(r["load_per_rank"]) > 0 for r in results)


def test_ep_passes_the_expert_linear_hook(dropless: list[dict[str, Any]]) -> None:
    for r in dropless:
        # Every GEMM (3 layers, the MTP one once per depth) on 32 experts / 2 ranks.
        assert sorted({(name, shape[0]) for name, shape in r["linear"]}) == [
            ("down_proj", 16),
            ("up_proj", 16),
        ]
        assert len(r["linear"]) == 2 * 4


def test_ep_refuses_uneven_experts(dropless: list[dict[str, Any]]) -> None:
    message = dropless[0]["refusal"]
    assert "3 routed experts" in message and "2 expert-parallel ranks" in message


def test_ep_rank_receiving_nothing(skew_capacity: list[dict[str, Any]]) -> None:
    results = [r["skew"] for r in skew_capacity]
    _check_matches(results)
    for r in results:
        assert r["load_per_rank"][0] > 0 and r["load_per_rank"][1] == 0
    assert results[0]["expert_grad_max"] > 0 and results[1]["expert_grad_max"] == 0


def test_ep_capacity_factor_per_rank(skew_capacity: list[dict[str, Any]]) -> None:
    results = [r["capacity"] for r in skew_capacity]
    _check_matches(results)
    assert all(r["dropped"] for r in results)  # the capacity did drop pairs on each rank
