"""Memory per rank: Megatron's weight/optimizer accounting on a Mixtral-8x7B check,
parameter placement over pipeline ranks, and activation scaling properties."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.planner.layout import resolve_layout
from factory.planner.memory import MemoryPlan, memory_per_rank
from factory.planner.params import count_params
from factory.schemas.blueprint import Blueprint

MIXTRAL = {
    "pattern": "*E" * 32,
    "hidden_size": 4096,
    "vocab_size": 32000,
    "max_seq_len": 32768,
    "attention": {"heads": 32, "kv_heads": 8, "head_dim": 128},
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "expert_intermediate_size": 14336,
        "activation": "swiglu",
        "router": {"score_function": "softmax", "expert_bias": False},
    },
}

TINY = {
    "pattern": "M*-E" * 4,
    "hidden_size": 256,
    "vocab_size": 1024,
    "max_seq_len": 8192,
    "attention": {"heads": 8, "kv_heads": 2, "head_dim": 32},
    "mamba": {"heads": 8, "head_dim": 32},
    "mlp": {"intermediate_size": 512},
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "expert_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "latent_size": 64,
    },
}


def blueprint(
    model: dict, seq_len: int = 4096, precision: dict | None = None, **parallelism: object
) -> Blueprint:
    par = {"world_size": 8, "global_batch_size": 64, **parallelism}
    return Blueprint.model_validate(
        {
            "meta": {"name": "test"},
            "model": model,
            "precision": precision or {},
            "parallelism": par,
            "data": {"recipe": "test", "seq_len": seq_len, "tokens": "1B"},
            "training": {"optimizer": {"lr": 1e-4}, "steps": 10},
        }
    )


def plan(
    model: dict, seq_len: int = 4096, precision: dict | None = None, **parallelism: object
) -> MemoryPlan:
    bp = blueprint(model, seq_len, precision, **parallelism)
    return memory_per_rank(bp, resolve_layout(bp))


def per_layer(model: dict, precision: dict | None = None, **parallelism: object) -> dict[str, int]:
    return plan(model, precision=precision, **parallelism).activations.per_layer_type


# --------------------------------------------------------------------------- Mixtral check


def _megatron_most_loaded_shard() -> tuple[float, float]:
    """Megatron-LM's compute_weight_and_optimizer_memory (theoretical_memory_usage.py) for
    Mixtral-8x7B, TP1 PP4 EP8 ETP1: (TP-sharded + embedding, replicated) and expert params
    on stage 0."""
    h, layers, a, g, kv, ffn, experts, vocab = 4096, 32, 32, 8, 128, 14336, 8, 32000
    tp, pp, ep, etp = 1, 4, 8, 1
    self_attn = 2 * h * h * ((1 + g / a) * (kv * a / h))
    routed = 2 * h * ffn * experts * 3 / 2
    norms, router = 2 * h, h * experts
    dense = (layers * self_attn / pp + h * vocab) / tp
    replicated = layers * (norms + router) / pp
    expert = layers * routed / pp / (etp * ep)
    return dense + replicated, expert


def test_mixtral_most_loaded_shard_matches_megatron() -> None:
    """``docs/memory.md``, 'Model state': DP=8, EDP=1, 1.876B params on the most loaded shard."""
    result = plan(MIXTRAL, world_size=32, pp=4, ep=8, global_batch_size=256)
    layout = resolve_layout(blueprint(MIXTRAL, world_size=32, pp=4, ep=8, global_batch_size=256))
    assert (layout.dp, layout.edp) == (8, 1)
    non_expert, expert = _megatron_most_loaded_shard()
    first = result.per_rank[0].params_on_rank
    assert first.dense + first.replicated == non_expert
    assert first.expert == expert
    assert f"{first.total:.4g}" == "1.876e+09"


def test_mixtral_weights_and_optimizer_match_megatron() -> None:
    """Megatron: (dense + replicated) * (6 + 12/DP) + expert * (6 + 12/EDP) bytes.

    That is 28,869,230,592 bytes. Megatron prints it in MB of 2**20 bytes (27,531.8 MB), which
    reads as "27.5 GB"; it is 28.87 GB decimal or 26.89 GiB. Without the distributed
    optimizer every parameter costs 18 bytes.
    """
    result = plan(MIXTRAL, world_size=32, pp=4, ep=8, global_batch_size=256)
    non_expert, expert = _megatron_most_loaded_shard()
    megatron = non_expert * (6 + 12 / 8) + expert * (6 + 12 / 1)
    state = result.per_rank[0].weights_grads_optimizer
    assert state["distributed_optimizer"] == megatron == 28_869_230_592
    assert round(state["distributed_optimizer"] / 2**20 / 1000, 1) == 27.5
    assert state["no_distributed_optimizer"] == 18 * result.per_rank[0].params_on_rank.total


def test_mixtral_last_rank_holds_head_and_final_norm() -> None:
    result = plan(MIXTRAL, world_size=32, pp=4, ep=8, global_batch_size=256)
    first, middle, last = (result.per_rank[r].params_on_rank for r in (0, 1, 3))
    assert first.dense - middle.dense == 4096 * 32000  # embedding
    assert last.dense - middle.dense == 4096 * 32000  # untied head
    assert last.replicated - middle.replicated == 4096  # final norm
    assert result.peak_rank == 0  # four micro-batches in flight outweigh the head
    assert result.total == max(rank.total for rank in result.per_rank)


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("mtp", [None, {"depth": 2, "pattern": "*E", "repeated": True}])
def test_ranks_hold_every_parameter_once(pp: int, tie: bool, mtp: dict | None) -> None:
    """Unsharded (TP=EP=1), the ranks sum to count_params, plus the last rank's embedding copy:
    Megatron's tied head copy, or the copy MTP needs to embed the shifted tokens."""
    model = {**TINY, "tie_embeddings": tie, "mtp": mtp}
    result = plan(model, world_size=pp, pp=pp, global_batch_size=8)
    counted = count_params(blueprint(model).model)
    copies = int(pp > 1 and (tie or mtp is not None))
    held = sum(rank.params_on_rank.total for rank in result.per_rank)
    assert held == counted.total + copies * 1024 * 256
    if mtp:
        assert result.per_rank[-1].params_on_rank.total >= counted.mtp


