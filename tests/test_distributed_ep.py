"""Expert and expert-tensor parallelism on gloo ranks against one process
(``factory.distributed.parallelize.apply_expert_parallel``).

Each rank builds the tiny Super proxy (seed 0), splits its experts over the
expert grid's ``(ep, etp)`` mesh (EP=2 on 2 ranks, ETP=2 on 2 ranks, EP=2 x
ETP=2 on 4) and feeds its own slice of a batch; the same rank also runs the
unsharded model as the single-process reference. The loss is additive over
tokens (a fixed random probe of the logits plus the aux loss weighted by the
slice's share of the sequences), so the reference gradient of a dense parameter
is the sum over ranks, and an expert's is the block of it this rank holds (the
reference gradient cut as the DTensor's placements cut the weight). Workers
return the largest differences (relative for gradients and routed-expert
outputs, whose sizes span orders); the assertions run here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from runtime_helpers import tiny_blueprint
from torch.distributed.tensor import DTensor, distribute_tensor

import factory
from factory.distributed.local import run_ranks
from factory.distributed.mesh import build_meshes
from factory.distributed.parallelize import apply_expert_parallel, parallelize
from factory.layers.moe.expert_parallel import gather_rows, reduce_scatter_rows
from factory.layers.moe.module import MoE
from factory.planner.layout import resolve_layout

BATCH, SEQ, TIMEOUT = 2, 64, 180
TOL = 1e-5
EP2, ETP2, EP2_ETP2, EDP2_ETP2 = (2, 2, 1), (2, 1, 2), (4, 2, 2), (4, 1, 2)
"""Layouts as (world, ep, etp); tp is 1, so every rank routes its own micro-batch."""


def _blueprint(layout: tuple[int, int, int], capacity_factor: float | None = None) -> Any:
    world, ep, etp = layout
    moe = tiny_blueprint().model.moe.model_dump()
    moe["capacity_factor"] = capacity_factor
    parallelism = {"world_size": world, "ep": ep, "etp": etp, "global_batch_size": 2 * world}
    return tiny_blueprint(model={"moe": moe}, parallelism=parallelism)


def _expert_mesh(bp: Any) -> Any:
    return build_meshes(resolve_layout(bp), "cpu").expert["ep", "etp"]


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


def _case(
    rank: int, layout: tuple[int, int, int], skew: bool, capacity_factor: float | None
) -> dict[str, Any]:
    """One comparison of the layout against the reference on this rank (module docstring).

    ``capacity_factor`` set: the reference runs each rank's slice on its own, since the
    capacity is per rank; otherwise it runs the whole batch at once.
    """
    world, ep, _ = layout
    bp = _blueprint(layout, capacity_factor)
    split_model = factory.compile(bp, precision="off", seed=0).model.train()
    ref_model = factory.compile(bp, precision="off", seed=0).model.train()
    if skew:  # every token picks EP rank 0's experts: the other EP ranks receive nothing
        for moe in (*split_model.modules(), *ref_model.modules()):
            if isinstance(moe, MoE):
                moe.gate.e_score_correction_bias.data[: bp.model.moe.num_experts // 2] = 100.0
    apply_expert_parallel(split_model, _expert_mesh(bp))

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, bp.model.vocab_size, (world * BATCH, SEQ), generator=gen)
    shape = (world * BATCH, SEQ, bp.model.vocab_size)
    probes = [torch.randn(shape, generator=gen) for _ in range(1 + bp.model.mtp_depth)]
    chunks = [slice(r * BATCH, (r + 1) * BATCH) for r in range(world)]

    got = _run(split_model, ids, probes, chunks[rank])
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
        "load_per_ep_rank": [
            sum(v.view(ep, -1)[r].sum().item() for v in loads.values()) for r in range(ep)
        ],
        "dropped": None,
        **_gradient_differences(split_model, ref_model),
    }
    if capacity_factor is not None:  # MoE.capacity on this rank's BATCH * SEQ tokens
        capacity = math.ceil(capacity_factor * BATCH * SEQ * moe.top_k / moe.num_experts)
        result["dropped"] = all(v.max().item() > capacity for v in got["loads"].values())
    return result


def _gradient_differences(split_model: Any, ref_model: Any) -> dict[str, Any]:
    """Dense gradients summed over the ranks against the reference's; each expert gradient
    against the block of the reference's that its DTensor's placements cut."""
    result: dict[str, Any] = {"dense": 0.0, "experts": 0.0, "expert_grad_max": 0.0}
    result["expert_blocks"] = []
    reference = dict(ref_model.named_parameters())
    for name, param in split_model.named_parameters():
        ref = reference[name]
        assert (param.grad is None) == (ref.grad is None), name
        if param.grad is None:
            continue
        if isinstance(param, DTensor):
            assert param.shape == ref.shape and param.requires_grad == ref.requires_grad
            grad = param.grad.to_local()
            expected = distribute_tensor(
                ref.grad, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            result["experts"] = max(result["experts"], _relative(grad, expected))
            result["expert_grad_max"] = max(result["expert_grad_max"], grad.abs().max().item())
            result["expert_blocks"].append((name.rpartition(".")[2], tuple(grad.shape)))
        else:
            grad = param.grad.clone()
            dist.all_reduce(grad)
            result["dense"] = max(result["dense"], _relative(grad, ref.grad))
    return result


def _sharded_data_parallel_case(rank: int, layout: tuple[int, int, int]) -> dict[str, float]:
    """The whole layout (``parallelize``: ETP, then FSDP2 over DP for the dense layers and over
    EDP for the experts, gradients summed) against the reference on the whole batch: every
    gradient, made whole, is the reference's."""
    world = layout[0]
    bp = _blueprint(layout)
    split_model = factory.compile(bp, precision="off", seed=0).model.train()
    ref_model = factory.compile(bp, precision="off", seed=0).model.train()
    parallelize(split_model, build_meshes(resolve_layout(bp), "cpu"))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, bp.model.vocab_size, (world * BATCH, SEQ), generator=gen)
    shape = (world * BATCH, SEQ, bp.model.vocab_size)
    probes = [torch.randn(shape, generator=gen) for _ in range(1 + bp.model.mtp_depth)]
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    got = _run(split_model, ids, probes, rows)
    want = _run(ref_model, ids, probes, slice(None))
    heads = zip(got["heads"], want["heads"], strict=True)
    routed = zip(got["routed"], want["routed"], strict=True)
    reference = dict(ref_model.named_parameters())
    grads, experts_sharded = 0.0, 0
    for name, param in split_model.named_parameters():
        ref = reference[name]
        assert (param.grad is None) == (ref.grad is None), name
        if param.grad is not None:
            grads = max(grads, _relative(param.grad.full_tensor(), ref.grad))
            experts_sharded += ".mixer.experts." in name and param.device_mesh.ndim == 3
    return {
        "outputs": max(_maxdiff(g, w[rows]) for g, w in heads),
        "routed": max(_relative(g, w[rows]) for g, w in routed),
        "grads": grads,
        "experts_on_edp_ep_etp": experts_sharded,
    }


def _experts_linear_hook(layout: tuple[int, int, int]) -> list[tuple[str, tuple[int, ...]]]:
    """The layer's ``experts.linear`` runs the expert GEMMs on the local shards."""
    bp = _blueprint(layout)
    model = factory.compile(bp, precision="off", seed=0).model.eval()
    apply_expert_parallel(model, _expert_mesh(bp))
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


def _refusal(layout: tuple[int, int, int], **moe: int) -> str:
    """A split the experts do not divide into is refused before anything changes."""
    bp = _blueprint(layout)
    moe_cfg = bp.model.moe.model_dump() | moe
    model = factory.compile(
        tiny_blueprint(model={"moe": moe_cfg}), device="meta", precision="off"
    ).model
    with pytest.raises(ValueError) as err:
        apply_expert_parallel(model, _expert_mesh(bp))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(
        moe.dispatcher is None and not isinstance(moe.experts.up_proj, DTensor) for moe in layers
    )
    return str(err.value)


def _exact(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of two same-shaped tensors; 0 for two empty ones."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return _maxdiff(a, b) if a.numel() else 0.0


def _uneven_rows(rank: int) -> dict[str, float]:
    """``gather_rows`` and ``reduce_scatter_rows`` on 2 ranks holding 3 rows and none, forward
    and backward, against the same sums formed on one process."""
    group, counts, width = dist.group.WORLD, [3, 0], 4
    full = torch.arange(sum(counts) * width, dtype=torch.float64).view(-1, width)
    mine = full[sum(counts[:rank]) : sum(counts[: rank + 1])].clone().requires_grad_()
    gathered = gather_rows(mine, counts, group)
    scale = torch.tensor([1.0, 10.0], dtype=torch.float64)[rank]  # each rank's own weighting
    (gathered * scale).sum().backward()
    partial = (full * scale).requires_grad_()  # every rank's partial sums of all rows
    reduced = reduce_scatter_rows(partial, counts, rank, group)
    probe = torch.full_like(reduced, 1.0 + rank)
    (reduced * probe).sum().backward()
    own = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    expected_partial_grad = torch.zeros_like(full)
    for peer in range(2):  # each peer's probe reaches its own rows of every rank's partials
        rows = slice(sum(counts[:peer]), sum(counts[: peer + 1]))
        expected_partial_grad[rows] = 1.0 + peer
    return {
        "gathered": _exact(gathered, full),
        "gather_grad": _exact(mine.grad, torch.full_like(mine, 11.0)),  # 1 + 10 over ranks
        "reduced": _exact(reduced, full[own] * 11.0),
        "reduce_grad": _exact(partial.grad, expected_partial_grad),
    }


def _ep_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "dropless": _case(rank, EP2, skew=False, capacity_factor=None),
        "linear": _experts_linear_hook(EP2),
        "refusal": _refusal(EP2, num_experts=3, top_k=1),
    }


