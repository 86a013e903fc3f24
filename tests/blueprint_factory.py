"""A small valid blueprint for rule tests, and ``make`` to bend one value of it.

The base uses every layer type (so no section is unused), keeps every
divisibility comfortable, and aligns the Mamba in_proj width to 16
(2*256 + 2*2*16 + 16 = 592) so that low-precision recipes are valid on it.
"""

from __future__ import annotations

import copy
from typing import Any

from factory.checks import RULES, Finding
from factory.schemas import Blueprint

__all__ = ["BASE", "DELETE", "assert_fires", "findings", "make"]

DELETE = object()
"""Pass as a value to remove a key from the base."""

BASE: dict[str, Any] = {
    "meta": {"name": "tiny"},
    "model": {
        "pattern": "M*ME-M*ME",
        "hidden_size": 256,
        "vocab_size": 4096,
        "max_seq_len": 4096,
        "attention": {"heads": 8, "kv_heads": 2, "head_dim": 32},
        "mamba": {"heads": 16, "head_dim": 16, "state_size": 16, "groups": 2},
        "mlp": {"intermediate_size": 512},
        "moe": {
            "num_experts": 8,
            "top_k": 2,
            "expert_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        },
    },
    "parallelism": {"world_size": 8, "global_batch_size": 16},
    "data": {"recipe": "nano", "seq_len": 1024, "tokens": "1B"},
    "training": {"optimizer": {"lr": 3e-4}, "steps": 100},
}


def make(**overrides: Any) -> Blueprint:
    """The base blueprint with values replaced by dotted path.

    ``make(**{"parallelism.tp": 2})`` or ``make(parallelism__tp=2)``; a value of
    ``DELETE`` removes the key. Missing intermediate sections are created.
    """
    data = copy.deepcopy(BASE)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.replace("__", ".").split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return Blueprint.model_validate(data)


def findings(rule_name: str, bp: Blueprint) -> list[Finding]:
    """What one registered rule says about ``bp`` (``factory.checks`` registers them all)."""
    return list(RULES[rule_name].check(bp))


def assert_fires(
    rule_name: str,
    bp: Blueprint,
    path: str,
    *numbers: object,
    severity: str = "error",
) -> Finding:
    """Assert ``rule_name`` blames ``path`` with a message naming every number; return it."""
    found = [f for f in findings(rule_name, bp) if f.path == path]
    assert found, f"{rule_name} did not blame {path}: {findings(rule_name, bp)}"
    finding = found[0]
    assert finding.severity == severity, finding
    for number in numbers:
        assert str(number) in finding.message, (number, finding.message)
    return finding
