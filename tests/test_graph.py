"""The compiled graph: sizes, outputs, routing, MTP, losses and determinism."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from blueprint_factory import make

import factory
from factory.graph.loss import language_model_loss
from factory.precision.policy import quantizable_gemm_names

PRESETS = ["nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"]


@pytest.mark.parametrize("name", PRESETS)
def test_meta_build_has_exactly_the_planned_parameters(name: str) -> None:
    compiled = factory.compile(factory.load_blueprint(name), device="meta")
    assert all(p.is_meta for p in compiled.model.parameters())
    built = sum(p.numel() for p in compiled.model.parameters())
    assert built == factory.plan(compiled.blueprint).params.total


@pytest.mark.parametrize("name", PRESETS)
def test_proxy_has_exactly_the_planned_parameters(name: str) -> None:
    compiled = factory.compile(factory.load_blueprint(name), proxy=True)
    assert (
        sum(p.numel() for p in compiled.model.parameters())
        == factory.plan(compiled.blueprint).params.total
    )


def test_ultra_on_meta_stays_under_two_gigabytes() -> None:
    # The high-water mark of this process's own memory map: ru_maxrss would also count the
    # pytest process it was forked from (Linux keeps it across exec).
    script = (
        "import re, factory\n"
        "factory.compile(factory.load_blueprint('ultra'), device='meta')\n"
        "status = open('/proc/self/status').read()\n"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) < 2 * 1024 * 1024  # kB


def test_building_a_model_imports_no_compiler() -> None:
    """Every compile builds on the meta device first; an init there that goes through torch's
    Python decompositions (normal_ does) imports torch._dynamo with sympy and triton: 150 MiB
    and about a second that nobody asked for (the meta build's peak RSS was 392 MiB, not 241).
    On the CPU, to_empty's empty_like still imports sympy (torch's, not ours to change)."""
    script = (
        "import sys, factory\n"
        "def loaded(): return [m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules]\n"
        "factory.compile(factory.load_blueprint('nano'), device='meta')\n"
        "print(loaded())\n"
        "factory.compile(factory.load_blueprint('nano'), proxy=True)\n"
        "print(loaded())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    on_meta, on_cpu = result.stdout.splitlines()[:2]
    assert on_meta == "[]"
    assert "_dynamo" not in on_cpu and "triton" not in on_cpu


def test_precision_table_names_are_graph_names() -> None:
    compiled = factory.compile(factory.load_blueprint("super"), proxy=True)
    model = compiled.model
    for name in quantizable_gemm_names(compiled.blueprint.model):
        if ".experts." in name:
            assert isinstance(model.get_parameter(name), torch.nn.Parameter), name
        else:
            assert isinstance(model.get_submodule(name), torch.nn.Linear), name


@pytest.fixture(scope="module")
def super_proxy() -> factory.compilation.Compiled:
    return factory.compile(factory.load_blueprint("super"), proxy=True, seed=7)


def test_forward_returns_a_typed_output(super_proxy) -> None:
    model = super_proxy.model.train()
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(ids)
    assert out.logits.shape == (2, 32, 4096)
    assert len(out.mtp_logits) == 2  # depth 2, one repeated block
    assert all(t.shape == out.logits.shape for t in out.mtp_logits)
    assert out.aux_loss is not None and out.aux_loss > 0
    moe_layers = [
        f"backbone.layers.{i}"
        for i, c in enumerate(super_proxy.blueprint.model.parsed_pattern.main)
        if c == "E"
    ]
    assert list(out.tokens_per_expert) == [*moe_layers, "mtp.layers.1"]
    top_k = super_proxy.blueprint.model.moe.top_k
    for name, load in out.tokens_per_expert.items():
        # every token routes top_k times; the repeated MTP block sums its two depths
        depths = 2 if name.startswith("mtp.") else 1
        assert int(load.sum()) == 2 * 32 * top_k * depths, name
    model.eval()
    assert model(ids).aux_loss is None


def test_every_trainable_parameter_gets_a_gradient(super_proxy) -> None:
    model = super_proxy.model.train()
    model.zero_grad()
    ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))
    loss = language_model_loss(model(ids), ids, mtp_loss_scale=0.3).total
    loss.backward()
    silent = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert silent == []
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.endswith("e_score_correction_bias") for n in frozen)


def test_loss_scales_the_mtp_term(super_proxy) -> None:
    model = super_proxy.model.eval()
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids)
    plain = language_model_loss(out, ids, mtp_loss_scale=0.0)
    scaled = language_model_loss(out, ids, mtp_loss_scale=0.3)
    assert len(scaled.mtp) == 2
    expected = plain.total + 0.3 * torch.stack(scaled.mtp).mean()
    assert torch.allclose(scaled.total, expected)
    # depth 1 predicts token i+2: its loss is the CE of its logits against ids shifted by 2
    ce = torch.nn.functional.cross_entropy(
        out.mtp_logits[0][:, :-2].flatten(0, 1), ids[:, 2:].flatten()
    )
    assert torch.allclose(scaled.mtp[0], ce)


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    bp = factory.load_blueprint("nano")
    a = factory.compile(bp, proxy=True, seed=11).model.state_dict()
    b = factory.compile(bp, proxy=True, seed=11).model.state_dict()
    c = factory.compile(bp, proxy=True, seed=12).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["backbone.layers.0.mixer.in_proj.weight"], c["backbone.layers.0.mixer.in_proj.weight"]
    )


def test_expert_bias_moves_towards_balance() -> None:
    model = factory.compile(make(), seed=0).model.train()
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(3))
    load = model(ids).tokens_per_expert
    model.update_expert_biases(load)
    layer = load["backbone.layers.3"].float()
    bias = model.backbone.layers[3].mixer.gate.e_score_correction_bias
    assert torch.all(bias[layer > layer.mean()] < 0) and torch.all(bias[layer < layer.mean()] > 0)


def test_capacity_factor_drops_overflow_tokens_only() -> None:
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(4))
    outputs = {}
    for factor in (None, 100.0, 0.25):
        model = factory.compile(make(**{"model.moe.capacity_factor": factor}), seed=0).model.eval()
        with torch.no_grad():
            outputs[factor] = model(ids).logits
    assert torch.allclose(outputs[None], outputs[100.0])
    assert not torch.allclose(outputs[None], outputs[0.25])


def test_router_matches_transformers_group_limited_routing() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    bp = make(**{"model.moe.router": {"num_groups": 4, "group_top_k": 2, "scaling_factor": 2.5}})
    router = factory.compile(bp, seed=0).model.backbone.layers[3].mixer.gate.eval()
    config = transformers.NemotronHConfig(
        hidden_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    theirs = NemotronHTopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(router.weight)
        router.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
        theirs.e_score_correction_bias.copy_(router.e_score_correction_bias)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5))
    weights, indices, _ = router(x)
    _, their_weights, their_indices = theirs(x)
    order, their_order = indices.argsort(-1), their_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), their_indices.gather(1, their_order))
    assert torch.allclose(weights.gather(1, order), their_weights.gather(1, their_order))


def test_bf16_keeps_the_router_in_fp32() -> None:
    model = factory.compile(make(), dtype=torch.bfloat16).model
    assert model.backbone.layers[3].mixer.gate.weight.dtype == torch.float32
    assert model.backbone.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 1024, (1, 16))
    assert model(ids).logits.dtype == torch.bfloat16