def test_tp_shards_dense_and_ep_shards_experts() -> None:
    base = plan(TINY, world_size=8).per_rank[0].params_on_rank
    tp2 = plan(TINY, world_size=8, tp=2, etp=1).per_rank[0].params_on_rank
    ep4 = plan(TINY, world_size=8, ep=4).per_rank[0].params_on_rank
    assert (tp2.dense * 2, tp2.replicated, tp2.expert) == (base.dense, base.replicated, base.expert)
    assert (ep4.dense, ep4.replicated, ep4.expert * 4) == (base.dense, base.replicated, base.expert)


def test_distributed_optimizer_shards_over_dp_times_cp() -> None:
    """Megatron's estimator divides by DP only; the dp_cp group really shards dense state, so
    trading DP for CP at a fixed world size leaves the dense optimizer shard unchanged."""
    dense_only = {k: v for k, v in TINY.items() if k != "moe"} | {"pattern": "M*-" * 4}
    cp1 = plan(dense_only, world_size=8).per_rank[0]
    cp2 = plan(dense_only, world_size=8, cp=2).per_rank[0]
    assert cp1.optimizer == cp2.optimizer
    params = cp1.params_on_rank.total
    assert cp1.optimizer["distributed_optimizer"] == math.ceil(12 * params / 8)
    two = plan(dense_only, world_size=8, distributed_optimizer_instances=2).per_rank[0]
    assert two.optimizer["distributed_optimizer"] == math.ceil(12 * params / 4)


def test_total_follows_the_blueprints_optimizer_choice() -> None:
    for dist_opt in (True, False):
        result = plan(TINY, world_size=8, distributed_optimizer=dist_opt)
        key = "distributed_optimizer" if dist_opt else "no_distributed_optimizer"
        peak = result.per_rank[result.peak_rank]
        assert peak.total == peak.weights_grads_optimizer[key] + peak.activations.total
        assert peak.weights == 2 * peak.params_on_rank.total
        assert peak.gradients == 4 * peak.params_on_rank.total


