"""A Megatron-Bridge run's ``recipe.py``, ``overrides.yaml`` and ``launch.sh``, torch-free.

``recipe_source`` renders ``recipe.py`` from a :class:`RecipeShape`: the one-run recipe of a
blueprint (``RecipeShape.single``, what ``factory.exports.megatron`` writes) or a stage's of a
program (``factory.exports.megatron_program``). Every value comes from
``megatron_fields``; the keywords no blueprint field decides are ``EXTRA_KEYWORDS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from factory.exports.megatron_fields import (
    BRIDGE_COMMIT,
    MEGATRON_CORE_VERSION,
    PROVIDER_FIELDS_SINCE,
    SECTIONS,
    Call,
    Ref,
    fields,
    megatron_fields,
)
from factory.schemas.blueprint import Blueprint

__all__ = [
    "EXTRA_KEYWORDS",
    "RecipeShape",
    "launch_sh",
    "overrides_yaml",
    "recipe_source",
]

# Fields the recipe sets that no blueprint field decides: paths, logging, data split. Listed
# in docs/megatron.md beside the mapping; the tests allow exactly these beyond fields().
EXTRA_KEYWORDS: dict[str, dict[str, str]] = {
    # GPTDatasetConfig.finalize() asserts the three document flags are set; False keeps
    # Megatron's pretraining behaviour (documents concatenated, EOD tokens trained on).
    "dataset": {
        "blend": "(data_paths, None)",
        "split": '"99990,8,2"',
        "reset_position_ids": "False",
        "reset_attention_mask": "False",
        "eod_mask_loss": "False",
    },
    "checkpoint": {
        "save": "checkpoint_dir",
        "load": "checkpoint_dir",
        "ckpt_format": '"torch_dist"',
    },
    "tokenizer": {"tokenizer_type": '"HuggingFaceTokenizer"', "tokenizer_model": "tokenizer"},
    "logger": {"log_interval": "10"},
    "dist": {},
}
_EXTRA_CLASSES = {
    "tokenizer": ("megatron.bridge.training.config", "TokenizerConfig"),
    "logger": ("megatron.bridge.training.config", "LoggerConfig"),
    "dist": ("megatron.bridge.training.config", "DistributedInitConfig"),
}
_GPUS_PER_NODE = {"gb200": 4, "gb300": 4}  # NVL72 compute trays hold 4 GPUs; HGX nodes 8


def _py(value: Any) -> str:
    if isinstance(value, Call):
        name = value.path.rsplit(".", 1)[-1]
        return f"{name}(str(Path(__file__).with_name({value.file!r})))"
    if isinstance(value, Ref):
        return value.path.rsplit(".", 1)[-1] if value.path.startswith("megatron") else value.path
    return repr(value)


def _yaml_value(value: Any) -> Any:
    # Bridge's OmegaConf round trip names callables and dtypes by import path.
    if isinstance(value, Ref):
        return {"_target_": value.path, "_call_": False}
    if isinstance(value, Call):  # the file is resolved against the working directory
        return {"_target_": value.path, "recipe_path": value.file}
    return value


def _func_name(bp: Blueprint) -> str:
    return re.sub(r"\W", "_", bp.meta.name).strip("_").lower() + "_pretrain_config"


def _data_path(bp: Blueprint) -> str:
    # factory's data pipeline writes <out>/megatron/<recipe name>.{bin,idx}.
    name = Path(bp.data.recipe).stem
    return f"data/{name}/megatron/{name}"


def _call(cls: str, kwargs: dict[str, str], indent: str) -> str:
    if not kwargs:
        return f"{cls}()"
    inner = "".join(f"{indent}    {k}={v},\n" for k, v in kwargs.items())
    return f"{cls}(\n{inner}{indent})"


_PROVIDER_IMPORT = """\
try:  # Megatron-Bridge 0.6 and later
    from {module} import {cls}
except ImportError:  # 0.3 to 0.5: the same provider (same defaults) before its rename
    from megatron.bridge.models.mamba.mamba_provider import MambaModelProvider

    def {cls}(**fields: Any) -> MambaModelProvider:
        \"\"\"MambaModelProvider under 0.6's names; 0.3 calls the pattern hybrid_override_pattern.\"\"\"
        known = {{f.name for f in dataclasses.fields(MambaModelProvider)}}
        if "hybrid_layer_pattern" not in known:
            fields["hybrid_override_pattern"] = fields.pop("hybrid_layer_pattern")
        lacking = [name for name in _NEWER if name in fields and name not in known]
        if lacking:
            raise ImportError(_too_old(lacking))
        return MambaModelProvider(**fields)


