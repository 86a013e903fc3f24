"""factory.spec: the one description of every tensor, checked against the built graph.

The toy layer type at the end is the proof that adding a layer type means
adding one registered module: it gets a plan, a compiled graph, a precision
table and a clean refusal from the Hugging Face export without any other change.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from blueprint_factory import findings, make
from torch import nn

import factory
from factory.exports.hf_config import ExportError, hf_config
from factory.graph.hybrid_lm import SpecMismatch
from factory.layers.model_spec import model_spec
from factory.precision.policy import resolve_policy
from factory.spec import (
    LAYER_TYPES,
    Init,
    LayerType,
    Role,
    register_layer_type,
    unregister_layer_type,
)
from factory.spec.activations import BF16, TokenShards, prologue_bytes
from factory.spec.tensors import TensorSpec, linear

PRESETS = ["nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"]


def _built(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("name", PRESETS)
def test_meta_graph_has_exactly_the_spec_tensors(name: str) -> None:
    compiled = factory.compile(factory.load_blueprint(name), device="meta")
    assert _built(compiled.model) == model_spec(compiled.blueprint.model).shapes()


@pytest.mark.parametrize("name", PRESETS)
def test_proxy_graph_has_exactly_the_spec_tensors(name: str) -> None:
    compiled = factory.compile(factory.load_blueprint(name), proxy=True)
    assert _built(compiled.model) == model_spec(compiled.blueprint.model).shapes()


def test_sharding_rules_of_the_super_spec() -> None:
    spec = model_spec(factory.load_blueprint("super").model)
    by_name = {t.name: t for t in spec.tensors()}
    mamba, attention, moe = (
        "backbone.layers.0.mixer",
        "backbone.layers.7.mixer",
        "backbone.layers.1.mixer",
    )
    assert by_name[f"{attention}.q_proj.weight"].tp.kind == "column"
    assert by_name[f"{attention}.o_proj.weight"].tp.kind == "row"
    in_proj = by_name[f"{mamba}.in_proj.weight"]
    cfg = spec.model.mamba
    assert in_proj.tp.kind == "heads" and sum(in_proj.tp.segments) == cfg.in_proj_dim
    assert by_name[f"{mamba}.A_log"].tp.kind == "heads"
    up = by_name[f"{moe}.experts.up_proj"]
    assert (up.expert_dim, up.tp.dim, up.active_experts) == (0, 1, spec.model.moe.top_k)
    assert by_name[f"{moe}.experts.down_proj"].tp.dim == 2
    assert by_name[f"{moe}.fc1_latent_proj.weight"].tp is None  # duplicated on every TP rank
    router, bias = by_name[f"{moe}.gate.weight"], by_name[f"{moe}.gate.e_score_correction_bias"]
    assert router.fp32 and router.tp is None and not router.gemm.quantizable
    assert bias.fp32 and not bias.trainable and bias.role is Role.ROUTER_BIAS
    assert by_name["backbone.embeddings.weight"].tp.kind == "vocab"


def test_dtype_rule_keeps_the_router_in_fp32() -> None:
    bp = factory.load_blueprint("super")
    model = factory.compile(bp, proxy=True, dtype=torch.bfloat16).model
    state = model.state_dict()
    for tensor in model_spec(model.cfg).tensors():
        expected = torch.float32 if tensor.fp32 else torch.bfloat16
        assert state[tensor.name].dtype == expected, tensor.name


def test_frozen_tensors_are_the_spec_untrainable_ones() -> None:
    model = factory.compile(factory.load_blueprint("nano"), proxy=True).model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    spec = {t.name for t in model_spec(model.cfg).tensors() if not t.trainable}
    assert frozen == spec and frozen


def test_init_follows_the_spec_rules() -> None:
    model = factory.compile(factory.load_blueprint("nano"), proxy=True, seed=3).model
    state = model.state_dict()
    spec = model_spec(model.cfg)
    std = spec.model.init.std
    scaled = std / (2 * spec.layer_count()) ** 0.5
    for tensor in spec.tensors():
        value = state[tensor.name].float()
        kind = tensor.init.kind
        if kind == "ones":
            assert torch.all(value == 1), tensor.name
        elif kind == "zeros":
            assert torch.all(value == 0), tensor.name
        elif kind in ("normal", "scaled_normal") and tensor.numel > 10_000:
            expected = scaled if kind == "scaled_normal" else std
            assert abs(value.std().item() / expected - 1) < 0.05, tensor.name


def test_expert_bias_off_builds_no_bias() -> None:
    bp = make(**{"model.moe.router.expert_bias": False})
    names = set(model_spec(bp.model).shapes())
    assert not any(n.endswith("e_score_correction_bias") for n in names)
    compiled = factory.compile(bp)
    assert (
        sum(p.numel() for p in compiled.model.parameters())
        == factory.plan(compiled.blueprint).params.total
    )


# --------------------------------------------------------------------------- a toy layer type


class _ToyMixer(nn.Module):
    """y = silu(gate) * up(x): one column-parallel projection to 2d, halves multiplied."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width, bias=False)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        value, gate = self.up(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * value