# --------------------------------------------------------------------------- activations


def test_full_recompute_keeps_only_the_layer_input() -> None:
    """Korthikanti et al. Table 2: full recompute stores 2*s*b*h per layer (/TP with SP)."""
    s, b, h = 4096, 2, 256
    full = per_layer(TINY, recompute="full", micro_batch_size=b)
    assert set(full.values()) == {2 * s * b * h}
    with_sp = per_layer(TINY, recompute="full", micro_batch_size=b, tp=4, sequence_parallel=True)
    assert set(with_sp.values()) == {2 * s * b * h // 4}


def test_recompute_ordering() -> None:
    none, selective, full = (per_layer(TINY, recompute=r) for r in ("none", "selective", "full"))
    for layer_type in ("attention", "moe"):  # core_attn and moe_act free something
        assert full[layer_type] < selective[layer_type] < none[layer_type]
    for layer_type in ("mamba", "mlp"):  # no selective module touches these
        assert full[layer_type] < selective[layer_type] == none[layer_type]
    totals = [plan(TINY, recompute=r).activations.total for r in ("full", "selective", "none")]
    assert totals == sorted(set(totals))


def test_sequence_parallel_divides_the_replicated_part_by_tp() -> None:
    """Attention, Mamba and MLP replicate only the pre-norm's input, output (bf16 [s,b,h]) and
    fp32 rstd [s,b]; SP shards exactly that over TP."""
    s, h, tp = 4096, 256, 4
    replicated = 2 * 2 * s * h + 4 * s
    off = per_layer(TINY, recompute="none", tp=tp)
    on = per_layer(TINY, recompute="none", tp=tp, sequence_parallel=True)
    for layer_type in ("attention", "mamba", "mlp"):
        assert off[layer_type] - on[layer_type] == replicated - replicated // tp
    assert on["moe"] < off["moe"]
    # TP=1 forces SP off, as Megatron does.
    assert per_layer(TINY, sequence_parallel=True) == per_layer(TINY)


def test_context_parallel_divides_by_cp() -> None:
    cp1 = per_layer(TINY, recompute="none")
    cp2 = per_layer(TINY, recompute="none", cp=2)
    assert {k: 2 * v for k, v in cp2.items()} == cp1


def test_moe_activations_grow_with_top_k() -> None:
    def moe_bytes(top_k: int) -> int:
        moe = {**TINY["moe"], "top_k": top_k}
        return per_layer({**TINY, "moe": moe}, recompute="none")["moe"]

    assert moe_bytes(4) - moe_bytes(2) == moe_bytes(6) - moe_bytes(4) > 0


def test_in_flight_microbatches() -> None:
    """1F1B: rank r holds min(pp - r, M); interleaved rank 0: pp * (1 + (pp-1)/(pp*vpp))."""
    one_f_one_b = plan(TINY, world_size=4, pp=4, global_batch_size=8)
    assert [r.activations.in_flight_microbatches for r in one_f_one_b.per_rank] == [4, 3, 2, 1]
    few = plan(TINY, world_size=4, pp=4, global_batch_size=2)
    assert [r.activations.in_flight_microbatches for r in few.per_rank] == [2, 2, 2, 1]
    interleaved = {**TINY, "pattern": "|".join(["M*-E"] * 8)}
    vpp2 = plan(interleaved, world_size=4, pp=4, global_batch_size=8)
    assert vpp2.per_rank[0].activations.in_flight_microbatches == 4 * (1 + 3 / 8)


def test_logits_and_embedding_sit_on_the_end_ranks() -> None:
    s, vocab, tp = 4096, 1024, 2
    result = plan(TINY, world_size=2, pp=2, tp=tp, etp=1, global_batch_size=8)
    first, last = result.per_rank
    assert first.activations.head == 0 and last.activations.embedding == 0
    assert first.activations.embedding > 0
    assert last.activations.head >= 4 * s * vocab // tp  # fp32 logits
    with_mtp = plan({**TINY, "pattern": TINY["pattern"] + "/*E/*E"}, world_size=2, pp=2)
    assert with_mtp.per_rank[1].activations.head >= 3 * 4 * s * vocab
    assert with_mtp.per_rank[1].activations.mtp > 0 == with_mtp.per_rank[0].activations.mtp


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    tp=st.sampled_from([1, 2, 4]),
    sp=st.booleans(),
    cp=st.sampled_from([1, 2]),
    micro_batch=st.integers(1, 4),
    recompute=st.sampled_from(["none", "selective", "full"]),
)
def test_activations_linear_in_micro_batch(
    tp: int, sp: bool, cp: int, micro_batch: int, recompute: str
) -> None:
    """With pp = 1 one micro-batch is in flight, so every byte scales with the micro batch."""
    kwargs = {"tp": tp, "etp": 1, "cp": cp, "sequence_parallel": sp, "recompute": recompute}
    one = plan(TINY, world_size=8, global_batch_size=16, micro_batch_size=1, **kwargs)
    many = plan(TINY, world_size=8, global_batch_size=16, micro_batch_size=micro_batch, **kwargs)
    assert many.activations.per_layer_type == {
        k: micro_batch * v for k, v in one.activations.per_layer_type.items()
    }
    assert many.activations.total == micro_batch * one.activations.total
    assert many.weights_grads_optimizer == one.weights_grads_optimizer