def _ep_skew_capacity_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "skew": _case(rank, EP2, skew=True, capacity_factor=None),
        "capacity": _case(rank, EP2, skew=False, capacity_factor=1.0),
    }


def _etp_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "dropless": _case(rank, ETP2, skew=False, capacity_factor=None),
        "linear": _experts_linear_hook(ETP2),
        "refusal": _refusal(ETP2, expert_intermediate_size=39),
        "uneven": _uneven_rows(rank),
    }


def _ep_etp_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "dropless": _case(rank, EP2_ETP2, skew=False, capacity_factor=None),
        "skew": _case(rank, EP2_ETP2, skew=True, capacity_factor=None),
        "capacity": _case(rank, EP2_ETP2, skew=False, capacity_factor=1.0),
        "fsdp": _sharded_data_parallel_case(rank, EDP2_ETP2),
    }


@pytest.fixture(scope="module")
def ep() -> list[dict[str, Any]]:
    return run_ranks(_ep_worker, EP2[0], timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ep_skew_capacity() -> list[dict[str, Any]]:
    return run_ranks(_ep_skew_capacity_worker, EP2[0], timeout=TIMEOUT)


@pytest.fixture(scope="module")
def etp() -> list[dict[str, Any]]:
    return run_ranks(_etp_worker, ETP2[0], timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ep_etp() -> list[dict[str, Any]]:
    return run_ranks(_ep_etp_worker, EP2_ETP2[0], timeout=TIMEOUT)


def _check_matches(results: list[dict[str, Any]], blocks: dict[str, tuple[int, ...]]) -> None:
    """Every rank matches the reference, and holds 3 MoE layers' expert blocks of ``blocks``'
    shapes (up_proj [E/ep, ff/etp, latent], down_proj [E/ep, latent, ff/etp])."""
    for rank, r in enumerate(results):
        assert sorted(r["expert_blocks"]) == sorted(list(blocks.items()) * 3), (rank, r)
        assert r["outputs"] < TOL, (rank, r)
        assert r["routed"] < TOL, (rank, r)
        assert r["loads"] == 0, (rank, r)
        assert r["dense"] < TOL, (rank, r)
        assert r["experts"] < TOL, (rank, r)


EP2_BLOCKS = {"up_proj": (16, 40, 16), "down_proj": (16, 16, 40)}
ETP2_BLOCKS = {"up_proj": (32, 20, 16), "down_proj": (32, 16, 20)}
EP2_ETP2_BLOCKS = {"up_proj": (16, 20, 16), "down_proj": (16, 16, 20)}


def test_ep_matches_single_process(ep: list[dict[str, Any]]) -> None:
    results = [r["dropless"] for r in ep]
    _check_matches(results, EP2_BLOCKS)
    assert all(r["expert_grad_max"] > 0 for r in results)  # both ranks' experts were used
    assert all(min(r["load_per_ep_rank"]) > 0 for r in results)


def test_ep_passes_the_expert_linear_hook(ep: list[dict[str, Any]]) -> None:
    for r in ep:
        # Every GEMM (3 layers, the MTP one once per depth) on 32 experts / 2 ranks.
        assert sorted(set(r["linear"])) == [("down_proj", (16, 16, 40)), ("up_proj", (16, 40, 16))]
        assert len(r["linear"]) == 2 * 4


def test_ep_refuses_uneven_experts(ep: list[dict[str, Any]]) -> None:
    message = ep[0]["refusal"]
    assert "3 routed experts" in message and "2 expert-parallel ranks" in message


def test_ep_rank_receiving_nothing(ep_skew_capacity: list[dict[str, Any]]) -> None:
    results = [r["skew"] for r in ep_skew_capacity]
    _check_matches(results, EP2_BLOCKS)
    for r in results:
        assert r["load_per_ep_rank"][0] > 0 and r["load_per_ep_rank"][1] == 0
    assert results[0]["expert_grad_max"] > 0 and results[1]["expert_grad_max"] == 0


def test_ep_capacity_factor_per_rank(ep_skew_capacity: list[dict[str, Any]]) -> None:
    results = [r["capacity"] for r in ep_skew_capacity]
    _check_matches(results, EP2_BLOCKS)
    assert all(r["dropped"] for r in results)  # the capacity did drop pairs on each rank


def test_etp_matches_single_process(etp: list[dict[str, Any]]) -> None:
    """ETP=2 alone: each expert's ffn split over the two ranks, which gather each other's
    tokens; every expert gradient block is exact."""
    results = [r["dropless"] for r in etp]
    _check_matches(results, ETP2_BLOCKS)
    assert all(r["expert_grad_max"] > 0 for r in results)


def test_etp_passes_the_expert_linear_hook_its_shards(etp: list[dict[str, Any]]) -> None:
    for r in etp:
        assert sorted(set(r["linear"])) == [("down_proj", (32, 16, 20)), ("up_proj", (32, 20, 16))]
        assert len(r["linear"]) == 2 * 4


def test_etp_refuses_an_expert_width_it_does_not_divide(etp: list[dict[str, Any]]) -> None:
    message = etp[0]["refusal"]
    assert "width 39" in message and "2 expert-tensor-parallel ranks" in message


def test_etp_uneven_all_gather_and_reduce_scatter(etp: list[dict[str, Any]]) -> None:
    """3 rows on one rank, none on the other: both collectives and their gradients."""
    for r in etp:
        assert r["uneven"] == {name: 0.0 for name in r["uneven"]}, r


def test_ep_times_etp_matches_single_process(ep_etp: list[dict[str, Any]]) -> None:
    results = [r["dropless"] for r in ep_etp]
    _check_matches(results, EP2_ETP2_BLOCKS)
    assert all(r["expert_grad_max"] > 0 for r in results)
    assert all(min(r["load_per_ep_rank"]) > 0 for r in results)


def test_ep_times_etp_with_an_ep_rank_receiving_nothing(ep_etp: list[dict[str, Any]]) -> None:
    """Every token picks EP rank 0's experts: ranks 2 and 3 (EP rank 1, both ETP ranks) gather
    and reduce-scatter empty blocks and their experts get zero gradients."""
    results = [r["skew"] for r in ep_etp]
    _check_matches(results, EP2_ETP2_BLOCKS)
    for r in results:
        assert r["load_per_ep_rank"][0] > 0 and r["load_per_ep_rank"][1] == 0
    assert [r["expert_grad_max"] > 0 for r in results] == [True, True, False, False]


def test_ep_times_etp_capacity_factor_per_rank(ep_etp: list[dict[str, Any]]) -> None:
    results = [r["capacity"] for r in ep_etp]
    _check_matches(results, EP2_ETP2_BLOCKS)
    assert all(r["dropped"] for r in results)


def test_etp_under_fsdp_over_the_expert_data_parallel_ranks(ep_etp: list[dict[str, Any]]) -> None:
    """DP=4 for the dense layers, ETP=2 x EDP=2 for the experts, each FSDP2-sharded over its
    data-parallel group: the 6 expert tensors live on the (edp, ep, etp) mesh and every
    gradient, summed and made whole, is the one-process gradient."""
    for r in ep_etp:
        f = r["fsdp"]
        assert f["experts_on_edp_ep_etp"] == 3 * 2, f
        assert f["outputs"] < TOL and f["routed"] < TOL and f["grads"] < TOL, f
