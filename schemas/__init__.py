"""Typed blueprint sections, importable as ``factory.schemas``.

Each section is a frozen pydantic model that rejects unknown keys. Field-level
constraints live here; rules that span sections (TP against heads, EP against
experts, world-size factorisations) live in ``factory.checks``, which names
every rule it enforces.
"""

from factory.schemas.blueprint import Blueprint, Meta
from factory.schemas.data import DataConfig
from factory.schemas.model import (
    AttentionConfig,
    InitConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RouterConfig,
)
from factory.schemas.parallelism import ModuleLayout, ParallelismConfig
from factory.schemas.pattern import HybridPattern, PatternError
from factory.schemas.precision import PrecisionConfig
from factory.schemas.training import TrainingConfig

__all__ = [
    "AttentionConfig",
    "Blueprint",
    "DataConfig",
    "HybridPattern",
    "InitConfig",
    "MLPConfig",
    "MTPConfig",
    "MambaConfig",
    "Meta",
    "MoEConfig",
    "ModelConfig",
    "ModuleLayout",
    "ParallelismConfig",
    "PatternError",
    "PrecisionConfig",
    "RouterConfig",
    "TrainingConfig",
]
