"""``python -m benchmarks gpu --out DIR``: the measurements that need one CUDA device, in one
command, written to ``DIR/results.json`` and ``DIR/results.md`` (a table for BENCHMARKS.md).

Sections so far: kernel bandwidth (``benchmarks.gpu_kernels``). The other
sections issue 30 lists (the CUDA-only tests, the 1B training step against
transformers, MoE grouped GEMMs, the emulated NVFP4/MXFP8 step, document-masked
attention, NCCL) are not written yet.

``--dry-run`` runs every section on CPU at tiny sizes, the Triton kernels under
the interpreter, so CI keeps the command working; its times are not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.machine import describe


def _device_description(dry_run: bool) -> str:
    import torch

    if dry_run:
        return f"dry run on CPU ({describe()}), Triton interpreter: times are not measurements"
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; host {describe()}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json/.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreter")
    parser.add_argument("--size", type=int, default=None, help="kernel input edge (8192)")
    args = parser.parse_args(argv)
    if args.dry_run:  # before any kernel is defined: triton.jit reads it then and at launch
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from benchmarks import gpu_kernels

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu: no CUDA device here (use --dry-run to check the command on CPU)", file=sys.stderr
        )
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    size = args.size or (64 if args.dry_run else 8192)
    kernels = gpu_kernels.measure(device, size, min(size, 1024), repeats=1 if args.dry_run else 20)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "device": _device_description(args.dry_run),
        "dry_run": args.dry_run,
        "kernel_bandwidth": gpu_kernels.as_json(kernels),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    table = (
        f"Device: {results['device']}\n\n### Kernel bandwidth\n\n{gpu_kernels.markdown(kernels)}"
    )
    (args.out / "results.md").write_text(table, encoding="utf-8")
    print(table, end="")
    return 0 if all(k.bit_exact for k in kernels) else 1
