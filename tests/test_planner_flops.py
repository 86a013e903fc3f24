"""FLOPs per token: Megatron's formula against its reference values, the exact count
against hand-derived layer terms and 6 x active parameters, and scaling properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_models import SUPER_PATTERN, VOCAB, nano, super_, ultra

from factory.planner.flops import flops_keys, flops_per_token, megatron_flops_per_sequence
from factory.planner.params import count_params
from factory.schemas.model import ModelConfig

# --------------------------------------------------------------------------- Megatron's formula


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (nano, {4096: "21.67", 8192: "22.28"}),
        (super_, {4096: "74.57", 8192: "75.37"}),
        (lambda: super_(SUPER_PATTERN + "/*E/*E"), {4096: "83.72", 8192: "84.73"}),
        (ultra, {4096: "333.2", 8192: "335.6"}),
    ],
    ids=["nano", "super", "super-mtp2", "ultra"],
)
def test_megatron_matches_reference_values(build, expected: dict[int, str]) -> None:
    """``docs/flops.md``, 'Reference values': 4 significant digits, GFLOP per token."""
    model = build()
    for seq_len, gflop in expected.items():
        assert f"{flops_per_token(model, seq_len).megatron / 1e9:.4g}" == gflop


def test_megatron_nano_per_sequence() -> None:
    """``docs/flops.md``, 'Reference values': 1.825e14 FLOPs per 8192-token Nano sequence."""
    per_sequence = megatron_flops_per_sequence(nano(), 8192)
    assert f"{per_sequence:.4g}" == "1.825e+14"
    assert per_sequence == 8192 * flops_per_token(nano(), 8192).megatron


def test_mtp_section_counts_like_the_slash_pattern() -> None:
    """Megatron converts --mtp-hybrid-override-pattern into the '/' form, so both agree."""
    slash = super_(SUPER_PATTERN + "/*E/*E")
    section = super_(mtp={"depth": 2, "pattern": "*E", "repeated": True})
    assert flops_per_token(slash, 8192) == flops_per_token(section, 8192)


def test_megatron_latent_moe_term() -> None:
    """``docs/flops.md``, 'Megatron-LM formula': 4*l*ff*K + 4*d*l + 4*d*ff_shared per token per
    MoE layer, x3."""
    per_layer = 4 * 1024 * 2688 * 22 + 4 * 4096 * 1024 + 4 * 4096 * 5376
    split = flops_per_token(super_(), 4096).megatron_by_layer_type
    assert split["moe"] == 3 * 40 * per_layer


def test_megatron_mamba_uses_two_h_not_the_real_d_inner() -> None:
    """For Nano the real d_inner (4096) is below Megatron's 2h (5376): exact is smaller."""
    flops = flops_per_token(nano(), 8192)
    d_in, h = 2 * 2688, 2688
    megatron_layer = 2 * h * (2 * d_in + 2 * 8 * 128 + 64) + 7 * d_in * 128 + 2 * d_in * h
    assert flops.megatron_by_layer_type["mamba"] == 3 * 23 * megatron_layer
    assert flops.by_layer_type["mamba"] < flops.megatron_by_layer_type["mamba"]


# --------------------------------------------------------------------------- exact count


def test_exact_nano_mamba_from_checkpoint_shapes() -> None:
    """Nano Mamba from its checkpoint shapes (``docs/architecture.md``, 'Checkpoint keys'):
    in_proj [10304, 2688], conv1d [6144, 1, 4] (with bias), out_proj [2688, 4096]; SSD scan
    at Q=128, N=128, 8 groups, d_inner 4096 (``docs/flops.md``, 'SSD scan')."""
    scan = 2 * 128 * 128 * 8 + 2 * 128 * 4096 + 4 * 128 * 4096
    layer = 2 * 2688 * 10304 + (2 * 4 * 6144 + 6144) + scan + 2 * 4096 * 2688
    assert flops_per_token(nano(), 8192).by_layer_type["mamba"] == 3 * 23 * layer


def test_exact_splits_and_sums() -> None:
    flops = flops_per_token(super_(SUPER_PATTERN + "/*E/*E"), 4096)
    assert tuple(flops.by_layer_type) == flops_keys()
    assert sum(flops.by_layer_type.values()) == flops.exact == 3 * flops.exact_forward
    assert sum(flops.megatron_by_layer_type.values()) == flops.megatron
    assert flops.to_dict()["seq_len"] == 4096


@pytest.mark.parametrize(
    ("build", "active_without_embedding"),
    [(nano, 3_227_754_816), (super_, 12_233_366_528), (ultra, 54_985_101_312)],
    ids=["nano", "super", "ultra"],
)
def test_exact_close_to_six_n_active_plus_attention_core(
    build, active_without_embedding: int
) -> None:
    """6 x active parameters (``docs/architecture.md``, 'Parameter counts'; no input embedding:
    a lookup is no FLOP) plus Megatron's causal attention core 6*s*q per attention layer. The
    exact count adds the SSD scan (about 1%) and skips norm weights: within 2%, and above."""
    model = build()
    assert count_params(model).active - count_params(model).embedding == active_without_embedding
    seq_len = 8192
    q = model.attention.heads * model.attention.head_dim
    reference = 6 * active_without_embedding + 6 * seq_len * q * model.parsed_pattern.main.count(
        "*"
    )
    exact = flops_per_token(model, seq_len).exact
    assert reference < exact < 1.02 * reference


