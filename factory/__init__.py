"""factory: blueprints in, training graphs, plans, exports and data shards out.

The pipeline reads top to bottom: ``factory.schemas`` types a blueprint,
``factory.loading`` composes and validates it, ``factory.checks`` applies the
cross-field rules, and ``factory.planner`` counts parameters, FLOPs and memory.

``import factory`` stays light (no torch): ``validate``, ``plan`` and
``schema`` run on machines without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["BlueprintError", "compile", "load_blueprint", "plan"]

if TYPE_CHECKING:
    from factory.errors import BlueprintError
    from factory.graph.compile import compile
    from factory.loading.load import load_blueprint
    from factory.planner.plan import plan

# Public names resolve on first use so that `import factory` imports neither
# pydantic-heavy schemas nor, later, torch.
_LAZY = {
    "BlueprintError": "factory.errors",
    "compile": "factory.graph.compile",
    "load_blueprint": "factory.loading.load",
    "plan": "factory.planner.plan",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'factory' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
