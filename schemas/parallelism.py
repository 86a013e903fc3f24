"""The ``parallelism`` section: how ranks are laid out.

Megatron-Core factorises the same ranks twice (MoE parallel folding): dense
layers use TP x CP x DP x PP and MoE layers use ETP x EP x EDP x PP, sharing
only PP. DP and EDP are derived; write them only to assert them. The rules are
in ``factory.checks.parallel_rules``; ``factory.planner.layout`` resolves them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from factory.schemas.base import MAX_WORLD_SIZE, BatchSize, RankCount, Section

__all__ = ["GPU_SPECS", "GPUSpec", "ModuleLayout", "ParallelismConfig"]


class GPUSpec(Section):
    """What the planner needs to know about one accelerator (``docs/performance.md`` cites
    every value)."""

    memory_bytes: int
    """Device memory."""
    nvlink_domain: int
    """GPUs that share one NVLink domain (8 per HGX node, 72 per NVL72 rack)."""
    tdp_watts: float
    """Maximum board power (TDP), for the plan's energy estimate (``factory.planner.cost``)."""
    generation: Literal["hopper", "blackwell"] = "hopper"
    """Tensor-core generation: the performance model fits one GEMM efficiency per generation."""
    dense_flops: dict[str, float]
    """Peak dense tensor-core FLOP/s per GEMM format ('bf16', 'fp8', 'mxfp8', 'nvfp4'), the
    ``peak_format`` a precision recipe names; a format the chip has no tensor cores for is
    absent (factory emulates it: the performance model then runs its GEMMs at the BF16 peak
    and adds the casts, and ``precision.hardware_support`` warns)."""
    hbm_bytes_per_s: float
    """Peak HBM bandwidth, bytes/s."""
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU in one direction, bytes/s (half the data sheet's total)."""
    network_bytes_per_s: float
    """Scale-out network bandwidth per GPU in one direction, bytes/s (one NIC per GPU)."""
    exp_per_s: float
    """Peak rate of the special-function units' exponentials (MUFU.EX2), per second:
    softmax's exponentials run there, beside the tensor cores."""

    @property
    def bf16_dense_flops(self) -> float:
        """Peak dense BF16 tensor-core FLOP/s: what MFU is measured against."""
        return self.dense_flops["bf16"]


GiB = 1024**3
TB = 1e12
# Vendor data-sheet peaks (dense, no sparsity) and maximum board power per GPU:
# - H100 SXM, H200 SXM: 700 W ("up to 700W (configurable)", NVIDIA H100 and H200 data sheets).
# - B200 in HGX B200: 1,000 W; B300 in HGX B300: 1,100 W (NVIDIA HGX B200 / B300 specifications).
# - GB200 and GB300 NVL72 have no per-GPU TDP in a data sheet; NVIDIA gives the GB200 superchip
#   (2 GPUs + 1 Grace CPU) as configurable up to 2,700 W, i.e. 1,200 W per GPU with ~300 W for
#   Grace, the value widely reported for GB200; 1,400 W per GPU is the widely reported GB300
#   value. Both are assumptions (docs/cost.md says so).
# Peaks per format, HBM, NVLink and network (docs/performance.md, 'Hardware', cites each):
# - Hopper (H100/H200 SXM data sheet): 989 TFLOP/s BF16, 1,979 FP8 (dense = half the sparse
#   figure); no MXFP8 or NVFP4 tensor cores. NVLink 4: 900 GB/s per GPU both directions.
#   HBM 3.35 TB/s (H100), 4.8 TB/s (H200). Network: one 400 Gb/s ConnectX-7 per GPU (DGX H100).
# - Blackwell (HGX B200 / B300, GB200 / GB300 NVL72 data sheets, per GPU = system / GPUs,
#   dense = half the sparse figure): MXFP8 runs at the FP8 rate; NVFP4 is 2x FP8 on B200 and
#   GB200, 3x on Blackwell Ultra (B300 108 PFLOPS dense / 8, GB300 1,080 / 72). NVLink 5:
#   1.8 TB/s per GPU both directions; HBM3e 8 TB/s. Network: ConnectX-7 400 Gb/s per GPU on
#   B200 and GB200, ConnectX-8 800 Gb/s on B300 and GB300 (assumed one NIC per GPU).
# - Exponentials (softmax): 16 per SM per clock on Hopper and Blackwell, 32 on Blackwell
#   Ultra (B300, GB300: NVIDIA, "Making Softmax More Efficient with NVIDIA Blackwell Ultra"),
#   against 4,096 dense BF16 tensor FLOPs per SM per clock on Hopper and 8,192 on Blackwell
#   (FlashAttention-4, Together AI): the BF16 peak / 256 (Hopper, Blackwell Ultra) or / 512.
_HOPPER_PEAKS = {"bf16": 989e12, "fp8": 1979e12}
_NVLINK4, _NVLINK5 = 450e9, 900e9  # per direction
_CX7, _CX8 = 400e9 / 8, 800e9 / 8  # bytes/s per direction


def _blackwell_peaks(bf16: float, nvfp4_over_fp8: float) -> dict[str, float]:
    return {"bf16": bf16, "fp8": 2 * bf16, "mxfp8": 2 * bf16, "nvfp4": 2 * bf16 * nvfp4_over_fp8}


GPU_SPECS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        memory_bytes=80 * GiB,
        nvlink_domain=8,
        tdp_watts=700,
        dense_flops=_HOPPER_PEAKS,
        hbm_bytes_per_s=3.35 * TB,
        nvlink_bytes_per_s=_NVLINK4,
        network_bytes_per_s=_CX7,
        exp_per_s=989e12 / 256,
    ),
    "h200": GPUSpec(
        memory_bytes=141 * GiB,
        nvlink_domain=8,
        tdp_watts=700,
        dense_flops=_HOPPER_PEAKS,
        hbm_bytes_per_s=4.8 * TB,
        nvlink_bytes_per_s=_NVLINK4,
        network_bytes_per_s=_CX7,
        exp_per_s=989e12 / 256,
    ),
    "b200": GPUSpec(
        memory_bytes=180 * GiB,
        nvlink_domain=8,
        tdp_watts=1000,
        generation="blackwell",
        dense_flops=_blackwell_peaks(2.25e15, 2),
        hbm_bytes_per_s=8 * TB,
        nvlink_bytes_per_s=_NVLINK5,
        network_bytes_per_s=_CX7,
        exp_per_s=2.25e15 / 512,
    ),
    "b300": GPUSpec(
        memory_bytes=270 * GiB,
        nvlink_domain=8,
        tdp_watts=1100,
        generation="blackwell",
        dense_flops=_blackwell_peaks(2.25e15, 3),
        hbm_bytes_per_s=8 * TB,
        nvlink_bytes_per_s=_NVLINK5,
        network_bytes_per_s=_CX8,
        exp_per_s=2.25e15 / 256,
    ),
    "gb200": GPUSpec(
        memory_bytes=186 * GiB,
        nvlink_domain=72,
        tdp_watts=1200,
        generation="blackwell",
        dense_flops=_blackwell_peaks(2.5e15, 2),
        hbm_bytes_per_s=8 * TB,
        nvlink_bytes_per_s=_NVLINK5,
        network_bytes_per_s=_CX7,
        exp_per_s=2.5e15 / 512,
    ),
    "gb300": GPUSpec(
        memory_bytes=279 * GiB,
        nvlink_domain=72,
        tdp_watts=1400,
        generation="blackwell",
        dense_flops=_blackwell_peaks(2.5e15, 3),
        hbm_bytes_per_s=8 * TB,
        nvlink_bytes_per_s=_NVLINK5,
        network_bytes_per_s=_CX8,
        exp_per_s=2.5e15 / 256,
    ),
}


