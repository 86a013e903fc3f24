"""A process that hosted a rank ends at once with its status and its output flushed; any
other process ends normally (``factory.rank_process``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import atexit, sys
from pathlib import Path
from factory.rank_process import end_if_rank_process, mark_rank_process

atexit.register(lambda: Path(sys.argv[1]).write_text("teardown ran"))
print("written before the end", end="")  # a pipe: block-buffered, not yet flushed
if sys.argv[2] == "rank":
    mark_rank_process()
end_if_rank_process(3)
sys.exit(0)
"""


@pytest.mark.parametrize("kind", ["rank", "plain"])
def test_a_rank_process_ends_at_once_and_others_end_normally(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "teardown"
    child = subprocess.run([sys.executable, "-c", CHILD, str(marker), kind],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert child.stdout == "written before the end"
    if kind == "rank":
        assert (child.returncode, marker.exists()) == (3, False)
    else:
        assert (child.returncode, marker.read_text()) == (0, "teardown ran")


def test_the_cli_of_a_rank_process_ends_with_its_status(tmp_path: Path) -> None:
    """``factory.cli.app.main`` hands its status to the early end: a refusal's 2 survives."""
    script = (
        "import sys\n"
        "from factory.rank_process import mark_rank_process\n"
        "from factory.cli.app import main\n"
        "mark_rank_process()\n"
        "main(['validate', sys.argv[1]])\n"
        "sys.exit(0)\n"
    )
    missing = tmp_path / "missing.yaml"
    child = subprocess.run([sys.executable, "-c", script, str(missing)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert child.returncode == 2, child.stderr
    assert "missing.yaml" in child.stderr
