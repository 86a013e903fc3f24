"""The ``training.cluster`` section: what the cluster the run is costed on delivers.

Consumed by ``factory.planner.cost``, which turns the run's exact FLOPs into
GPU-hours, days and energy, and the failure rate into an expected number of
interruptions, the checkpoint interval that loses least time, and the time lost.
Every default is a published number (``docs/cost.md`` cites each); every bound
keeps the planner's floats finite for any blueprint that validates.
"""

from __future__ import annotations

from pydantic import Field

from factory.schemas.base import Section

__all__ = ["LLAMA3_FAILURES_PER_GPU_HOUR", "LLAMA3_WRITE_GB_PER_S_PER_GPU", "ClusterConfig"]

# Llama 3 (arXiv:2407.21783), section 3.3.4: 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100 GPUs. Every interruption counts against the GPUs
# of the job, whatever failed (GPU, HBM, host, network, software), as the job sees it.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (16_384 * 54 * 24)
# Llama 3, section 3.3.1: Tectonic sustains 2 TB/s of throughput for the 16,384-GPU job,
# so each GPU's share of the file system is 2e12 / 16,384 bytes per second.
LLAMA3_WRITE_GB_PER_S_PER_GPU = 2e12 / 16_384 / 1e9


class ClusterConfig(Section):
    """Efficiency, reliability and storage of the cluster, for the plan's cost and failures."""

    mfu: float | None = Field(default=None, ge=0.001, le=1)
    """Model FLOPs utilisation to price the run at, overriding the prediction: achieved / peak
    dense BF16 FLOP/s. Default none: the plan prices the run at the step time the performance
    model predicts for this layout (docs/performance.md). 0.38 is the low end of the 38-43%
    BF16 MFU Llama 3 405B reports on 8K-16K H100s (arXiv:2407.21783, Table 4). At least
    0.001: below that a run is broken, not slow."""
    failures_per_gpu_hour: float = Field(default=LLAMA3_FAILURES_PER_GPU_HOUR, ge=1e-12, le=1)
    """Job interruptions per GPU-hour. Default: Llama 3's 419 interruptions in 54 days on
    16,384 H100s (arXiv:2407.21783, section 3.3.4), about 1.97e-5."""
    restart_minutes: float = Field(default=10.0, ge=0, le=10_080)
    """Downtime per interruption: detection, rescheduling, NCCL set-up, checkpoint load.
    Default 10 minutes, an assumption (docs/cost.md); at most one week."""
    checkpoint_write_gb_per_s_per_gpu: float = Field(
        default=LLAMA3_WRITE_GB_PER_S_PER_GPU, ge=0.001, le=1_000
    )
    """Each GPU's share of the file system's sustained write bandwidth, GB/s (1e9 bytes).
    Default: Llama 3's 2 TB/s for 16,384 GPUs (arXiv:2407.21783, section 3.3.1), 0.122."""
    host_copy_gb_per_s: float = Field(default=64.0, ge=0.1, le=10_000)
    """Device-to-host copy bandwidth per GPU, GB/s: all an asynchronous checkpoint blocks on.
    Default 64, PCIe Gen5 x16 in one direction (the H100 data sheet's 128 GB/s counts both)."""
