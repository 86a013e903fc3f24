"""``factory import hf`` on the Nemotron-H / Nemotron 3 configs as released, and HF exports
that transformers' ``from_config`` accepts.

The configs live in ``tests/fixtures/hf_configs`` (their sources are in its README.md).
transformers builds each on the meta device, so a 56B model costs no memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import factory
from factory.exports.hf_config import blueprint_fields_from_hf, hf_block_types, hf_config
from factory.proxy import derive_proxy

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"
RELEASED = sorted(p.stem for p in CONFIGS.glob("*.json"))
PRESETS = sorted(
    p.stem for p in (Path(factory.__file__).parent.parent / "blueprints").glob("*.yaml")
)


def _folder_with(config: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _transformers_count(folder: Path) -> int:
    """Parameters of NemotronHForCausalLM built on meta, plus the routers' score-correction
    biases (transformers keeps them as buffers; they are trained parameters in Megatron)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    biases = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in biases)


def _import(cli, folder: Path, out: Path) -> tuple[int, str]:
    status, _, err = cli("import", "hf", str(folder), "--out", str(out))
    return status, err


@pytest.mark.parametrize("name", RELEASED)
def test_released_config_imports_with_transformers_parameter_count(
    cli, name: str, tmp_path: Path
) -> None:
    config = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    folder = _folder_with(config, tmp_path / name)
    status, err = _import(cli, folder, tmp_path / "bp.yaml")
    assert status == 0, err
    assert "Traceback" not in err and "internal error" not in err
    bp = factory.load_blueprint(tmp_path / "bp.yaml")
    assert factory.plan(bp).params.total_main == _transformers_count(folder)
    # The imported blueprint exports to a config transformers can build from scratch.
    exported = _folder_with(hf_config(bp), tmp_path / "export")
    assert _transformers_count(exported) == _transformers_count(folder)


def test_attention_head_dim_is_read(cli, tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "nemotron_nano_9b_v2.json").read_text(encoding="utf-8"))
    assert (
        "head_dim" not in config and config["hidden_size"] // config["num_attention_heads"] == 112
    )
    assert _import(cli, _folder_with(config, tmp_path / "m"), tmp_path / "bp.yaml")[0] == 0
    assert factory.load_blueprint(tmp_path / "bp.yaml").model.attention.head_dim == 128


def test_bridge_mtp_pattern_is_read(cli, tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "nemotron_3_super_120b_a12b.json").read_text(encoding="utf-8"))
    config["mtp_hybrid_override_pattern"] = "M*E"
    assert _import(cli, _folder_with(config, tmp_path / "m"), tmp_path / "bp.yaml")[0] == 0
    assert factory.load_blueprint(tmp_path / "bp.yaml").model.mtp.pattern == "M*E"


def test_released_super_mtp_reads_as_bridge_reads_it(cli, tmp_path: Path) -> None:
    """One stored block, shared across depths, loss weight 0.3 (Megatron-Bridge's provider)."""
    folder = _folder_with(
        json.loads((CONFIGS / "nemotron_3_super_120b_a12b.json").read_text(encoding="utf-8")),
        tmp_path / "m",
    )
    assert _import(cli, folder, tmp_path / "bp.yaml")[0] == 0
    mtp = factory.load_blueprint(tmp_path / "bp.yaml").model.mtp
    assert (mtp.depth, mtp.pattern, mtp.repeated, mtp.loss_scale) == (1, "*E", True, 0.3)


@pytest.mark.parametrize("preset", ["super", "ultra", "nano", "nemotron_h_8b"])
def test_export_then_import_is_a_fixed_point(cli, preset: str, tmp_path: Path) -> None:
    bp = factory.load_blueprint(preset)
    folder = _folder_with(hf_config(bp), tmp_path / "hf")
    assert _import(cli, folder, tmp_path / "bp.yaml")[0] == 0
    back = factory.load_blueprint(tmp_path / "bp.yaml").model.model_dump(exclude={"init"})
    want = bp.model.model_dump(exclude={"init"})
    want["pattern"] = want["pattern"].replace("|", "")  # pipeline cuts are not the model's
    assert back == want


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_exports_a_config_from_config_builds(preset: str, tmp_path: Path) -> None:
    bp = factory.load_blueprint(preset)
    assert _transformers_count(_folder_with(hf_config(bp), tmp_path / "hf")) == (
        factory.plan(bp).params.total_main
    )
    # Off the meta device transformers initialises the weights, taking log(time_step_min).
    folder = _folder_with(hf_config(derive_proxy(bp)), tmp_path / "proxy")
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_megatron_export_of_a_dense_preset_imports(cli, tmp_path: Path) -> None:
    status, _, err = cli("export", "megatron", "nemotron_h_8b", "--out", str(tmp_path / "mb"))
    assert status == 0, err
    status, err = _import(cli, tmp_path / "mb" / "hf", tmp_path / "bp.yaml")
    assert status == 0, err
    assert factory.load_blueprint(tmp_path / "bp.yaml").model.mtp is None


def test_config_without_weights_gets_no_checkpoint_line(cli, tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "nemotron_3_nano_30b_a3b.json").read_text(encoding="utf-8"))
    folder = _folder_with(config, tmp_path / "m")
    status, err = _import(cli, folder, tmp_path / "bp.yaml")
    assert status == 0
    assert err.count("\n") == 1 and str(folder) in err and "no *.safetensors" in err
    assert factory.load_blueprint(tmp_path / "bp.yaml").model.init.checkpoint is None
    (folder / "model.safetensors").write_bytes(b"")
    assert _import(cli, folder, tmp_path / "bp2.yaml") == (0, "")
    assert factory.load_blueprint(tmp_path / "bp2.yaml").model.init.checkpoint == str(
        folder.resolve()
    )


@pytest.mark.parametrize(("written", "read"), [(None, 0.3), (0.0, 0.0), (0.5, 0.5)])
def test_mtp_loss_weight_none_means_unset(cli, written, read, tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "nemotron_3_super_120b_a12b.json").read_text(encoding="utf-8"))
    config["mtp_loss_scaling_factor"] = written
    status, err = _import(cli, _folder_with(config, tmp_path / "m"), tmp_path / "bp.yaml")
    assert status == 0, err
    assert factory.load_blueprint(tmp_path / "bp.yaml").model.mtp.loss_scale == read


def test_block_types_of_older_transformers_are_read() -> None:
    config = json.loads((CONFIGS / "nemotron_3_nano_30b_a3b.json").read_text(encoding="utf-8"))
    pattern = config["hybrid_override_pattern"]
    older = {"linear_attention": "mamba", "full_attention": "attention"}  # before the rename
    types = [older.get(block, block) for block in hf_block_types(pattern)]
    assert {"mamba", "attention", "moe"} <= set(types)
    assert blueprint_fields_from_hf({**config, "layers_block_type": types})["pattern"] == pattern
