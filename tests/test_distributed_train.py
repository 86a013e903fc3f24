"""Training on several gloo processes gives the one-process run's losses and weights.

Each layout trains the tiny blueprint (``runtime_helpers``) for a few steps on
the same shards with precision off (fp32), then compares the loss curve and
the final weights (``model/model.safetensors``, read back from the run's DCP
checkpoint) with a one-process run. Tolerance: the ranks sum gradients in
another order than one process does, so values agree to float32 rounding
amplified by a few Adam steps: losses within 1e-5 relative, weights within
1e-3 of the largest entry of each tensor. The learning rate is 1e-3: at 1e-2 the
four steps amplify rounding chaotically (TP=2 + SP ended 16 of lm_head's 262,144
entries past 1e-3, DP=2 two; at 1e-3 the largest difference of any
layout is 2.8e-4, docs/distributed.md). Every sample is cut into several documents
that cross the CP chunk boundaries (DOCUMENT_CUTS).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import GLOBAL, tiny_blueprint
from safetensors.torch import load_file

import factory
from factory.data.build_job import build
from factory.data.loaded_recipe import load_recipe
from factory.data.shards.manifest import read_manifest, write_manifest
from factory.data.shards.sample_format import PackedSample
from factory.data.shards.shard_reader import list_shards, read_shard_samples
from factory.data.shards.tar_writer import write_shard
from factory.distributed.local import run_ranks
from factory.runtime.loader import ShardLoader
from factory.schemas.blueprint import Blueprint

STEPS = 4
LOSS_RTOL, WEIGHT_TOL = 1e-5, 1e-3


_TP = {"tp": 2, "sequence_parallel": True, "etp": 1}


def _blueprint(world: int, average: str = "token", **parallelism: Any) -> Blueprint:
    """The tiny blueprint on ``world`` ranks; its pattern has a pipeline cut (one segment per
    rank with pp=2, the whole stack otherwise). No aux loss: with sequence parallelism each TP
    rank's aux loss would see half of each sequence (docs/distributed.md, 'What differs').
    ``average``: the objective's loss average (``conversation``: an sft objective)."""
    objective = {"kind": "sft", "loss_average": average} if average == "conversation" else {}
    bp = tiny_blueprint(
        parallelism={"world_size": world, "global_batch_size": 2 * GLOBAL, **parallelism},
        training={
            "steps": STEPS,
            "checkpoint_interval": 2,
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
            "objective": objective,
        },
    )
    data = bp.model_dump(exclude_unset=True)
    # The same five layers, cut into one pipeline segment per (virtual) stage.
    stages = parallelism.get("pp", 1) * parallelism.get("vpp", 1)
    data["model"]["pattern"] = {1: "MEM*E", 2: "ME|M*E", 4: "M|E|M*|E"}[stages]
    data["model"]["moe"].setdefault("router", {})["aux_loss"] = "none"
    return Blueprint.model_validate(data)


def _train(bp: Blueprint, out: Path, data: Path, precision: str = "off") -> dict[str, Any]:
    factory.train(bp, out=out, data=data, precision=precision, seed=0)  # type: ignore[arg-type]
    return json.loads((out / "train.json").read_text()) if (out / "train.json").is_file() else {}


def _train_rank(
    rank: int, world: int, bp: Blueprint, out: Path, data: Path, precision: str = "off"
) -> Any:
    return _train(bp, out, data, precision)


DOCUMENT_CUTS = (13, 40)
"""Extra document boundaries in every sample: with CP=2 a sequence of 64 is cut into four
chunks of 16, so the documents [13, 40) and [40, 64) run across chunk (and rank) ends."""


def _cut_into_documents(folder: Path) -> Path:
    """Give every sample of the built ``folder`` the boundaries DOCUMENT_CUTS too (rewriting
    its shards and their manifest entries). At 64 tokens the sample corpus packs one piece of
    one document per sequence, which would leave the document masking untested."""
    manifest = read_manifest(folder)
    for index, (entry, shard) in enumerate(
        zip(manifest["shards"], list_shards(folder), strict=True)
    ):
        samples = []
        for sample in read_shard_samples(shard):
            ends = sorted({*sample.cu_seqlens.tolist(), *DOCUMENT_CUTS} - {0})
            ends = [end for end in ends if end <= sample.cu_seqlens[-1]]
            samples.append(
                PackedSample(
                    tokens=sample.tokens.copy(),
                    loss_mask=sample.loss_mask.copy(),
                    cu_seqlens=np.array([0, *ends], dtype=np.int32),
                    doc_keys=[f"piece-{i}" for i in range(len(ends))],
                )
            )
        entry["sha256"] = write_shard(shard.path, samples, index)
    write_manifest(folder, manifest)
    return folder


