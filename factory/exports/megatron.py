"""``factory export megatron``: a Megatron-Bridge pretraining recipe from a blueprint, torch-free.

Writes ``recipe.py`` (a ``<name>_pretrain_config()`` returning a Bridge
``ConfigContainer``), ``overrides.yaml`` (the same values as OmegaConf YAML),
``launch.sh`` (torchrun and srun), ``hf/config.json`` (``hf_config``) and a
``README.md`` that lists everything Megatron does not carry. Every value comes
from ``megatron_fields.fields()``; what cannot be expressed is refused
(``megatron_refusals``) unless the caller allows it, and then it is listed. The files are
rendered by ``megatron_recipe``. A blueprint with ``stages`` gets one such folder per stage,
chained by checkpoint (``megatron_program``).

Data comes as Megatron indexed datasets (``.bin``/``.idx`` prefixes, ``GPTDatasetConfig``).
An Energon folder is refused: Bridge's only Energon dataset config (``EnergonDatasetConfig``
in ``megatron/bridge/data/builders/energon.py`` at ``BRIDGE_COMMIT``) takes one of three
vision-language task encoders that read ``ChatMLSample`` through a Hugging Face processor,
not the text samples ``factory data`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml

from factory.exports.hf_config import ExportError, hf_config
from factory.exports.megatron_fields import (
    BRIDGE_COMMIT,
    MEGATRON_CORE_VERSION,
    SECTIONS,
    fields,
    megatron_fields,
)
from factory.exports.megatron_program import write_program
from factory.exports.megatron_recipe import (
    EXTRA_KEYWORDS,
    RecipeShape,
    _data_path,
    _func_name,
    launch_sh,
    overrides_yaml,
    recipe_source,
)
from factory.exports.megatron_refusals import MegatronExportError, not_carried, refusals
from factory.exports.quant_recipe import QUANT_RECIPE_FILE, megatron_quant_recipe
from factory.io import staged_directory
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program

__all__ = [
    "DATA_FORMATS",
    "EXTRA_KEYWORDS",
    "MegatronExportError",
    "RecipeShape",
    "export_megatron",
    "launch_sh",
    "overrides_yaml",
    "recipe_source",
]

DATA_FORMATS = ("megatron", "energon")
ENERGON_REFUSAL = (
    "Megatron-Bridge's EnergonDatasetConfig (data/builders/energon.py) accepts only its "
    "vision-language task encoders (ChatMLSample through a Hugging Face processor); export "
    "with data_format='megatron' and build the .bin/.idx prefixes with `factory data`"
)


def readme(bp: Blueprint, unexpressed: list[tuple[str, str]], hf_note: str) -> str:
    lines = [
        f"# {bp.meta.name}: Megatron-Bridge export",
        "",
        f"Written by `factory export megatron`; megatron-core {MEGATRON_CORE_VERSION}, "
        f"Megatron-Bridge {BRIDGE_COMMIT[:7]}.",
        "",
        f"- `recipe.py`: `{_func_name(bp)}()` returns the ConfigContainer; run as a script it "
        "pretrains.",
        "- `overrides.yaml`: the same blueprint-derived values as OmegaConf YAML.",
        "- `launch.sh`: torchrun (set NODES, NODE_RANK, MASTER_ADDR) or srun under Slurm.",
        f"- `hf/`: {hf_note}",
        f"- data: indexed-dataset prefix `{_data_path(bp)}` from `factory data` (recipe "
        f"{bp.data.recipe!r}); pass others as `data_paths`.",
        "",
        "## Not expressed in Megatron (refused unless --allow-unexpressed)",
        "",
    ]
    lines += [f"- `{p}`: {why}" for p, why in unexpressed] or ["- none"]
    lines += ["", "## Not carried (factory runtime only)", ""]
    lines += [f"- `{p}`: {why}" for p, why in not_carried(bp)]
    return "\n".join(lines) + "\n"


def export_megatron(
    bp: Blueprint,
    out: Path,
    allow_unexpressed: bool = False,
    data_format: Literal["megatron", "energon"] = "megatron",
) -> Path:
    """Write the recipe folder ``out`` atomically (for a blueprint with ``stages``, one per
    stage: ``megatron_program``); raises MegatronExportError for refusals.

    ``data_format="energon"`` is always refused (see the module docstring), whatever
    ``allow_unexpressed`` says: there is no Bridge config to write for it.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, not {data_format!r}")
    if data_format == "energon":
        raise MegatronExportError([("data_format", ENERGON_REFUSAL)])
    program = resolve_program(bp)
    if program.declared:
        return write_program(bp, program, out, allow_unexpressed)
    unexpressed = refusals(bp)
    if unexpressed and not allow_unexpressed:
        raise MegatronExportError(unexpressed)
    try:
        hf = hf_config(bp, dtype="bfloat16")
        hf_note = "`config.json` for Hugging Face NemotronH (`factory export hf` adds weights)."
    except ExportError as exc:
        hf, hf_note = None, f"not written: {exc}"
    with staged_directory(out) as tmp:
        (tmp / "recipe.py").write_text(recipe_source(bp))
        (tmp / "overrides.yaml").write_text(overrides_yaml(bp))
        (tmp / "launch.sh").write_text(launch_sh(bp))
        (tmp / "launch.sh").chmod(0o755)
        (tmp / "README.md").write_text(readme(bp, unexpressed, hf_note))
        if "quant_recipe" in megatron_fields(bp)["model"]:
            document = megatron_quant_recipe(bp).document
            (tmp / QUANT_RECIPE_FILE).write_text(yaml.safe_dump(document, sort_keys=False))
        if hf is not None:
            (tmp / "hf").mkdir()
            (tmp / "hf" / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def mapping_markdown() -> str:
    """The mapping table of ``docs/megatron.md`` (``megatron_fields.fields()``, row by row)."""
    rows = ["| blueprint | section | Megatron field | checked against |", "|---|---|---|---|"]
    where = {
        "config": f"megatron-core {MEGATRON_CORE_VERSION} TransformerConfig",
        "model": f"megatron-core {MEGATRON_CORE_VERSION} MambaModel",
        "provider": f"Megatron-Bridge {BRIDGE_COMMIT[:7]} HybridModelProvider",
    }
    for f in fields():
        if f.kind == "container":
            cls = "preset name" if f.name == "name" else SECTIONS[f.section][1]
            target = f"Megatron-Bridge {BRIDGE_COMMIT[:7]} {cls}"
        else:
            target = where[f.kind] + (f" (`{f.mcore}`)" if f.mcore and f.mcore != f.name else "")
        rows.append(f"| `{f.blueprint}` | {f.section} | `{f.name}` | {target} |")
    return "\n".join(rows) + "\n"