def test_to_dict_is_json_and_flat_for_the_peak() -> None:
    result = plan(TINY, world_size=4, pp=2, global_batch_size=8)
    out = json.loads(json.dumps(result.to_dict()))
    for key in ("peak_rank", "params_on_rank", "weights", "gradients", "optimizer", "total"):
        assert key in out
    assert set(out["weights_grads_optimizer"]) == {
        "distributed_optimizer",
        "no_distributed_optimizer",
    }
    assert set(out["activations"]) >= {"per_layer_type", "in_flight_microbatches", "total"}
    assert set(out["params_on_rank"]) == {"dense", "replicated", "expert"}
    assert len(out["per_rank"]) == 2
    assert out["total"] == out["per_rank"][out["peak_rank"]]["total"]


# --------------------------------------------------------------------------- precision


def test_quantized_recipes_keep_gemm_inputs_in_their_format() -> None:
    """A tensor kept only for a GEMM's weight gradient costs the recipe's bytes (TE keeps the
    quantized copy): an MLP layer keeps two, the norm output [s, h] and fc2's input [s, ffn]."""
    by_recipe = {r: per_layer(TINY, {"recipe": r}, recompute="none")
                 for r in ("bf16", "mxfp8", "fp8", "nvfp4")}  # fmt: skip
    s, h, ffn = 4096, 256, 512
    saved = s * (h + ffn)
    assert by_recipe["bf16"]["mlp"] - by_recipe["fp8"]["mlp"] == (2 - 1) * saved
    assert by_recipe["bf16"]["mlp"] - by_recipe["nvfp4"]["mlp"] == (2 - 0.5 - 1 / 16) * saved
    for layer_type in by_recipe["bf16"]:
        sizes = [by_recipe[r][layer_type] for r in ("bf16", "mxfp8", "fp8", "nvfp4")]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], layer_type


def test_high_precision_layers_keep_bf16_activations() -> None:
    """Layers the policy keeps in BF16 save BF16 inputs: all of them gives the BF16 total,
    some of them a total in between."""
    totals = {
        name: plan(TINY, precision=precision).activations.total
        for name, precision in {
            "bf16": {},
            "fp8": {"recipe": "fp8"},
            "fp8, first 4 in bf16": {"recipe": "fp8", "high_precision": {"first": 4}},
            "fp8, all in bf16": {"recipe": "fp8", "high_precision": {"first": 16}},
        }.items()
    }
    assert totals["fp8, all in bf16"] == totals["bf16"]
    assert totals["fp8"] < totals["fp8, first 4 in bf16"] < totals["bf16"]