@pytest.fixture(scope="module")
def whole_documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus as built, with nothing held out (the data these layouts' tolerances
    were set on): one piece of one document per 64-token sequence. With the recipe's
    held-out split the batches change, and after 4 steps a few elements of a rarely routed
    expert differ by more than WEIGHT_TOL under TP and CP (Adam's step is as large for a
    gradient of rounding noise as for a real one); the losses still agree."""
    loaded = load_recipe(_blueprint(1).data.recipe)
    sources = [s.model_copy(update={"heldout": None}) for s in loaded.recipe.sources]
    recipe = loaded.recipe.model_copy(update={"heldout": None, "sources": sources})
    out = tmp_path_factory.mktemp("dist-data")
    build(dataclasses.replace(loaded, recipe=recipe), out, seq_len=_blueprint(1).data.seq_len)
    return out


@pytest.fixture(scope="module")
def shards(whole_documents: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dist-documents") / "data"
    return _cut_into_documents(Path(shutil.copytree(whole_documents, folder)))


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one-process")
    _train(_blueprint(1), out, shards)
    return out


@pytest.fixture(scope="module")
def reference_per_conversation(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one-process-per-conversation")
    _train(_blueprint(1, "conversation"), out, shards)
    return out


def _compare(run: Path, reference: Path, outlier_share: float = 0.0) -> None:
    """The run's steps have the reference's losses, and its final weights are the reference's:
    each tensor within WEIGHT_TOL but for ``outlier_share`` of its elements, each of those
    within the distance Adam can move a weight in STEPS steps."""
    ours = json.loads((run / "train.json").read_text())["records"]
    theirs = {r["step"]: r for r in json.loads((reference / "train.json").read_text())["records"]}
    assert [r["step"] for r in ours] == sorted(theirs)[-len(ours) :]
    for a in ours:
        b = theirs[a["step"]]
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=LOSS_RTOL)
        assert a["tokens_seen"] == b["tokens_seen"]
    got = load_file(run / "model" / "model.safetensors")
    want = load_file(reference / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    lr = _blueprint(1).training.optimizer.lr
    for name, tensor in want.items():
        scale = max(tensor.abs().max().item(), 1e-6)
        apart = (got[name] - tensor).abs()
        allowed = int(outlier_share * tensor.numel())
        assert int((apart > WEIGHT_TOL * scale).sum()) <= allowed, name
        assert apart.max().item() <= STEPS * lr, name


@pytest.mark.parametrize(
    ("world", "parallelism"),
    [
        pytest.param(2, {}, id="dp2-fsdp"),
        pytest.param(2, {"distributed_optimizer": False}, id="dp2-ddp"),
        pytest.param(2, {"ep": 2}, id="ep2"),
        pytest.param(2, _TP, id="tp2-sp"),
        pytest.param(2, {"etp": 2}, id="etp2"),
        # ETP defaults to TP: each expert's ffn split over the TP group, which routes by SP.
        pytest.param(2, {"tp": 2, "sequence_parallel": True}, id="tp2-sp-etp2"),
        pytest.param(2, {"pp": 2}, id="pp2-1f1b"),
        pytest.param(2, {"pp": 2, "vpp": 2}, id="pp2-interleaved"),
        pytest.param(2, {"cp": 2}, id="cp2"),
        pytest.param(4, {"cp": 2, **_TP}, id="cp2-tp2-sp"),
        pytest.param(4, {"cp": 2, "ep": 2}, id="cp2-ep2"),
    ],
)
def test_a_layout_trains_as_one_process_does(
    world: int, parallelism: dict[str, Any], shards: Path, reference: Path, tmp_path: Path
) -> None:
    bp = _blueprint(world, **parallelism)
    run_ranks(_train_rank, world, bp, tmp_path, shards, timeout=240)
    _compare(tmp_path, reference)
    assert (tmp_path / "ranks" / "rank_00001.jsonl").is_file()


@pytest.mark.parametrize(
    "parallelism",
    [
        pytest.param({}, id="dp2-fsdp"),
        pytest.param({"pp": 2}, id="pp2-1f1b"),
        pytest.param({"cp": 2}, id="cp2"),
    ],
)
def test_the_per_conversation_average_trains_as_one_process_does(
    parallelism: dict[str, Any],
    shards: Path,
    reference: Path,
    reference_per_conversation: Path,
    tmp_path: Path,
) -> None:
    """Each micro-batch's and each CP rank's share is over the step's documents, so DP, PP
    and CP train as one process does under the per-conversation average too (MTP included:
    the tiny blueprint has it); the documents cut at DOCUMENT_CUTS make it differ from the
    token average."""
    bp = _blueprint(2, "conversation", **parallelism)
    run_ranks(_train_rank, 2, bp, tmp_path, shards, timeout=240)
    _compare(tmp_path, reference_per_conversation)
    token, per_conversation = (
        json.loads((run / "train.json").read_text())["records"][0]["lm_loss"]
        for run in (reference, reference_per_conversation)
    )
    # Near the uniform loss at initialisation the averages differ by ~3e-5: twice the
    # tolerance the comparison above holds the runs to, so it tells the two apart.
    assert per_conversation != pytest.approx(token, rel=2 * LOSS_RTOL)


@pytest.mark.parametrize(
    ("four", "resumes"),
    [
        pytest.param({"ep": 2}, [(2, {"ep": 2}), (1, {})], id="dp2xep2"),
        pytest.param({"ep": 2, "etp": 2}, [(2, {"etp": 2}), (1, {})], id="ep2xetp2"),
        pytest.param({**_TP, "ep": 2}, [(2, {"cp": 2}), (1, {})], id="tp2xep2xetp2"),
    ],
)
def test_a_checkpoint_of_4_ranks_resumes_on_2_and_on_1(
    four: dict[str, Any],
    resumes: list[tuple[int, dict[str, Any]]],
    shards: Path,
    reference: Path,
    tmp_path: Path,
) -> None:
    """A layout of 4 ranks trains as one process does; its step-2 checkpoint (DCP, sharded 4
    ways) resumes on 2 ranks of another layout and on one process, and the losses and the
    final weights continue as the uninterrupted one-process run's. DP=2 x EP=2 folded resumes
    on EP=2; DP=4 with the experts at EP=2 x ETP=2 (each expert's ffn split in two) resumes
    on ETP=2 alone (every expert on both ranks, half its ffn on each); TP=2 x DP=2 with the
    experts at EP=2 x ETP=2 resumes without tensor parallelism (CP=2, then one process): the
    weights, moments and masters of Mamba's packed projections, rank-major under TP, are
    stored in canonical order."""
    run_four = tmp_path / "four"
    run_ranks(_train_rank, 4, _blueprint(4, **four), run_four, shards, timeout=300)
    _compare(run_four, reference)
    for world, parallelism in resumes:
        run = tmp_path / f"resumed-on-{world}"
        shutil.copytree(run_four, run)
        shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
        shutil.rmtree(run / "model")
        (run / "train.json").unlink()
        bp = _blueprint(world, **parallelism)
        if world > 1:
            run_ranks(_train_rank, world, bp, run, shards, timeout=240)
        else:
            _train(bp, run, shards)
        records = json.loads((run / "train.json").read_text())["records"]
        assert [r["step"] for r in records] == list(range(2, STEPS))
        _compare(run, reference)


def test_a_checkpoint_written_under_context_parallelism_resumes_on_one_process(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """CP=2 splits every sequence between two ranks but not the weights: its step-2
    checkpoint (DCP, FSDP2 over the data- and context-parallel ranks) resumes on one process
    and continues with the uninterrupted one-process run's losses and ends with its
    weights."""
    two = tmp_path / "two"
    run_ranks(_train_rank, 2, _blueprint(2, cp=2), two, shards, timeout=240)
    one = tmp_path / "resumed-on-one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "checkpoints" / f"step_{STEPS:08d}")
    shutil.rmtree(one / "model")
    (one / "train.json").unlink()
    _train(_blueprint(1), one, shards)
    records = json.loads((one / "train.json").read_text())["records"]
    assert [r["step"] for r in records] == list(range(2, STEPS))
    _compare(one, reference)


def test_the_packed_documents_straddle_the_context_parallel_chunks(shards: Path) -> None:
    """The CP runs above test the document masking across the split: the sequences they
    train on hold documents that run on from one CP=2 chunk into the next (another rank's)."""
    seq_len = _blueprint(1).data.seq_len
    chunk = seq_len // 4  # CP=2 cuts every sequence into 2 * cp chunks
    crossing = 0
    with ShardLoader(shards, 2, shuffle=False) as loader:
        for _, batch in zip(range(4), loader, strict=False):
            assert batch.document_ids is not None
            ids = batch.document_ids
            crossing += int((ids[:, chunk - 1 :: chunk][:, :3] == ids[:, chunk::chunk]).sum())
            assert int(ids[:, -1].min()) > 0, "a sequence holds one document only"
    assert crossing > 0


def test_the_precision_policy_recasts_weights_every_step_under_fsdp2(
    shards: Path, tmp_path: Path
) -> None:
    """FSDP2 gathers each step's weights into the same tensor without moving its version, so
    the emulated NVFP4 policy's per-step weight cast must be dropped by the loop, not by the
    version check: PP=2 (FSDP2 on each stage) with the policy gives the one-process losses.
    (PP runs every micro-batch of a layer on one rank in order, so even the stochastic
    rounding draws are the one-process run's; later steps drift by NVFP4 rounding flips of
    last-bit differences, 1e-4 measured. With stale casts step 1 is off by 1.5e-2.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(_blueprint(1), one, shards, "emulate")
    run_ranks(_train_rank, 2, _blueprint(2, pp=2), two, shards, "emulate", timeout=240)
    want = json.loads((one / "train.json").read_text())["records"]
    got = json.loads((two / "train.json").read_text())["records"]
    losses, expected = [r["lm_loss"] for r in got], [r["lm_loss"] for r in want]
    assert losses[:2] == pytest.approx(expected[:2], rel=1e-6)
    assert losses == pytest.approx(expected, rel=1e-3)


def _nvfp4_blueprint(world: int, steps: int, routed_bf16: bool, **parallelism: Any) -> Blueprint:
    """The tiny blueprint with its NVFP4 policy, widened so that TP=2 splits whole NVFP4 blocks
    (``precision.tp_blocks``): 32 Mamba heads (16 dt rows per rank) and a shared expert of 96
    (48 per rank). ``routed_bf16``: the routed experts in BF16 as well."""
    data = _blueprint(world, **parallelism).model_dump(exclude_unset=True)
    data["model"]["mamba"]["heads"] = 32
    data["model"]["moe"]["shared_expert_intermediate_size"] = 96
    data["training"]["steps"] = steps
    if routed_bf16:
        data["precision"]["overrides"]["*.mixer.experts.*"] = "bf16"
    return Blueprint.model_validate(data)


def test_tensor_parallel_with_the_nvfp4_policy_takes_one_process_step(
    whole_documents: Path, tmp_path: Path
) -> None:
    """TP=2 + SP with the emulated NVFP4 policy (16x16 weights, Hadamard, stochastic rounding):
    every split quantized operand is one process's (tests/test_distributed_tp_quantized.py), so
    one optimizer step gives the one-process loss and weights. Rounding differences in the
    activations (row-parallel sums in another order) can flip an element's NVFP4 code, so more
    gradients than in fp32 move apart at Adam's eps scale: up to 1e-3 of a tensor's elements may
    pass WEIGHT_TOL, each within Adam's bound (measured: loss equal; 3 of in_proj's 71,680 and 2
    of the shared expert's 6,144 elements, at most 0.2 lr apart). This runs on the corpus as
    built (one document per sequence), where the forward happens to flip no code: on the cut
    documents of the other tests one flip in the first layer cascades (the loss 1.1e-7 apart,
    up to 2% of a tensor's elements past WEIGHT_TOL, each within 0.2 lr), the statistical regime
    of the next test. The routed experts are BF16 here: each TP rank quantizes its own tokens
    for them (next test)."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(_nvfp4_blueprint(1, 1, routed_bf16=True), one, whole_documents, "emulate")
    bp = _nvfp4_blueprint(2, 1, routed_bf16=True, **_TP)
    run_ranks(_train_rank, 2, bp, two, whole_documents, "emulate", timeout=240)
    _compare(two, one, outlier_share=1e-3)


def test_tensor_parallel_with_the_whole_nvfp4_policy_stays_with_one_process(
    shards: Path, tmp_path: Path
) -> None:
    """The whole policy, routed experts in NVFP4 too: each TP rank routes its own tokens to
    whole experts, so their GEMMs quantize per rank (amax, 16-token wgrad blocks, stochastic
    rounding), as under data parallelism, and the step is one process's only statistically.
    The first step's loss, before any update, agrees to 1e-6 (measured 1.1e-7), all four to
    1e-3 (measured 5.4e-5, 1.3e-4 and 8.8e-5 for the next three); the weights are not
    compared: from the second step on, last-bit differences flip NVFP4 codes and discrete
    expert-bias moves,
    and Adam turns those into lr-sized steps (PP=2 with the policy, which draws one process's
    random numbers, ends 0.5 of the expert bias's largest entry apart as well)."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(_nvfp4_blueprint(1, STEPS, routed_bf16=False), one, shards, "emulate")
    bp = _nvfp4_blueprint(2, STEPS, routed_bf16=False, **_TP)
    run_ranks(_train_rank, 2, bp, two, shards, "emulate", timeout=240)
    want = json.loads((one / "train.json").read_text())["records"]
    got = json.loads((two / "train.json").read_text())["records"]
    losses, expected = [r["lm_loss"] for r in got], [r["lm_loss"] for r in want]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses == pytest.approx(expected, rel=1e-3)