class _Toy(LayerType):
    symbol = "T"
    name = "toy"

    def mixer_tensors(self, model: Any, prefix: str) -> list[TensorSpec]:
        d = model.hidden_size
        return linear(f"{prefix}.up", d, 2 * d, bias=False, tp="column", init=Init("normal"))

    def megatron_flops(self, model: Any, seq_len: int) -> int:
        return 2 * seq_len * model.hidden_size * 2 * model.hidden_size

    def activation_bytes(self, model: Any, tokens: TokenShards, recompute: str) -> float:
        return prologue_bytes(tokens, model.hidden_size) + BF16 * tokens.sharded(
            2 * model.hidden_size
        )

    def build(self, model: Any) -> nn.Module:
        return _ToyMixer(model.hidden_size)


@pytest.fixture
def toy() -> Iterator[type[LayerType]]:
    register_layer_type(_Toy)
    yield _Toy
    unregister_layer_type("T")


def test_a_registered_layer_type_plans_compiles_quantizes_and_is_refused_by_hf(toy) -> None:
    bp = make(**{"model.pattern": "MT*ET-", "precision.recipe": "nvfp4"})
    plan = factory.plan(bp)
    d = bp.model.hidden_size
    assert plan.params.by_layer_type["toy"] == {
        "layers": 2,
        "per_layer": 2 * d * d + d,  # the projection and the block's pre-norm
        "active_per_layer": 2 * d * d + d,
        "total": 2 * (2 * d * d + d),
    }
    assert plan.flops_per_token.by_layer_type["toy"] == 3 * 2 * (2 * 2 * d * d)
    assert plan.memory.activations.per_layer_type["toy"] > 0

    compiled = factory.compile(bp, precision="off")
    assert sum(p.numel() for p in compiled.model.parameters()) == plan.params.total
    ids = torch.randint(0, bp.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = compiled.model(ids)
    assert out.logits.shape == (2, 16, bp.model.vocab_size) and torch.isfinite(out.logits).all()

    table = {row.name: row.recipe for row in resolve_policy(bp)}
    assert table["backbone.layers.1.mixer.up"] == "nvfp4"
    with pytest.raises(
        ExportError, match=re.escape("'toy' layers ('T') have no NemotronH equivalent")
    ):
        hf_config(bp)


def test_a_layer_type_whose_module_disagrees_with_its_spec_is_caught(toy) -> None:
    class Wrong(_Toy):
        def mixer_tensors(self, model: Any, prefix: str) -> list[TensorSpec]:
            d = model.hidden_size
            return linear(f"{prefix}.up", d, d, bias=False, tp="column", init=Init("normal"))

    unregister_layer_type("T")
    register_layer_type(Wrong)
    with pytest.raises(SpecMismatch, match=r"up.weight: built \(512, 256\) vs spec \(256, 256\)"):
        factory.compile(make(**{"model.pattern": "MT*E-"}), device="meta")


def test_a_symbol_cannot_be_registered_twice() -> None:
    class Impostor(_Toy):
        symbol = "M"

    with pytest.raises(ValueError, match="already the 'mamba' layer type"):
        register_layer_type(Impostor)
    assert LAYER_TYPES["M"].name == "mamba"


def test_an_unregistered_symbol_is_a_pattern_error() -> None:
    (problem,) = findings("model.pattern_symbols", make(**{"model.pattern": "MT*E-"}))
    assert problem.path == "model.pattern"
    assert "unknown symbol 'T'" in problem.message
