"""Tensor and sequence parallelism on 2 gloo ranks against one process
(``factory.distributed.tensor_parallel``).

Every rank builds the same fp32 model (seed 0), runs it unsplit as the reference,
then splits a second copy with TP=2 and feeds it the same full batch (packed
documents included). Logits must agree, and after backward every gradient: a
DTensor's as its full tensor, put in the reference's rank-major order where
Mamba's packed tensors split segment by segment (the order is rebuilt here from
the spec's segments); a routed expert's summed over the TP ranks, which is the
reduction the expert-data-parallel group performs. The workers return
differences, the assertions run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from runtime_helpers import tiny_blueprint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from factory.distributed.local import run_ranks
from factory.distributed.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    reduce_partial_gradients,
)
from factory.graph.hybrid_lm import HybridLM
from factory.graph.init import initialize
from factory.graph.loss import language_model_loss
from factory.layers.model_spec import model_spec
from factory.spec.tensors import Split

WORLD, TIMEOUT = 2, 120
LOGITS_TOL, GRAD_TOL = 1e-5, 1e-5
DENSE = {"pattern": "M*-M", "mlp": {"intermediate_size": 64}, "mtp": None}
"""Attention (one KV head: replicated over the ranks), Mamba and an MLP; no MoE."""
FULL = {"pattern": "M*-ME", "mlp": {"intermediate_size": 64}, "tie_embeddings": True}
"""Adds LatentMoE with a shared expert, MTP ('*E') and a tied head (the tiny Super proxy's)."""


def _build(model: dict[str, Any], seed: int = 0) -> HybridLM:
    """``factory.compile(bp, precision="off", seed=seed)``'s model, built on the CPU: compile
    builds on the meta device and then moves it, whose ``to_empty`` imports sympy in each
    spawned process."""
    cfg = tiny_blueprint(model=model).model
    net = HybridLM(cfg)
    initialize(net, model_spec(cfg), seed)
    return net.eval()  # no aux loss: under SP it is computed from each rank's tokens


def _batch(vocab: int, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 20 + [1] * (seq - 20), [0] * seq])
    return ids, documents


def _step(net: HybridLM, ids: torch.Tensor, documents: torch.Tensor) -> Any:
    out = net(ids, documents)
    language_model_loss(out, ids, mtp_loss_scale=0.3, document_ids=documents).total.backward()
    return out


def _rank_major(full: torch.Tensor, split: Split, tp: int) -> torch.Tensor:
    """The reference tensor in the TP model's global order: each rank's chunk of every segment."""
    segments = full.split(list(split.segments or (full.shape[split.dim],)), split.dim)
    chunks = [s.chunk(tp, split.dim)[rank] for rank in range(tp) for s in segments]
    return torch.cat(chunks, split.dim)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _compare(
    model: dict[str, Any], sequence_parallel: bool, world: int
) -> tuple[dict[str, float], HybridLM]:
    """Run the reference and the TP model on one batch; the differences and the TP model."""
    reference, split = _build(model), _build(model)
    ids, documents = _batch(reference.cfg.vocab_size)
    expected = _step(reference, ids, documents)
    apply_tensor_parallel(split, DeviceMesh("cpu", list(range(world))), sequence_parallel)
    out = _step(split, ids, documents)
    reduce_partial_gradients(split)
    diffs = {
        f"logits {i}": (a - b).abs().max().item()
        for i, (a, b) in enumerate(zip([out.logits, *out.mtp_logits],
                                       [expected.logits, *expected.mtp_logits], strict=True))
    }  # fmt: skip
    specs = {t.name: t for t in model_spec(reference.cfg).tensors()}
    params = dict(split.named_parameters())
    for name, param in reference.named_parameters():
        grad = params[name].grad
        if param.grad is None:
            diffs[f"{name} has a gradient"] = float(grad is not None)
            continue
        want = param.grad
        if isinstance(grad, DTensor):
            diffs[f"{name} placement"] = float(grad.placements != params[name].placements)
            if grad.placements[0].is_shard():
                want = _rank_major(want, specs[name].tp, world)
            grad = grad.full_tensor()
        else:  # a routed expert: each TP rank's gradient covers its own tokens
            grad = grad.clone()
            dist.all_reduce(grad)
        diffs[name] = _relative(grad, want)
    for name, counts in expected.tokens_per_expert.items():
        diffs[f"{name} routed tokens"] = (out.tokens_per_expert[name] - counts).abs().max().item()
    return diffs, split


