"""factory: blueprints in, training graphs, plans, exports and data shards out.

The pipeline reads top to bottom: ``factory.schemas`` types a blueprint,
``factory.loading`` composes and validates it, ``factory.checks`` applies the
cross-field rules, and ``factory.planner`` counts parameters, FLOPs and memory.
The jobs the CLI runs are library calls (``factory.jobs``)::

    bp = factory.load_blueprint("nano")
    factory.build(bp, out=Path("build/nano"))          # plan, reports and data/
    factory.train(bp, proxy=True, out=Path("runs/p"))  # train.json, model/, data/
    factory.data.build("nano", Path("data/nano"))      # curated shards only

``import factory`` stays light (no torch): ``validate``, ``plan`` and
``schema`` run on machines without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from factory.lazy import lazy_getattr

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
    from factory.jobs.train import TrainRefused, TrainResult, train
    from factory.planner.plan import plan

# Public names resolve on first use so that `import factory` imports neither
# pydantic-heavy schemas nor, later, torch.
_LAZY = {
    "BlueprintError": "factory.errors",
    "BuildFailed": "factory.jobs.build",
    "BuildResult": "factory.jobs.build",
    "TrainRefused": "factory.jobs.train",
    "TrainResult": "factory.jobs.train",
    "build": "factory.jobs.build",
    "compile": "factory.compilation",
    "data": "factory",  # the subpackage itself: ``factory.data.build``
    "export_hf": "factory.exports.hf",
    "load_blueprint": "factory.checks.validate",
    "plan": "factory.planner.plan",
    "train": "factory.jobs.train",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