def _too_old(lacking: list[str]) -> str:
    \"\"\"One line: the fields the installed packages lack, and the releases that have them.\"\"\"
    needs = ", ".join(f"{{name}} ({{_NEWER[name][0]}})" for name in lacking)
    wants: dict[str, str] = {{}}
    for _, package, release in (_NEWER[name] for name in lacking):
        wants[package] = max(wants.get(package, release), release, key=_release)
    installed = "Megatron-Bridge {{}} with megatron-core {{}}".format(
        version("megatron-bridge"), version("megatron-core")
    )
    install = " and ".join(f"{{package}} >= {{release}}" for package, release in wants.items())
    return f"{{installed}} has no {{needs}}, which this blueprint needs; install {{install}}"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))"""


def _provider_import(bp: Blueprint) -> str:
    """The model provider's import: Bridge 0.6+'s class, else 0.3-0.5's under its names.

    0.6 renamed MambaModelProvider to HybridModelProvider (MambaModelProvider is a wrapper of it
    there); NemotronHModelProvider is not the fallback: it adds Nemotron-H defaults the
    blueprint did not ask for (first_last_layers_bf16, MoE router settings) and left in 0.5.

    ``_NEWER`` lists the provider fields this recipe sets that an older Bridge or megatron-core
    may lack: the blueprint path that asks for each, and the first release that has it.
    """
    used = megatron_fields(bp)["model"]
    newer = {
        row.name: (row.blueprint, *PROVIDER_FIELDS_SINCE[row.name])
        for row in fields()
        if row.section == "model" and row.name in used and row.name in PROVIDER_FIELDS_SINCE
    }
    module, cls = SECTIONS["model"]
    table = "".join(f"    {name!r}: {where!r},\n" for name, where in newer.items())
    return (
        "# Provider fields older releases lack: blueprint path, package, first release with it.\n"
        f"_NEWER: dict[str, tuple[str, str, str]] = {{\n{table}}}\n"
        + _PROVIDER_IMPORT.format(module=module, cls=cls)
    )


@dataclass(frozen=True)
class RecipeShape:
    """What ``recipe.py`` holds around the field values: the one-stage recipe's (``single``),
    or a stage's of a program (``factory.exports.megatron_program``)."""

    func_name: str
    summary: str
    """The module docstring's first line, after "Megatron-Bridge "."""
    fields: dict[str, dict[str, Any]]
    keywords: dict[str, dict[str, str]]
    """Per section, the keywords no blueprint field decides (source text)."""
    classes: dict[str, tuple[str, str]]
    """Per ConfigContainer section, the class it is built from (module, class)."""
    params: tuple[str, ...]
    """The config function's parameters (source text)."""
    prologue: tuple[str, ...]
    """The config function's first lines (source text)."""
    doc: str
    helpers: str = ""
    """Functions written after ``_mixed_precision`` (source text)."""
    imports: tuple[tuple[str, str], ...] = ()
    """Names beyond the section classes' (module, name)."""
    entry: Literal["pretrain", "finetune"] = "pretrain"
    """Bridge's entry point that ``python recipe.py`` runs."""

    @classmethod
    def single(cls, bp: Blueprint) -> RecipeShape:
        """The recipe of a blueprint trained in one run."""
        return cls(
            func_name=_func_name(bp),
            summary=f"pretraining recipe for {bp.meta.name}",
            fields=megatron_fields(bp),
            keywords=EXTRA_KEYWORDS,
            classes={**SECTIONS, **_EXTRA_CLASSES},
            params=(
                "data_paths: list[str] | None = None",
                f'checkpoint_dir: str = "checkpoints/{bp.meta.name}"',
                f"tokenizer: str = {bp.meta.hf_id or 'tokenizer'!r}",
            ),
            prologue=(f"data_paths = data_paths or [{_data_path(bp)!r}]",),
            doc=f"The ConfigContainer of blueprint {bp.meta.name!r}; data_paths are "
            "indexed-dataset prefixes.",
        )


_ENTRY_MODULES = {
    "pretrain": "megatron.bridge.training.pretrain",
    "finetune": "megatron.bridge.training.finetune",
}


def recipe_source(bp: Blueprint, shape: RecipeShape | None = None) -> str:
    """The text of ``recipe.py`` (``shape``: the one-stage recipe's unless given)."""
    shape = shape or RecipeShape.single(bp)
    fields = shape.fields
    imports: dict[str, set[str]] = {}
    for section, (module, cls) in shape.classes.items():
        if section != "model":  # _provider_import chooses the provider's module
            imports.setdefault(module, set()).add(cls)
    imports.setdefault("dataclasses", set())
    imports.setdefault("importlib.metadata", set()).add("version")
    imports.setdefault("typing", set()).add("Any")
    imports.setdefault("megatron.bridge.training.config", set()).add("ConfigContainer")
    imports[SECTIONS["mixed_precision"][0]].add("get_mixed_precision_config")
    for module, name in shape.imports:
        imports.setdefault(module, set()).add(name)
    for value in fields["model"].values():
        if isinstance(value, Call):
            imports.setdefault("pathlib", set()).add("Path")
        if isinstance(value, Ref | Call) and value.path.startswith("megatron"):
            module, name = value.path.rsplit(".", 1)
            imports.setdefault(module, set()).add(name)
    uses_torch = any(
        isinstance(v, Ref) and v.path.startswith("torch") for v in fields["model"].values()
    )
    head = ("import torch\n" if uses_torch else "") + "\n".join(
        f"from {module} import {', '.join(sorted(names))}" if names else f"import {module}"
        for module, names in sorted(imports.items())
    )
    head += "\n\n" + _provider_import(bp)
    sections = []
    for section, (_, cls) in shape.classes.items():
        if section == "mixed_precision":
            sections.append("        mixed_precision=_mixed_precision(),")
            continue
        kwargs = {k: _py(v) for k, v in fields.get(section, {}).items()}
        kwargs |= shape.keywords.get(section, {})
        sections.append(f"        {section}={_call(cls, kwargs, '        ')},")
    name = shape.func_name
    precision = fields["mixed_precision"]
    sets = "".join(f"    cfg.{k} = {_py(v)}\n" for k, v in precision.items() if k != "name")
    params = "".join(f"    {param},\n" for param in shape.params)
    prologue = "".join(f"    {line}\n" for line in shape.prologue)
    entry = shape.entry
    return f'''"""Megatron-Bridge {shape.summary}, written by `factory export megatron`.

Every value comes from the blueprint (mapping: docs/megatron.md in nemotron-factory).
Checked against megatron-core {MEGATRON_CORE_VERSION} and Megatron-Bridge {BRIDGE_COMMIT[:7]}.
"""

{head}


def _mixed_precision() -> MixedPrecisionConfig:
    """Bridge's {precision["name"]} preset with the blueprint's values.

    MixedPrecisionConfig.setup() copies its fields onto the model, so they are set here.
    """
    cfg = get_mixed_precision_config({precision["name"]!r})
{sets}    return cfg
{shape.helpers}

def {name}(
{params}) -> ConfigContainer:
    """{shape.doc}"""
{prologue}    return ConfigContainer(
{chr(10).join(sections)}
    )


if __name__ == "__main__":
    import sys

    try:  # first, so a Bridge too old for the blueprint says so before the training imports
        config = {name}()
    except ImportError as exc:  # the installed Megatron-Bridge lacks a field the blueprint needs
        sys.exit(f"{{__file__}}: {{exc}}")

    from megatron.bridge.training.gpt_step import forward_step
    from {_ENTRY_MODULES[entry]} import {entry}

    {entry}(config, forward_step)
'''


def overrides_yaml(bp: Blueprint, fields: dict[str, dict[str, Any]] | None = None) -> str:
    """``overrides.yaml``: the recipe's blueprint-derived values (``fields``: those of
    :func:`megatron_fields` unless given) as OmegaConf YAML."""
    fields = fields or megatron_fields(bp)
    doc: dict[str, Any] = {}
    for section, values in fields.items():
        # The preset name is no MixedPrecisionConfig field: it is recipe.py's starting point.
        doc[section] = {k: _yaml_value(v) for k, v in values.items() if k != "name"}
    header = (
        f"# Megatron-Bridge overrides for {bp.meta.name} (factory export megatron).\n"
        f"# Same values as recipe.py; megatron-core {MEGATRON_CORE_VERSION}, "
        f"Megatron-Bridge {BRIDGE_COMMIT[:7]}.\n"
        f"# mixed_precision: fields set on Bridge's {fields['mixed_precision']['name']} preset.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False)


def launch_sh(bp: Blueprint) -> str:
    """``launch.sh``: torchrun on one node or per node, srun under Slurm."""
    par = bp.parallelism
    per_node = min(_GPUS_PER_NODE.get(par.gpu, 8), par.world_size)
    nodes = -(-par.world_size // per_node)
    layout = (
        f"tp={par.tp} pp={par.pp} cp={par.cp} ep={par.ep} etp={par.expert_tp} "
        f"sp={par.sequence_parallel}"
    )
    return f"""#!/usr/bin/env bash
# {bp.meta.name}: {par.world_size} {par.gpu} GPUs = {nodes} node(s) x {per_node}; {layout}
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
NODES="${{NODES:-{nodes}}}"
GPUS_PER_NODE="${{GPUS_PER_NODE:-{per_node}}}"
if [ -n "${{SLURM_JOB_ID:-}}" ]; then
  srun --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE" \\
    python "$HERE/recipe.py" "$@"
else
  torchrun --nnodes="$NODES" --nproc-per-node="$GPUS_PER_NODE" --node-rank="${{NODE_RANK:-0}}" \\
    --master-addr="${{MASTER_ADDR:-localhost}}" --master-port="${{MASTER_PORT:-29500}}" \\
    "$HERE/recipe.py" "$@"
fi
"""
