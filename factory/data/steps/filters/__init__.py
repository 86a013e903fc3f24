"""The document filters, one module per recipe step ``kind``: this package imports them all.

Each module registers its check with
:func:`factory.data.steps.filter_registry.register_filter`; the loop below
imports every module found here, so a new filter is one new module (and its
section in ``schemas/data_recipe.py``) and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from factory.data.steps.filter_registry import FILTERS
from factory.schemas.data_recipe import FILTER_STEPS

__all__ = ["FILTERS"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

if {family.params for family in FILTERS.values()} != set(FILTER_STEPS):  # pragma: no cover
    raise ImportError(
        "every filter step of schemas/data_recipe.py (FILTER_STEPS) needs a module in "
        "factory/data/steps/filters/ that registers its check, and every module a step"
    )
