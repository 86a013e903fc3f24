"""The rule modules are listed in ``factory/checks/__init__.py``: none is left out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import factory.checks

SCRIPT = """
import json
from factory.checks.registry import PROGRAM_RULES, RULES
rules = [*RULES.values(), *PROGRAM_RULES.values()]
print(json.dumps(sorted({r.check.__module__ for r in rules})))
"""


def test_importing_the_registry_registers_every_rule_module() -> None:
    folder = Path(factory.checks.__file__).parent
    modules = sorted(f"factory.checks.{p.stem}" for p in folder.glob("*_rules.py"))
    # A fresh process: nothing but the registry module is imported.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == modules


def test_the_package_reexports_the_registry() -> None:
    from factory.checks import registry

    assert factory.checks.RULES is registry.RULES
    assert factory.checks.run_rules is registry.run_rules
