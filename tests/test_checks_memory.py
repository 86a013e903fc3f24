"""The memory-fit warning, on Nano's pretraining (its phase 1 alone) squeezed onto fewer
GPUs."""

from __future__ import annotations

from pathlib import Path

from preset_stages import stage_alone

import factory
from factory.checks.memory_rules import fits_in_memory

SQUEEZED = ["parallelism.world_size=8", "parallelism.tp=1", "parallelism.sequence_parallel=false"]


def test_warns_when_the_peak_rank_outgrows_the_gpu(tmp_path: Path) -> None:
    nano = stage_alone("nano", "phase1", tmp_path)
    (finding,) = fits_in_memory(factory.load_blueprint(nano, SQUEEZED))
    assert finding.severity == "warning"
    assert finding.path == "parallelism.world_size"
    assert "GiB" in finding.message and "h100 has 80 GiB" in finding.message


def test_a_bigger_gpu_makes_it_fit(tmp_path: Path) -> None:
    nano = stage_alone("nano", "phase1", tmp_path)
    bp = factory.load_blueprint(nano, [*SQUEEZED, "parallelism.gpu=b300"])
    assert list(fits_in_memory(bp)) == []


def test_presets_fit() -> None:
    assert list(fits_in_memory(factory.load_blueprint("super"))) == []
