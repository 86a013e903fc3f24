"""``factory import hf``: a blueprint that reproduces a NemotronH checkpoint and starts from it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from factory.errors import BlueprintError, Diagnostic
from factory.exports.hf_config import blueprint_fields_from_hf

__all__ = ["blueprint_yaml_from_hf", "has_weights"]


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds safetensors weights (one file or shards)."""
    return any(directory.glob("*.safetensors"))


def blueprint_yaml_from_hf(directory: Path) -> str:
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlueprintError([Diagnostic("", "no config.json here", str(directory), 0)]) from None
    except json.JSONDecodeError as exc:
        raise BlueprintError(
            [Diagnostic("", f"config.json is not JSON: {exc.msg}", str(config_path), exc.lineno)]
        ) from None
    if config.get("model_type") != "nemotron_h":
        raise BlueprintError(
            [
                Diagnostic(
                    "model_type",
                    f"expected nemotron_h, got {config.get('model_type')!r}",
                    str(config_path),
                    0,
                )
            ]
        )
    model = blueprint_fields_from_hf(config)
    weights = has_weights(directory)
    if weights:  # a checkpoint line to a folder without weights would only fail in `train`
        model["init"]["checkpoint"] = str(directory.resolve())
    doc = {
        "meta": {
            "name": directory.resolve().name,
            "description": f"imported from {directory.resolve()}",
            "family": "nemotron-h",
        },
        "model": model,
        "parallelism": {"world_size": 1, "micro_batch_size": 1, "global_batch_size": 8},
        "data": {"recipe": "nano", "seq_len": min(4096, model["max_seq_len"]), "tokens": "1B"},
        "training": {"optimizer": {"lr": 3.0e-4}},
    }
    header = f"# Written by `factory import hf {directory}`; edit parallelism, data and training.\n"
    if not weights:
        header += (
            "# The folder holds no *.safetensors: this blueprint starts from random weights.\n"
        )
    return header + yaml.safe_dump(doc, sort_keys=False)
