"""Pipeline parallelism on 2 gloo ranks against one process (``factory.runtime.pipeline_schedule``).

Each rank builds the tiny Super proxy (seed 0) twice: once whole, running
:func:`factory.runtime.step.forward_backward` as the single-process reference,
and once split at the pattern's ``|`` cuts into this rank's stages, run by a
:class:`PipelineRunner`. The step's loss and statistics and every gradient the
rank holds must match the reference's gradient of the same name. Workers
return differences; the assertions run here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime_helpers import tiny_blueprint

import factory
from factory.distributed.local import run_ranks
from factory.distributed.mesh import build_meshes
from factory.distributed.pipeline_stages import split_stages
from factory.planner.layout import resolve_layout
from factory.runtime.batches import MicroBatch
from factory.runtime.pipeline_schedule import PipelineRunner, check_microbatch_count
from factory.runtime.step import forward_backward
from factory.schemas.blueprint import Blueprint
from factory.schemas.training import LossAverage

WORLD, MICRO, SEQ, COUNT, TIMEOUT = 2, 2, 64, 4, 120
TOL = 1e-5
ONE_F_ONE_B = "ME|M*E"
INTERLEAVED = "ME|M*|E|ME"


def _blueprint(pattern: str, tie: bool = False, mtp: bool = True) -> Blueprint:
    moe = tiny_blueprint().model.moe.model_dump()
    # A large aux coefficient, so a wrongly scaled aux gradient shows far above the tolerance.
    moe["router"]["aux_loss_coeff"] = 0.1
    model: dict[str, Any] = {"pattern": pattern, "moe": moe, "tie_embeddings": tie}
    if not mtp:
        model["mtp"] = None
    parallelism = {"pp": WORLD, "world_size": WORLD, "global_batch_size": MICRO * COUNT}
    return tiny_blueprint(model=model, parallelism=parallelism)


def _micro_batches(vocab: int) -> list[MicroBatch]:
    """Random tokens, two documents per row, and target counts that differ per micro-batch
    (a long prompt in one of them), so the token weighting matters."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(COUNT):
        ids = torch.randint(0, vocab, (MICRO, SEQ), generator=gen)
        mask = torch.ones(MICRO, SEQ, dtype=torch.bool)
        mask[:, : 8 + 16 * i] = False
        cut = torch.randint(8, SEQ - 8, (MICRO, 1), generator=gen)
        docs = (torch.arange(SEQ) >= cut).long()
        batches.append(MicroBatch(ids, mask, docs))
    return batches


def _scale(ref: torch.Tensor) -> float:
    """Gradients compare relative to their size (at least 1): the head's and the embedding's
    sum many terms, in another order on two ranks than on one."""
    return max(1.0, ref.abs().max().item())


def _norm_sq(params: list[torch.nn.Parameter]) -> float:
    return sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None)


def _case(
    rank: int, pattern: str, tie: bool, mtp: bool, average: LossAverage = "token"
) -> dict[str, Any]:
    """One step of ``pattern`` split over the ranks, against the whole model on this rank,
    with the loss ``average`` of ``training.objective``."""
    bp = _blueprint(pattern, tie, mtp)
    layout = resolve_layout(bp)
    mtp_scale = bp.model.mtp.loss_scale if mtp else 0.0
    micro = _micro_batches(bp.model.vocab_size)
    reference = factory.compile(bp, precision="off", seed=0).model
    expected = forward_backward(reference, micro, mtp_scale, loss_average=average)
    by_name = reference.state_dict(keep_vars=True)

    stages = split_stages(factory.compile(bp, precision="off", seed=0).model, layout, rank)
    runner = PipelineRunner(stages, layout, build_meshes(layout, "cpu").dense["pp"], mtp_scale)
    got = runner.step(micro, loss_average=average)

    grads = {}
    for name, param in runner.named_parameters().items():
        ref = by_name[name].grad
        if ref is None or param.grad is None:  # no gradient (the expert bias): on neither
            grads[name] = 0.0 if ref is None and param.grad is None else float("inf")
        else:
            grads[name] = (param.grad - ref).abs().max().item() / _scale(ref)
    norm_sq = _norm_sq(runner.parameters_for_norm())
    ref_norm_sq = _norm_sq(list(reference.parameters()))
    embedding = [s.shared_embedding for s in stages if s.shared_embedding is not None]
    runner.update_expert_biases(got.tokens_per_expert)
    reference.update_expert_biases(expected.tokens_per_expert)
    biases = {
        name: (param - by_name[name]).abs().max().item()
        for name, param in runner.named_parameters().items()
        if name.endswith("e_score_correction_bias")
    }
    return {
        "biases": biases,
        "keys": [key for stage in stages for key in stage.state_dict()],
        "full_keys": list(by_name),
        "grads": grads,
        "loss": (got.loss, expected.loss),
        "lm_loss": (got.lm_loss, expected.lm_loss),
        "tokens": (got.tokens, expected.tokens),
        "tokens_per_expert": (got.tokens_per_expert, expected.tokens_per_expert),
        "rms": (got.residual_rms, expected.residual_rms),
        "norm_sq": (norm_sq, ref_norm_sq),
        "embedding_grad": embedding[0].grad.clone() if embedding else None,
    }


