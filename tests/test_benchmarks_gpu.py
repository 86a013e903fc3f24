"""``python -m benchmarks gpu``: its dry run (CPU, tiny sizes, Triton interpreter) keeps the GPU
command working between the rare sessions that have a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("triton") is None and not (
    sys.platform == "linux" or "CI" in os.environ
):
    pytest.skip("triton is a dev dependency on Linux only", allow_module_level=True)


def _benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "gpu", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_dry_run_measures_every_kernel_and_checks_it_bit_for_bit(tmp_path: Path) -> None:
    done = _benchmark("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["dry_run"] is True
    kernels = results["kernel_bandwidth"]
    assert {k["case"] for k in kernels} >= {"nvfp4 quantize", "nvfp4 fake-quant to bf16"}
    for kernel in kernels:
        assert kernel["bit_exact"] is True
        assert kernel["shape"] == [64, 64] and kernel["bytes_moved"] > 64 * 64
        assert kernel["seconds"] > 0 and kernel["share_of_hbm_peak"] is None
    table = (tmp_path / "results.md").read_text(encoding="utf-8")
    assert "| nvfp4 quantize | 64x64 bf16 |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_the_real_run_says_so(tmp_path: Path) -> None:
    done = _benchmark("--out", str(tmp_path))
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr
