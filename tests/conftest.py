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
