"""Run by tests/test_export_megatron_bridge_run.py in its own process (the Transformer Engine
stub must not leak into the test session): build each exported recipe.py's ConfigContainer
with the installed Megatron-Bridge and call its validate() at the layout's WORLD_SIZE.

argv[1] is a JSON list of [name, recipe.py path, world size] or [name, path, world size,
keyword arguments of the recipe's config function]; argv[2], if given, a recipe.py to run as a
script up to its config (``as_script``: its SystemExit code, or "ran" when it got to the
training imports). Prints one JSON object: ``results`` (name -> "ok" or
"<exception type>: <message>"), ``built`` (name -> what the validated config says about how it
starts, its data and its length: ``BUILT``'s attributes), ``as_script`` and ``te_calls``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import bridge_te_stub

# What a stage's validated ConfigContainer says about its chain, data and length.
BUILT = (
    "checkpoint.load",
    "checkpoint.pretrained_checkpoint",
    "checkpoint.dist_ckpt_optim_fully_reshardable",
    "scheduler.override_opt_param_scheduler",
    "scheduler.lr_decay_iters",
    "scheduler.lr_warmup_iters",
    "train.train_iters",
    "model.seq_length",
    "model.calculate_per_token_loss",
    "dataset.packed_sequence_specs.packed_sequence_size",
)
BUILT_CONFIGS: dict[str, dict[str, Any]] = {}


def _read(config: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        config = getattr(config, name, None)
    return config if config is None or isinstance(config, bool | int | float) else str(config)


def validate_recipe(
    name: str, recipe: Path, world_size: int, kwargs: dict[str, Any] | None = None
) -> str:
    """ "ok" once the recipe's ConfigContainer passes validate(); else the error, on one line."""
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        spec = importlib.util.spec_from_file_location(f"recipe_{name}", recipe)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        (build,) = [
            v
            for k, v in vars(module).items()
            if k.endswith(("_pretrain_config", "_finetune_config"))
        ]
        config = build(**(kwargs or {}))
        config.validate()
    except Exception as exc:  # reported to the test, which says what it expected
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    BUILT_CONFIGS[name] = {field: _read(config, field) for field in BUILT}
    BUILT_CONFIGS[name]["dataset"] = type(config.dataset).__name__
    return "ok"


def run_as_script(recipe: Path) -> str:
    """What ``python recipe.py`` exits with when building the config fails."""
    try:
        runpy.run_path(str(recipe), run_name="__main__")
    except SystemExit as exc:
        return str(exc.code)
    except ImportError:  # past the config: the training imports (modelopt) need a GPU install
        pass
    return "ran"


def main() -> None:
    bridge_te_stub.install()
    warnings.simplefilter("ignore")  # megatron-core warns about the missing TE/Apex kernels
    results = {
        name: validate_recipe(name, Path(path), world_size, *rest)
        for name, path, world_size, *rest in json.loads(sys.argv[1])
    }
    report = {"bridge": version("megatron-bridge"), "results": results, "built": BUILT_CONFIGS}
    if len(sys.argv) > 2:
        report["as_script"] = run_as_script(Path(sys.argv[2]))
    print(json.dumps(report | {"te_calls": bridge_te_stub.CALLS}))


if __name__ == "__main__":
    main()