@pytest.mark.parametrize("seq_len", [1, 2, 7, 64])
def test_attention_core_is_the_causal_average_by_brute_force(seq_len: int) -> None:
    model = nano()
    q = 32 * 128
    core_sum = sum(4 * q * keys for keys in range(1, seq_len + 1))  # QK^T + PV for each query
    projections = 2 * 2688 * q + 2 * 2 * 2688 * 256 + 2 * q * 2688
    expected_forward = 6 * (projections * seq_len + core_sum)  # 6 attention layers
    assert flops_per_token(model, seq_len).by_layer_type["attention"] * seq_len == (
        3 * expected_forward
    )


def test_mtp_term_is_eh_proj_inner_layers_and_head_per_depth() -> None:
    flops = flops_per_token(super_(SUPER_PATTERN + "/*E/*E"), 4096).by_layer_type
    d = 4096
    attention_layer = flops["attention"] // 8
    moe_layer = flops["moe"] // 40
    per_depth = 3 * 2 * 2 * d * d + attention_layer + moe_layer + 3 * 2 * d * VOCAB
    assert flops["mtp"] == 2 * per_depth
    assert flops["head"] == 3 * 2 * d * VOCAB


def test_attention_bias_adds_one_flop_per_output() -> None:
    plain = flops_per_token(nano(), 4096).by_layer_type["attention"]
    biased = nano(attention={"heads": 32, "kv_heads": 2, "head_dim": 128, "bias": True})
    outputs = 32 * 128 + 2 * 2 * 128 + 2688  # q, k, v, o
    assert flops_per_token(biased, 4096).by_layer_type["attention"] == plain + 3 * 6 * outputs


def test_rejects_non_positive_seq_len() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(nano(), 0)


# --------------------------------------------------------------------------- properties


def _tiny(pattern: str, num_experts: int = 8, activation: str = "relu2") -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "pattern": pattern,
            "hidden_size": 256,
            "vocab_size": 1000,
            "max_seq_len": 8192,
            "attention": {"heads": 4, "kv_heads": 2, "head_dim": 64},
            "mamba": {"heads": 8, "head_dim": 64, "groups": 2, "state_size": 32},
            "mlp": {"intermediate_size": 512, "activation": activation},
            "moe": {
                "num_experts": num_experts,
                "top_k": 2,
                "expert_intermediate_size": 128,
                "shared_expert_intermediate_size": 256,
                "activation": activation,
            },
        }
    )


patterns = st.text(alphabet="M*-E", min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pattern=patterns, repeats=st.integers(1, 4), seq_len=st.integers(1, 4096))
def test_flops_grow_linearly_in_layers(pattern: str, repeats: int, seq_len: int) -> None:
    one = flops_per_token(_tiny(pattern), seq_len)
    many = flops_per_token(_tiny(pattern * repeats), seq_len)
    for key in ("mamba", "attention", "mlp", "moe"):
        assert many.by_layer_type[key] == repeats * one.by_layer_type[key]
        assert many.megatron_by_layer_type.get(key, 0) == repeats * (
            one.megatron_by_layer_type.get(key, 0)
        )
    assert many.by_layer_type["head"] == one.by_layer_type["head"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pattern=patterns, short=st.integers(128, 8192), extra=st.integers(1, 8192))
def test_only_attention_grows_with_seq_len(pattern: str, short: int, extra: int) -> None:
    """Past one SSD chunk, only the attention core depends on the sequence length."""
    model = _tiny(pattern)
    a, b = flops_per_token(model, short), flops_per_token(model, short + extra)
    has_attention = "*" in pattern
    for split_a, split_b in (
        (a.by_layer_type, b.by_layer_type),
        (a.megatron_by_layer_type, b.megatron_by_layer_type),
    ):
        for key in split_a:
            if key == "attention":
                assert split_b[key] > split_a[key] or not has_attention
            else:
                assert split_b[key] == split_a[key]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    pattern=patterns,
    experts=st.tuples(st.integers(2, 512), st.integers(2, 512)),
    activation=st.sampled_from(["relu2", "swiglu"]),
)
def test_moe_flops_depend_on_num_experts_only_through_router(
    pattern: str, experts: tuple[int, int], activation: str
) -> None:
    e1, e2 = experts
    a = flops_per_token(_tiny(pattern, e1, activation), 2048)
    b = flops_per_token(_tiny(pattern, e2, activation), 2048)
    n_moe = pattern.count("E")
    assert a.by_layer_type["moe"] - b.by_layer_type["moe"] == 3 * n_moe * 2 * 256 * (e1 - e2)
    assert a.megatron == b.megatron  # Megatron does not count the router


def test_swiglu_costs_one_and_a_half_relu2_in_megatron_moe() -> None:
    relu2 = flops_per_token(_tiny("E"), 1024).megatron_by_layer_type["moe"]
    swiglu = flops_per_token(_tiny("E", activation="swiglu"), 1024).megatron_by_layer_type["moe"]
    assert 2 * swiglu == 3 * relu2
