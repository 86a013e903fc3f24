"""``python -m benchmarks NAME [ARGS...]``: run one benchmark; with no NAME, list them."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "validate": ("benchmarks.validate_speed", "factory validate on every preset vs `import torch`"),
    "build_meta": ("benchmarks.build_meta", "build each preset's full graph on the meta device"),
    "train_step": (
        "benchmarks.train_step",
        "CPU proxy fwd+bwd+AdamW tokens/s vs transformers NemotronH",
    ),
    "precision_overhead": (
        "benchmarks.precision_overhead",
        "CPU proxy step time with the emulated NVFP4 policy over unquantized",
    ),
    "nvfp4_replication": (
        "benchmarks.nvfp4_replication",
        "Super CPU proxy trained in NVFP4 (with/without Hadamard, SR) vs BF16: loss gap",
    ),
    "train": (
        "benchmarks.train",
        "CPU proxy training step split into data/fwd/bwd/optimizer, with sync/async checkpoints",
    ),
    "distributed": (
        "benchmarks.distributed",
        "CPU proxy tokens/s and communication share per parallel layout on 1, 2, 4 processes",
    ),
    "long_context": (
        "benchmarks.long_context",
        "document-masked attention at 8k/32k/128k (mask vs FlexAttention vs blocks); CP=2 at 32k",
    ),
    "build": (
        "benchmarks.build",
        "factory build nano|super|ultra end to end, seconds per stage (goal: < 5 min each)",
    ),
    "perf_model": (
        "benchmarks.perf_model",
        "performance model vs published tokens/s per GPU; --fit refits its constants",
    ),
    "data_pipeline": (
        "benchmarks.data_pipeline",
        "data build throughput vs DataTrove and vs the tokenizer alone",
    ),
    "generate": (
        "benchmarks.generate",
        "CPU proxy greedy decoding tokens/s: plain, MTP self-speculative, transformers generate",
    ),
    "gpu": (
        "benchmarks.gpu",
        "one CUDA device, 7 sections (CUDA tests, kernels, 1B step, MoE, precision, attention, "
        "NCCL); --dry-run on CPU, --prepare packs wheels",
    ),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print("usage: python -m benchmarks NAME [ARGS...]\n\nbenchmarks:")
        for name, (_, summary) in BENCHMARKS.items():
            print(f"  {name:12s} {summary}")
        return 0 if not argv else 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