def _dense_worker(rank: int, world: int) -> dict[str, Any]:
    diffs, _ = _compare(DENSE, sequence_parallel=False, world=world)
    with pytest.raises(ValueError) as refused:
        apply_tensor_parallel(_build(FULL), DeviceMesh("cpu", list(range(world))), False)
    return {"diffs": diffs, "refused": str(refused.value)}


def _sequence_parallel_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    diffs, split = _compare(FULL, sequence_parallel=True, world=world)
    with pytest.raises(ValueError) as odd:
        split(torch.zeros(1, 31, dtype=torch.long))
    dcp.save(split.state_dict(), checkpoint_id=path)
    # Load it back into a TP model of other weights: the canonical order goes back rank-major.
    other = _build(FULL, seed=1)
    apply_tensor_parallel(other, DeviceMesh("cpu", list(range(world))), True)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    mine = dict(other.named_parameters())
    reloaded = max(
        (_local(mine[name]) - _local(param)).abs().max().item()
        for name, param in split.named_parameters()
    )
    return {"diffs": diffs, "odd length": str(odd.value), "reloaded": reloaded}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_local() if isinstance(t, DTensor) else t.detach()


def _check(results: list[dict[str, Any]]) -> None:
    for result in results:
        diffs = result["diffs"]
        logits = {k: v for k, v in diffs.items() if k.startswith("logits")}
        assert max(logits.values()) < LOGITS_TOL, logits
        bad = {k: v for k, v in diffs.items() if k not in logits and not v <= GRAD_TOL}
        assert not bad, bad


def test_tp_without_sequence_parallel_matches_one_process() -> None:
    results = run_ranks(_dense_worker, WORLD, timeout=TIMEOUT)
    _check(results)
    for result in results:
        assert "with MoE layers needs sequence parallelism" in result["refused"]


def test_sequence_parallel_with_moe_matches_one_process_and_checkpoints(tmp_path: Path) -> None:
    results = run_ranks(_sequence_parallel_worker, WORLD, str(tmp_path), timeout=TIMEOUT)
    _check(results)
    for result in results:
        assert "length 31 is not divisible" in result["odd length"], result["odd length"]
        assert result["reloaded"] == 0.0
    # The TP=2 checkpoint holds the canonical layout: it loads into one process as is.
    plain = _build(FULL, seed=1)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    plain.load_state_dict(state)
    for name, tensor in _build(FULL).state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("section", "tp", "numbers"),
    [
        ({"attention": {"heads": 6, "kv_heads": 1, "head_dim": 8}}, 4, ["heads (6)", "tp=4"]),
        ({"attention": {"heads": 6, "kv_heads": 3, "head_dim": 8}}, 2, ["kv_heads (3)", "tp=2"]),
        ({"mamba": {"groups": 1}}, 2, ["mamba groups (1)"]),
        ({"mlp": {"intermediate_size": 66}, "pattern": "M-*"}, 4, ["up_proj", "width 66", "tp=4"]),
        ({}, 2, ["tp=2 with MoE layers needs sequence parallelism"]),
    ],
)
def test_refuses_what_tp_cannot_split(section: dict[str, Any], tp: int, numbers: list) -> None:
    model = tiny_blueprint().model.model_dump()
    for key, value in section.items():
        model[key] = {**(model[key] or {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(_build(model), tp, sequence_parallel=False)
    for number in numbers:
        assert number in str(refused.value), (number, str(refused.value))
