"""factory.naming: the linear-module names precision globs are matched against."""

from __future__ import annotations

from blueprint_factory import make
from reference_models import nano

from factory.naming import (
    excluded_module_names,
    generalize,
    generalized_names,
    layer_index_of,
    linear_module_names,
)


def _names(**overrides: object) -> list[str]:
    return linear_module_names(make(**overrides).model)


def test_base_names_follow_the_checkpoint_keys():
    names = _names()
    assert names[:6] == [
        "layers.0.mixer.in_proj",
        "layers.0.mixer.out_proj",
        "layers.1.mixer.q_proj",
        "layers.1.mixer.k_proj",
        "layers.1.mixer.v_proj",
        "layers.1.mixer.o_proj",
    ]
    assert "layers.4.mixer.up_proj" in names and "layers.4.mixer.down_proj" in names
    assert "layers.3.mixer.experts.up_proj" in names
    assert "layers.3.mixer.shared_experts.down_proj" in names
    assert len(names) == len(set(names))


def test_router_head_and_embeddings_are_not_linears():
    names = _names()
    assert not any(n.endswith(".gate") or n in ("lm_head", "embeddings") for n in names)
    assert excluded_module_names(make().model) == [
        "embeddings",
        "lm_head",
        "layers.3.mixer.gate",
        "layers.8.mixer.gate",
    ]


def test_nano_counts():
    """Nano: 23 Mamba x 2 + 6 attention x 4 + 23 MoE x (2 routed + 2 shared) = 162."""
    model = nano()
    assert len(linear_module_names(model)) == 23 * 2 + 6 * 4 + 23 * 4


def test_swiglu_adds_gate_proj_to_mlp_and_experts():
    names = _names(**{"model.mlp.activation": "swiglu", "model.moe.activation": "swiglu"})
    assert "layers.4.mixer.gate_proj" in names
    assert "layers.3.mixer.experts.gate_proj" in names
    assert "layers.4.mixer.gate_proj" not in _names()


def test_latent_projections_only_with_latent_moe():
    assert "layers.3.mixer.fc1_latent_proj" not in _names()
    names = _names(**{"model.moe.latent_size": 64, "model.moe.shared_expert_intermediate_size": 0})
    assert "layers.3.mixer.fc1_latent_proj" in names and "layers.3.mixer.fc2_latent_proj" in names
    assert not any("shared_experts" in n for n in names)


def test_mtp_blocks_are_flattened_with_eh_proj_on_the_first_inner_layer():
    names = _names(**{"model.pattern": "M*ME/*E/*E"})
    mtp = [n for n in names if n.startswith("mtp.")]
    assert [n for n in mtp if n.endswith("eh_proj")] == [
        "mtp.layers.0.eh_proj",
        "mtp.layers.2.eh_proj",
    ]
    assert "mtp.layers.1.mixer.experts.up_proj" in mtp
    assert "mtp.layers.3.mixer.experts.down_proj" in mtp
    assert "mtp.layers.2.mixer.q_proj" in mtp


def test_repeated_mtp_stores_one_block():
    names = _names(**{"model.pattern": "M*ME/*E/*E", "model.mtp": {"repeated": True}})
    assert {n.split(".")[2] for n in names if n.startswith("mtp.")} == {"0", "1"}


def test_mtp_from_section_without_slashes():
    names = _names(**{"model.mtp": {"depth": 1, "pattern": "M"}})
    assert [n for n in names if n.startswith("mtp.")] == [
        "mtp.layers.0.eh_proj",
        "mtp.layers.0.mixer.in_proj",
        "mtp.layers.0.mixer.out_proj",
    ]


def test_layer_index_of():
    assert layer_index_of("layers.12.mixer.in_proj") == 12
    assert layer_index_of("mtp.layers.0.eh_proj") is None
    assert layer_index_of("lm_head") is None


def test_generalize_replaces_every_index():
    assert generalize("layers.3.mixer.out_proj") == "layers.*.mixer.out_proj"
    assert generalize("mtp.layers.10.eh_proj") == "mtp.layers.*.eh_proj"
    assert generalize("layers.3.mixer.experts.7.up_proj") == "layers.*.mixer.experts.*.up_proj"


def test_generalized_names_offer_the_short_form():
    names = generalized_names(make(**{"model.pattern": "M*ME/*E"}).model)
    assert "*.mixer.out_proj" in names and "layers.*.mixer.out_proj" in names
    assert "*.eh_proj" in names and "mtp.layers.*.eh_proj" in names
    assert len(names) == len(set(names))