CASES = {
    "1f1b_mtp": (ONE_F_ONE_B, False, True),
    "interleaved_tied": (INTERLEAVED, True, False),
    "1f1b_mtp_per_conversation": (ONE_F_ONE_B, False, True, "conversation"),
}


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    # Both cases in one launch: starting the processes (importing torch) costs more than a case.
    return {name: _case(rank, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def pipelined() -> dict[str, list[dict[str, Any]]]:
    results = run_ranks(_worker, WORLD, timeout=TIMEOUT)
    return {name: [r[name] for r in results] for name in CASES}


def _check_equivalence(results: list[dict[str, Any]], copies: set[str]) -> None:
    full = set(results[0]["full_keys"])
    held = [set(r["keys"]) for r in results]
    assert set.union(*held) == full
    assert set.intersection(*held) == copies  # the stages partition the model, but for copies
    compared = set().union(*(r["grads"] for r in results))
    for r in results:
        worst = max(r["grads"].items(), key=lambda item: item[1])
        assert worst[1] < TOL, worst
    pipeline_norm_sq = sum(r["norm_sq"][0] for r in results)
    assert pipeline_norm_sq == pytest.approx(results[0]["norm_sq"][1], rel=TOL)
    for key in ("loss", "lm_loss"):
        got, expected = results[0][key]
        assert got == pytest.approx(expected, rel=TOL), key
        assert [r[key] for r in results] == [results[0][key]] * WORLD  # the same on every rank
    assert results[0]["tokens"][0] == results[0]["tokens"][1]
    got, expected = results[0]["tokens_per_expert"]
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    got, expected = results[0]["rms"]
    assert list(got) == list(expected)
    assert got == pytest.approx(expected, rel=TOL)
    assert compared == full  # every parameter's gradient was compared on some rank
    biases = {name: diff for r in results for name, diff in r["biases"].items()}
    assert len(biases) == len(results[0]["tokens_per_expert"][1])  # every MoE layer's bias
    assert max(biases.values()) < TOL


def test_1f1b_matches_one_process_with_mtp(pipelined: dict[str, list[dict[str, Any]]]) -> None:
    results = pipelined["1f1b_mtp"]
    _check_equivalence(results, {"backbone.embeddings.weight"})
    first, last = (r["embedding_grad"] for r in results)
    assert torch.equal(first, last)  # the last stage's copy stays bitwise equal


def test_per_conversation_average_matches_one_process(
    pipelined: dict[str, list[dict[str, Any]]],
) -> None:
    """The last stage weighs each micro-batch by its share of the step's documents, as
    ``forward_backward`` does; each row's two documents make the average differ from the
    token one."""
    results = pipelined["1f1b_mtp_per_conversation"]
    _check_equivalence(results, {"backbone.embeddings.weight"})
    token = pipelined["1f1b_mtp"][0]["lm_loss"][1]
    assert results[0]["lm_loss"][1] != pytest.approx(token, rel=1e-4)


def test_interleaved_matches_one_process_with_tied_head(
    pipelined: dict[str, list[dict[str, Any]]],
) -> None:
    results = pipelined["interleaved_tied"]
    _check_equivalence(results, set())
    first, last = (r["embedding_grad"] for r in results)
    assert torch.equal(first, last)


def test_mtp_aux_loss_survives_rebuilt_arguments() -> None:
    """FSDP2's pre-forward hook rebuilds every argument container that holds a tensor
    requiring grad; the last stage must still count the MTP blocks' aux losses."""
    bp = _blueprint(ONE_F_ONE_B)
    layout = resolve_layout(bp)

    def rebuild(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        def holds_grad(a: Any) -> bool:
            return isinstance(a, list) and any(t.requires_grad for t in a)

        return tuple(list(a) if holds_grad(a) else a for a in args)

    hidden = torch.randn(MICRO, SEQ, bp.model.hidden_size, requires_grad=True)
    ids = _micro_batches(bp.model.vocab_size)[0].input_ids
    totals = []
    for hook in (False, True):
        model = factory.compile(bp, precision="off", seed=0).model
        (last,) = split_stages(model, layout, 1)
        if hook:
            last.mtp.register_forward_pre_hook(rebuild)
        last(hidden, input_ids=ids)
        totals.append(last.records[-1].aux_loss)
    # One main-stack MoE layer and one MoE block per MTP depth.
    assert bp.model.mtp_depth == 2
    assert torch.equal(totals[0], totals[1])
    assert totals[0] > 2.5 * bp.model.moe.router.aux_loss_coeff


def test_refusals() -> None:
    layout = resolve_layout(_blueprint(INTERLEAVED))
    with pytest.raises(ValueError, match="at least pp = 2"):
        check_microbatch_count(layout, 1)
    with pytest.raises(ValueError, match="multiple of pp = 2"):
        check_microbatch_count(layout, 3)
    check_microbatch_count(layout, 6)
    other = resolve_layout(_blueprint(ONE_F_ONE_B))
    model = factory.compile(_blueprint(INTERLEAVED), device="meta").model
    with pytest.raises(ValueError, match="hold 5 layers but the model has 7"):
        split_stages(model, other, 0)
    with pytest.raises(ValueError, match="outside the layout's 2 pipeline ranks"):
        split_stages(model, layout, 2)
    shifted = resolve_layout(_blueprint("EMM*|E|M|E"))
    with pytest.raises(ValueError, match="the layout is not this model's"):
        split_stages(model, shifted, 0)
    single = resolve_layout(tiny_blueprint())
    with pytest.raises(ValueError, match="needs pp >= 2"):
        PipelineRunner([], single, None, 0.0)  # type: ignore[arg-type]