class ModuleLayout(Section):
    """One module's own grid in a heterogeneous (MIMO-style) layout, e.g. a vision encoder."""

    num_ranks: RankCount
    """Ranks this module runs on (at most 2**20, as every parallel size here)."""
    rank_offset: int = Field(default=0, ge=0, le=MAX_WORLD_SIZE)
    """First rank of the module's grid."""
    tp: RankCount = 1
    cp: RankCount = 1
    pp: RankCount = 1
    ep: RankCount = 1
    etp: RankCount = 1


class ParallelismConfig(Section):
    """The parallel layout of one training job."""

    world_size: RankCount
    """Total GPUs (at most 2**20; so is every parallel size below)."""
    gpu: Literal["h100", "h200", "b200", "b300", "gb200", "gb300"] = "h100"
    """Accelerator type: sets memory and NVLink-domain size for the planner's warnings."""
    tp: RankCount = 1
    """Tensor parallel size of the dense (attention, Mamba, MLP) layers."""
    cp: RankCount = 1
    """Context parallel size."""
    pp: RankCount = 1
    """Pipeline parallel size."""
    vpp: RankCount | None = None
    """Virtual stages per pipeline rank; with '|' in the pattern it is segments / pp."""
    dp: RankCount | None = None
    """Data parallel size; derived as world_size / (tp*cp*pp). Set it only to assert it."""
    ep: RankCount = 1
    """Expert parallel size."""
    etp: RankCount | None = None
    """Expert tensor parallel size; defaults to tp as in Megatron. 1 suits fine-grained MoE."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence over the TP group; required with TP and EP."""
    micro_batch_size: BatchSize = 1
    """Sequences per micro-batch per data-parallel rank (at most 2**24)."""
    global_batch_size: BatchSize
    """Sequences per optimizer step (at most 2**24)."""
    distributed_optimizer: bool = True
    """Shard optimizer state (and the fp32 master weights) across data-parallel ranks."""
    distributed_optimizer_instances: RankCount = 1
    """Partial distributed optimizer: the number of replicas of the sharded state."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recomputation."""
    moe_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """MoE token dispatcher."""
    modules: dict[str, ModuleLayout] = Field(default_factory=dict)
    """Per-module grids for heterogeneous layouts (keys: module names, 'language' for the LLM)."""

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp
