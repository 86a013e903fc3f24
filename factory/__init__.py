"""factory: blueprints in, training graphs, plans, exports and data shards out.

A blueprint (YAML) describes one model of the Nemotron 3 family: its hybrid
Mamba-Transformer MoE architecture, precision policy, parallel layout and data
recipe. The pipeline reads top to bottom: ``factory.schemas`` types a blueprint,
``factory.loading`` composes and validates it, ``factory.checks`` applies the
cross-field rules, and ``factory.planner`` counts parameters, FLOPs and memory.
Every job the CLI runs is a library call::

    bp = factory.load_blueprint("nano")
    factory.plan(bp)                                     # parameters, FLOPs, memory, cost
    factory.build(bp, out=Path("build/nano"))           # every stage, one report page
    factory.train(bp, proxy=True, out=Path("runs/p"))   # checkpoints, metrics, model/
    factory.data.build("nano", Path("data/nano"))       # curated shards only

:func:`build` runs validate, plan, the model on the meta device, the precision
table, the HF and Megatron exports, the data, a smoke run of the CPU proxy, a
2-process layout check and a report page, and resumes a build cut short.

Public API (each resolved on first use)::

    load_blueprint   read, compose and validate a blueprint (a preset name or a path)
    plan             exact parameters, FLOPs, memory per rank and cost of a blueprint
    compile          the blueprint's PyTorch model with its precision policy
    build            the whole factory into one folder (BuildResult, BuildFailed)
    train            train a blueprint or its proxy (TrainResult, TrainRefused)
    export_hf        a Hugging Face checkpoint transformers loads
    generate_text    text after prompts from an exported model or a run (MTP speculation)
    data             the data factory: data.build, data.load_recipe
    BlueprintError   a blueprint or recipe that failed validation, with its diagnostics

``import factory`` stays light (no torch): ``validate``, ``plan`` and
``schema`` run on machines without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from factory.lazy import lazy_dir, lazy_getattr

__version__ = "0.1.0"
__all__ = [
    "BlueprintError",
    "BuildFailed",
    "BuildResult",
    "TrainRefused",
    "TrainResult",
    "build",
    "compile",
    "data",
    "export_hf",
    "generate_text",
    "load_blueprint",
    "plan",
    "train",
]

if TYPE_CHECKING:
    from factory import data
    from factory.checks.validate import load_blueprint
    from factory.compilation import compile
    from factory.errors import BlueprintError
    from factory.exports.hf import export_hf
    from factory.jobs.build import BuildFailed, BuildResult, build
    from factory.jobs.generate import generate_text
    from factory.jobs.train import train
    from factory.jobs.train_errors import TrainRefused
    from factory.jobs.train_request import TrainResult
    from factory.planner.plan import plan

# Public names resolve on first use so that `import factory` imports neither
# pydantic-heavy schemas nor, later, torch.
_LAZY = {
    "BlueprintError": "factory.errors",
    "BuildFailed": "factory.jobs.build",
    "BuildResult": "factory.jobs.build",
    "TrainRefused": "factory.jobs.train_errors",
    "TrainResult": "factory.jobs.train_request",
    "build": "factory.jobs.build",
    "compile": "factory.compilation",
    "data": "factory",  # the subpackage itself: ``factory.data.build``
    "export_hf": "factory.exports.hf",
    "generate_text": "factory.jobs.generate",
    "load_blueprint": "factory.checks.validate",
    "plan": "factory.planner.plan",
    "train": "factory.jobs.train",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
