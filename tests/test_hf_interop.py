"""Hugging Face interop against the real transformers NemotronH (not a mock).

Each case exports a factory model, loads it with AutoModelForCausalLM, and
compares logits in float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from blueprint_factory import DELETE, make

import factory
from factory.exports.hf import write_hf_checkpoint
from factory.schemas import Blueprint

transformers = pytest.importorskip("transformers")

ODD = {
    "model.hidden_size": 200,
    "model.vocab_size": 1000,
    "model.attention": {"heads": 5, "kv_heads": 5, "head_dim": 24},
    # transformers clamps dt at time_step_min (dt_min, 0.001 as released) where Megatron clamps
    # at dt_limit_min (0): equal clamps here, since these random weights reach dt < 0.001.
    "model.mamba": {
        "heads": 5,
        "head_dim": 24,
        "state_size": 12,
        "groups": 1,
        "chunk_size": 16,
        "dt_limit_min": 0.001,
    },
    "model.mlp": {"intermediate_size": 333},
    "model.moe.expert_intermediate_size": 72,
    "model.moe.shared_expert_intermediate_size": 40,
}
CASES = {
    "nano-proxy": lambda: factory.compile(factory.load_blueprint("nano"), proxy=True, seed=1),
    # transformers computes unquantized: compare with the graph before its NVFP4 policy.
    "super-proxy": lambda: factory.compile(
        factory.load_blueprint("super"), proxy=True, seed=2, precision="off"
    ),
    "dense M-*-": lambda: factory.compile(
        make(**{"model.pattern": "M-*-", "model.moe": DELETE}), seed=3
    ),
    "n_groups=1, odd widths": lambda: factory.compile(make(**ODD), seed=4),
}


def _logits(model: torch.nn.Module, vocab: int, seq: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        out = model(ids)
    return ids, getattr(out, "logits", out)


def _load(directory: Path) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32
    )
    return model, info


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_our_export_with_equal_logits(case: str, tmp_path: Path) -> None:
    compiled = CASES[case]()
    write_hf_checkpoint(compiled.model, compiled.blueprint, tmp_path)
    hf, info = _load(tmp_path)
    assert type(hf).__name__ == "NemotronHForCausalLM"
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    assert not info["mismatched_keys"]
    ids, ours = _logits(compiled.model, compiled.blueprint.model.vocab_size)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def test_export_writes_release_key_names(tmp_path: Path) -> None:
    from safetensors import safe_open

    compiled = CASES["super-proxy"]()
    write_hf_checkpoint(compiled.model, compiled.blueprint, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "backbone.embeddings.weight" in keys and "lm_head.weight" in keys
    assert "backbone.layers.1.mixer.experts.0.up_proj.weight" in keys
    assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in keys
    assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in keys
    # one repeated MTP block "*E": eh_proj on inner 0, final_layernorm on inner 1
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= keys
    # every parameter is exported once: the file holds exactly the planned count
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        exported = sum(_numel(handle.get_slice(k).get_shape()) for k in keys)
    assert exported == factory.plan(compiled.blueprint).params.total


def _numel(shape: list[int]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def test_cli_export_then_import_round_trips(cli, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    status, _, err = cli("export", "hf", "nano", "--proxy", "--seed", "5", "--out", str(out))
    assert status == 0, err
    hf, _ = _load(out)
    status, _, err = cli("import", "hf", str(out), "--out", str(tmp_path / "bp.yaml"))
    assert status == 0, err
    bp = factory.load_blueprint(tmp_path / "bp.yaml")
    assert bp.model.init.checkpoint == str(out.resolve())
    imported = factory.compile(bp)
    ids, ours = _logits(imported.model, bp.model.vocab_size)
    with torch.no_grad():
        assert (ours - hf(ids).logits).abs().max().item() < 1e-4


def test_export_refuses_what_hf_cannot_express(cli, tmp_path: Path) -> None:
    status, _, err = cli(
        "export",
        "hf",
        "nano",
        "--proxy",
        "--out",
        str(tmp_path / "x"),
        "--set",
        "model.position_embedding=rope",
    )
    assert status == 2
    assert "no position embedding" in err
    assert not (tmp_path / "x").exists()


def test_import_of_a_non_nemotron_config_is_a_clear_error(cli, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    status, _, err = cli("import", "hf", str(tmp_path), "--out", str(tmp_path / "bp.yaml"))
    assert status == 2
    assert "expected nemotron_h" in err


def test_weights_flag_loads_a_checkpoint(cli, tmp_path: Path) -> None:
    source = CASES["nano-proxy"]()
    write_hf_checkpoint(source.model, source.blueprint, tmp_path / "src")
    status, _, err = cli(
        "export",
        "hf",
        "nano",
        "--proxy",
        "--seed",
        "99",
        "--weights",
        str(tmp_path / "src"),
        "--out",
        str(tmp_path / "dst"),
    )
    assert status == 0, err
    assert (tmp_path / "src" / "model.safetensors").read_bytes() == (
        tmp_path / "dst" / "model.safetensors"
    ).read_bytes()


def test_blueprint_types_are_what_the_cases_claim() -> None:
    assert isinstance(make(**ODD), Blueprint)
    assert make(**ODD).model.mamba.groups == 1


def test_an_export_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """safetensors creates its file 0600: on a shared cluster nobody else could read a model
    factory wrote. Every exported file gets the mode a plain open() would give it."""
    compiled = CASES["super-proxy"]()
    previous = os.umask(0o022)
    try:
        write_hf_checkpoint(compiled.model, compiled.blueprint, tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}
