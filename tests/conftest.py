"""Shared fixtures: blueprint files written into a temporary folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from factory.cli.app import main

if not Path("/dev/nvidiactl").exists():
    # Without a GPU, Triton kernels run only in its interpreter. Triton decides between
    # interpreted and compiled when a @triton.jit function is defined, its own library's
    # (tl.max, tl.sum ...) included, at `import triton`; torch.compile imports triton long
    # before the kernel tests run, so the choice is made here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Under pytest-xdist (README's test command: -n auto) the workers share the machine's
    # cores; each takes its share of intra-op threads (torch and the processes a test starts
    # read OMP_NUM_THREADS when they start), not one thread per core each, which
    # oversubscribes the cores. No test module has imported torch yet.
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_cores or 1) // _workers)))

REPO = Path(__file__).resolve().parent.parent
PRESETS = REPO / "blueprints"


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a YAML file into tmp_path and return its path."""

    def write(text: str, name: str = "bp.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run the factory CLI in-process; returns (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        status = main(list(args))
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run
