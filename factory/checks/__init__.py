"""Cross-field rules: every rule module is imported here, so importing ``factory.checks``
registers them all, and :func:`run_rules` runs them.

Add a rule module by importing it below (alphabetical order is the order rules
register, run and report in). The registry itself (``factory.checks.registry``)
imports no rule module; the rule modules import it.
"""

from __future__ import annotations

from factory.checks import (
    data_rules,
    memory_rules,
    model_rules,
    parallel_rules,
    precision_rules,
    program_rules,
    runtime_rules,
    training_rules,
)
from factory.checks.registry import (
    PROGRAM_RULES,
    RULES,
    Finding,
    ProgramRule,
    Rule,
    program_rule,
    rule,
    run_rules,
)

__all__ = [
    "PROGRAM_RULES",
    "RULES",
    "Finding",
    "ProgramRule",
    "Rule",
    "data_rules",
    "memory_rules",
    "model_rules",
    "parallel_rules",
    "precision_rules",
    "program_rule",
    "program_rules",
    "rule",
    "run_rules",
    "runtime_rules",
    "training_rules",
]
