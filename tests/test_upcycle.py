"""Dense-to-MoE upcycling (factory.graph.upcycle, factory/layers/moe/upcycle.py): the MoE starts
as the dense model, exactly."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import factory
from factory.exports.hf import to_checkpoint_state_dict
from factory.graph.upcycle import UpcycleError, upcycle
from factory.schemas import Blueprint

DENSE: dict[str, Any] = {
    "meta": {"name": "dense"},
    "model": {
        "pattern": "M-*-",
        "hidden_size": 64,
        "vocab_size": 256,
        "max_seq_len": 64,
        "attention": {"heads": 4, "kv_heads": 2, "head_dim": 16},
        "mamba": {"heads": 4, "head_dim": 16, "state_size": 16, "groups": 2, "chunk_size": 16},
        "mlp": {"intermediate_size": 128},
    },
    "parallelism": {"world_size": 1, "global_batch_size": 8},
    "data": {"recipe": "nano", "seq_len": 64, "tokens": "1M"},
    "training": {"optimizer": {"lr": 1e-3}},
}
MOE: dict[str, Any] = {
    "num_experts": 8,
    "top_k": 4,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "router": {"scaling_factor": 2.5},
}


def blueprint(pattern: str = "M-*-", mlp: dict | None = None, **model: Any) -> Blueprint:
    data = copy.deepcopy(DENSE)
    data["model"].update(pattern=pattern, **model)
    data["model"]["mlp"].update(mlp or {})
    return Blueprint.model_validate(data)


def moe(router: dict | None = None, **fields: Any) -> dict:
    section = {**copy.deepcopy(MOE), **fields}
    section["router"].update(router or {})
    return section


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """These tensors are tiny: intra-op threads only add overhead (100x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The dense model (eval mode) and its checkpoint as one .safetensors file."""
    model = factory.compile(blueprint(), seed=3).model.eval()
    path = tmp_path_factory.mktemp("dense") / "dense.safetensors"
    save_file(to_checkpoint_state_dict(model, model.cfg), str(path))
    return model, path


@pytest.fixture(scope="module")
def dense_logits(dense: tuple[Any, Path]) -> torch.Tensor:
    with torch.no_grad():
        return dense[0](tokens()).logits


def upcycled(
    path: Path, pattern: str = "M-*E", seed: int = 5, mlp: dict | None = None, **section: Any
) -> Any:
    bp = blueprint(pattern, mlp, moe=moe(**section), init={"upcycle_from": str(path)})
    return factory.compile(bp, seed=seed).model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("pattern", "section"),
    [
        pytest.param("M-*E", {"router": {"score_function": "sigmoid"}}, id="a-sigmoid-renorm"),
        pytest.param("ME*E", {"top_k": 8}, id="a-sigmoid-renorm-all-copies"),
        pytest.param("M-*E", {"router": {"score_function": "softmax"}}, id="b-softmax-renorm"),
        pytest.param(
            "ME*E",
            {"router": {"score_function": "softmax", "normalize_top_k": False}},
            id="c-softmax-then-topk",
        ),
        pytest.param(
            "M-*E", {"router": {"normalize_top_k": False}, "top_k": 8}, id="c-sigmoid-no-renorm"
        ),
        pytest.param(
            "ME*E",
            {"expert_intermediate_size": 128, "num_experts": 4, "top_k": 2},
            id="d-coarse-G1",
        ),
        pytest.param(
            "M-*E",
            {"expert_intermediate_size": 128, "num_experts": 4, "top_k": 1},
            id="d-coarse-top1-uniform",
        ),
        pytest.param("M-*E", {"router": {"num_groups": 2, "group_top_k": 1}}, id="grouped"),
    ],
)
def test_upcycled_model_reproduces_dense_logits(
    dense: tuple[Any, Path], dense_logits: torch.Tensor, pattern: str, section: dict
) -> None:
    moe_model = upcycled(dense[1], pattern, **section).eval()
    with torch.no_grad():
        logits = moe_model(tokens()).logits
    assert logits.abs().max() > 0.1  # not trivially zero
    assert torch.allclose(logits, dense_logits, atol=1e-5, rtol=0)


def test_swiglu_upcycles_to_swiglu_experts(tmp_path: Path) -> None:
    swiglu = {"activation": "swiglu"}
    model = factory.compile(blueprint(mlp=swiglu), seed=1).model.eval()
    path = tmp_path / "dense.safetensors"
    save_file(to_checkpoint_state_dict(model, model.cfg), str(path))
    moe_model = upcycled(path, mlp=swiglu, activation="swiglu").eval()
    experts = moe_model.backbone.layers[3].mixer.experts
    dense_gate = model.backbone.layers[3].mixer.gate_proj.weight
    assert torch.equal(experts.gate_proj[6], dense_gate[64:96])
    with torch.no_grad():
        assert torch.allclose(moe_model(tokens()).logits, model(tokens()).logits, atol=1e-5, rtol=0)


def test_shards_copies_router_and_shared_expert(dense: tuple[Any, Path]) -> None:
    model, path = dense
    mixer = upcycled(path).backbone.layers[3].mixer
    mlp = model.backbone.layers[3].mixer
    up, down = mlp.up_proj.weight, mlp.down_proj.weight
    for e in range(8):  # expert e = copy * 4 + shard
        j = e % 4
        assert torch.equal(mixer.experts.up_proj[e], up[32 * j : 32 * (j + 1)])
        scaled = down[:, 32 * j : 32 * (j + 1)] * (4 / 2.5)
        assert torch.allclose(mixer.experts.down_proj[e], scaled, atol=1e-7, rtol=1e-6)
    rows = mixer.gate.weight
    assert torch.equal(rows[:4], rows[0].expand(4, -1)) and torch.equal(
        rows[4:], rows[4:5].expand(4, -1)
    )
    assert not torch.equal(rows[0], rows[4])
    assert torch.count_nonzero(mixer.gate.e_score_correction_bias) == 0
    assert torch.count_nonzero(mixer.shared_experts.down_proj.weight) == 0
    assert torch.count_nonzero(mixer.shared_experts.up_proj.weight) > 0


def test_uniform_mode_router_tie_break_and_scale(dense: tuple[Any, Path]) -> None:
    model, path = dense
    router = {"score_function": "softmax", "normalize_top_k": False}
    mixer = upcycled(path, router=router).backbone.layers[3].mixer
    assert torch.count_nonzero(mixer.gate.weight) == 0
    bias = mixer.gate.e_score_correction_bias
    assert torch.equal(bias[:4], bias[0].expand(4)) and bool(bias[3] > bias[4])
    down = model.backbone.layers[3].mixer.down_proj.weight
    alpha = 8 * 4 / (4 * 2.5)  # E * G / (top_k * s)
    expected = down[:, 32:64] * alpha
    assert torch.allclose(mixer.experts.down_proj[5], expected, atol=1e-7, rtol=1e-6)


def test_router_seeded_by_compile_seed(dense: tuple[Any, Path]) -> None:
    _, path = dense
    first, again, other = (upcycled(path, seed=s).backbone.layers[3].mixer.gate for s in (5, 5, 6))
    assert torch.equal(first.weight, again.weight)
    assert not torch.equal(first.weight, other.weight)


@pytest.mark.parametrize(
    "router",
    [
        pytest.param({}, id="renormalised-random-router"),
        pytest.param({"score_function": "softmax", "normalize_top_k": False}, id="uniform"),
    ],
)
def test_training_breaks_symmetry_through_gradients(
    dense: tuple[Any, Path], dense_logits: torch.Tensor, router: dict
) -> None:
    model = upcycled(dense[1], router=router).train()
    mixer = model.backbone.layers[3].mixer
    experts = mixer.experts
    assert torch.equal(experts.up_proj[:4], experts.up_proj[4:])  # two identical copies
    before = mixer.gate.weight.detach().clone()
    ids = tokens()
    out = model(ids)  # training mode adds no noise: still the dense model
    assert torch.allclose(out.logits.detach(), dense_logits, atol=1e-5, rtol=0)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    (loss + out.aux_loss).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(mixer.gate.weight, before)  # the router moves
    assert not torch.equal(experts.up_proj[:4], experts.up_proj[4:])  # copies saw other tokens
    assert torch.count_nonzero(mixer.shared_experts.down_proj.weight) > 0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"latent_size": 32}, "LatentMoE"),
        ({"expert_intermediate_size": 48}, "not a whole number"),
        ({"top_k": 2}, "multiples of the granularity"),
        ({"num_experts": 6, "top_k": 4}, "multiples of the granularity"),
        ({"activation": "swiglu"}, "relu2"),
        ({"router": {"normalize_top_k": False, "expert_bias": False}}, "expert_bias"),
        ({"router": {"num_groups": 4, "group_top_k": 2}}, "whole copies"),
    ],
)
def test_unfit_moe_blueprints_raise(dense: tuple[Any, Path], section: dict, message: str) -> None:
    _, path = dense
    with pytest.raises(UpcycleError, match=message):
        upcycled(path, **section)


def test_source_layer_must_be_dense_mlp(dense: tuple[Any, Path]) -> None:
    _, path = dense
    with pytest.raises(UpcycleError, match=r"layers\.2 is '\*', not the MLP layer \('-'\)"):
        upcycled(path, pattern="M-EE")
    with pytest.raises(UpcycleError, match=r"layers\.2 is 'M' in the blueprint but '\*'"):
        upcycled(path, pattern="M-ME")


def test_missing_and_unexpected_tensors_raise(dense: tuple[Any, Path]) -> None:
    model, _ = dense
    bp = blueprint("M-*E", moe=moe())
    target = factory.compile(bp, device="meta").model.to_empty(device="cpu")
    state = to_checkpoint_state_dict(model, model.cfg)
    generator = torch.Generator().manual_seed(0)
    broken = {k: v for k, v in state.items() if k != "backbone.layers.0.mixer.A_log"}
    with pytest.raises(UpcycleError, match=r"1 missing.*A_log"):
        upcycle(target, broken, generator)
    extra = {**state, "backbone.layers.9.norm.weight": torch.ones(64)}
    with pytest.raises(UpcycleError, match=r"unexpected backbone\.layers\.9"):
        upcycle(target, extra, generator)
    no_down = {k: v for k, v in state.items() if k != "backbone.layers.3.mixer.down_proj.weight"}
    with pytest.raises(UpcycleError, match=r"no backbone\.layers\.3\.mixer\.down_proj\.weight"):
        upcycle(target, no_down, generator)
