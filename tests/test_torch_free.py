"""`import factory`, validate, plan and schema must work without importing torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, tempfile
import factory
from factory.cli.app import main
assert main(["validate", "--quiet"]) == 0
assert main(["plan", "super", "--json"]) == 0
assert main(["schema", "--out", tempfile.mkdtemp()]) == 0
factory.plan(factory.load_blueprint("ultra"))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "numpy", "transformers"})
assert not heavy, heavy
"""


def test_validate_plan_schema_import_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
