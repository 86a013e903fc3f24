"""Context parallelism on 2 gloo ranks equals one process, layer by layer and on the loss.

Each rank holds two chunks of every sequence (head-tail, ``factory.nn.sequence_split``):
attention gathers the keys and values of both ranks, Mamba trades sequence shards for head
shards around its conv and scan, MoE routes each rank's own tokens, MTP and the loss take
the rank's rows of the whole sequence. The batch packs documents across the chunk
boundaries. The ranks' token losses add up to the one-process ones, and their gradients
(summed over the ranks, as FSDP2 or DDP over the DP-CP group does) are the one-process
gradients, for Mamba with as many groups as ranks and with fewer (replicated B and C), and
attention with and without RoPE.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from runtime_helpers import tiny_blueprint
from torch.distributed.device_mesh import DeviceMesh

import factory
from factory.distributed.local import run_ranks
from factory.distributed.parallelize import apply_context_parallel
from factory.graph.loss import language_model_loss
from factory.nn.packed_documents import document_ids_from_cu_seqlens
from factory.nn.sequence_split import chunk_positions
from factory.schemas.blueprint import Blueprint

WORLD, SEQ, TIMEOUT = 2, 64, 240
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
VARIANTS = {
    "groups=cp": {},
    "groups<cp, rope": {
        "mamba": {"groups": 1},
        "position_embedding": "rope",
        "rope_base": 10000.0,
    },
}


def _blueprint(variant: str) -> Blueprint:
    data = tiny_blueprint().model_dump(exclude_unset=True)
    for key, value in VARIANTS[variant].items():
        if isinstance(value, dict):
            data["model"].setdefault(key, {}).update(value)
        else:
            data["model"][key] = value
    return Blueprint.model_validate(data)


def _batch(bp: Blueprint) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, bp.model.vocab_size, (2, SEQ), generator=gen)
    # Chunks are 16 long: documents start inside chunks and run across their ends.
    docs = document_ids_from_cu_seqlens([[0, 13, 40, SEQ], [0, 30, SEQ]], SEQ)
    mask = torch.rand(2, SEQ, generator=gen) > 0.2
    return ids, docs, mask


def _step(model: torch.nn.Module, bp: Blueprint) -> torch.Tensor:
    """The token losses (LM, then each MTP depth) of one batch, backward done."""
    ids, docs, mask = _batch(bp)
    losses = language_model_loss(model(ids, docs), ids, mask, 0.3, docs)
    (losses.lm + sum(losses.mtp)).backward()
    return torch.stack([losses.lm.detach(), *(m.detach() for m in losses.mtp)])


def _worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for variant in VARIANTS:
        bp = _blueprint(variant)
        model = factory.compile(bp, seed=0, precision="off").model
        apply_context_parallel(model, DeviceMesh("cpu", list(range(world))))
        losses = _step(model, bp)
        dist.all_reduce(losses)
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                grads[name] = param.grad
        out[variant] = (losses, grads)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, WORLD, timeout=TIMEOUT)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_context_parallel_losses_and_gradients_equal_one_process(
    ranks: list[dict[str, Any]], variant: str
) -> None:
    bp = _blueprint(variant)
    reference = factory.compile(bp, seed=0, precision="off").model
    want = _step(reference, bp)
    for result in ranks:
        losses, grads = result[variant]
        torch.testing.assert_close(losses, want, rtol=LOSS_TOL, atol=0)
        assert grads.keys() == {n for n, p in reference.named_parameters() if p.grad is not None}
        for name, param in reference.named_parameters():
            if param.grad is None:
                continue
            scale = max(param.grad.abs().max().item(), 1e-12)
            assert (grads[name] - param.grad).abs().max().item() <= GRAD_TOL * scale, name


def test_ranks_hold_a_head_and_a_tail_chunk() -> None:
    assert chunk_positions(8, 2, 0) == (0, 1, 6, 7)
    assert chunk_positions(8, 2, 1) == (2, 3, 4, 5)
    with pytest.raises(ValueError, match="2 \\* cp = 4"):
        chunk_positions(10, 2, 0)
