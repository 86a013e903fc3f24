"""``python -m benchmarks gpu --out DIR``: the measurements that need one CUDA device, in one
command, written to ``DIR/results.json`` and ``DIR/results.md`` (tables for BENCHMARKS.md).

Sections, in issue 30's order, one module each (``benchmarks/gpu_<name>.py``; each says what
it measures and its wall-clock budget on an H100):

1. ``tests``: every test that skips without CUDA (``gpu_tests``);
2. ``kernels``: Triton kernel bandwidth against the HBM peak (``gpu_kernels``);
3. ``train_step``: the 1B blueprint's BF16 step, ours against transformers (``gpu_train``);
4. ``moe``: ``torch._grouped_mm`` against padded bmm, the Nano-width MoE block (``gpu_moe``);
5. ``precision``: the emulated NVFP4 and MXFP8 steps against BF16 (``gpu_precision``);
6. ``attention``: document-masked attention against SDPA with a mask (``gpu_attention``);
7. ``nccl``: the distributed code paths on one NCCL rank (``gpu_nccl``).

Each section runs in its own process under its budget: one that fails or runs out of time
is recorded with its error (and whatever it measured before) and the command goes on; the
exit status is 1 when any failed. The results files are rewritten after every section, so
a device call cut short still returns what was done. The budgets add up to 590 s, so the
whole command, offline install included, fits one 10-minute device call. ``--only a,b`` runs some sections.

``--dry-run`` runs every section on CPU at tiny sizes (Triton under its interpreter, gloo
for NCCL), so CI keeps the command working; its times are not measurements.
``--prepare`` gathers the wheels the GPU machine lacks (``benchmarks.gpu_prepare``); a
real run installs from them when factory is not installed there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import describe

SECTIONS = {
    "tests": "benchmarks.gpu_tests",
    "kernels": "benchmarks.gpu_kernels",
    "train_step": "benchmarks.gpu_train",
    "moe": "benchmarks.gpu_moe",
    "precision": "benchmarks.gpu_precision",
    "attention": "benchmarks.gpu_attention",
    "nccl": "benchmarks.gpu_nccl",
}
DRY_RUN_BUDGET_S = 120
"""Per section on CPU: generous for a loaded CI runner; the dry run takes seconds."""


def _device_description(dry_run: bool) -> str:
    import torch

    if dry_run:
        return f"dry run on CPU ({describe()}), Triton interpreter: times are not measurements"
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; host {describe()}"
    )


def run_section(name: str, out: Path, dry_run: bool, size: int | None) -> int:
    """Run one section in this process (the parent's child): results to DIR/sections/NAME.json."""
    if dry_run:  # before any kernel is defined: triton.jit reads it then and at launch
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from benchmarks.gpu_common import SectionContext

    module = importlib.import_module(SECTIONS[name])
    device = torch.device("cpu" if dry_run else "cuda")
    ctx = SectionContext(device, dry_run, out / "sections" / f"{name}.json", {"size": size})
    ctx.record("started", True)
    module.run(ctx)
    return 1 if ctx.results.get("failures") else 0


def _child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One section in a subprocess under its budget; its status, seconds and results."""
    module = importlib.import_module(SECTIONS[name])
    budget = DRY_RUN_BUDGET_S if args.dry_run else module.BUDGET_S
    command = [sys.executable, "-m", "benchmarks", "gpu", "--section", name, "--out", str(args.out)]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--size", str(args.size)] if args.size else []
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget)
        status = "ok" if done.returncode == 0 else "failed"
        error = "" if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip())
    except subprocess.TimeoutExpired:
        status, error = "timed out", f"ran past its budget of {budget} s"
    path = args.out / "sections" / f"{name}.json"
    results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if status == "failed" and results.get("failures"):
        error = "; ".join(results["failures"]) + ("\n" + error if error else "")
    return {
        "title": module.TITLE,
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "budget_s": budget,
        "error": error[-3000:],
        "results": results,
    }


def _write(out: Path, device: str, dry_run: bool, sections: dict[str, dict[str, Any]]) -> str:
    results = {"device": device, "dry_run": dry_run, "sections": sections}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    text = f"Device: {device}\n"
    for number, (name, section) in enumerate(sections.items(), start=1):
        module = importlib.import_module(SECTIONS[name])
        text += (
            f"\n### {number}. {section['title']} ({section['status']}, {section['seconds']} s)\n\n"
        )
        try:
            text += module.markdown(section["results"]) if section["results"] else ""
        except (KeyError, TypeError, ValueError, IndexError) as error:  # a section cut short
            text += f"(no table: results incomplete, {type(error).__name__}: {error})\n"
        if section["error"]:
            text += f"\nError: `{section['error'].splitlines()[-1]}`\n"
    (out / "results.md").write_text(text, encoding="utf-8")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu")
    parser.add_argument("--out", type=Path, help="folder for results.json/.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreter")
    parser.add_argument("--size", type=int, default=None, help="kernel input edge (8192)")
    parser.add_argument(
        "--only", default="", help="comma-separated sections: " + ",".join(SECTIONS)
    )
    parser.add_argument("--prepare", action="store_true", help="gather wheels into .gpu_wheels/")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.prepare:
        from benchmarks.gpu_prepare import prepare

        return prepare()
    if args.out is None:
        print("gpu: --out DIR is required", file=sys.stderr)
        return 2
    if args.section:
        return run_section(args.section, args.out, args.dry_run, args.size)
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS)
    if unknown := [s for s in chosen if s not in SECTIONS]:
        print(f"gpu: unknown section(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if not args.dry_run:
        from benchmarks.gpu_install import install_offline_if_needed

        install_offline_if_needed()
        import torch

        if not torch.cuda.is_available():
            print("gpu: no CUDA device here (use --dry-run to check the command on CPU)",
                  file=sys.stderr)  # fmt: skip
            return 2
    (args.out / "sections").mkdir(parents=True, exist_ok=True)
    device = _device_description(args.dry_run)
    sections: dict[str, dict[str, Any]] = {}
    for name in chosen:
        print(f"gpu: section {name} ...", flush=True)
        sections[name] = _child(name, args)
        print(f"gpu: section {name}: {sections[name]['status']} in "
              f"{sections[name]['seconds']} s", flush=True)  # fmt: skip
        table = _write(args.out, device, args.dry_run, sections)
    print(table, end="")
    return 0 if all(s["status"] == "ok" for s in sections.values()) else 1
