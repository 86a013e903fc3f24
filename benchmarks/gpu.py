"""``python -m benchmarks gpu --out DIR``: the measurements that need one CUDA device, in one
command, written to ``DIR/results.json`` and ``DIR/results.md`` (tables for BENCHMARKS.md),
headed by the device and the kernel report (which kernel each layer type runs, and why a
fallback: ``factory.graph.kernel_report``).

Sections, one module each (``benchmarks/gpu_<name>.py``; each says what it measures and its
wall-clock budget). The budgets were set from the first run on an H200 (2026-11-28), where
every section but ``moe`` ran past the budget its H100 estimate gave it: mamba-ssm's Triton
autotuning and inductor's compiles cost minutes on a fresh machine. So issue 38's sections
take two device calls. A plain run is the first (540 s of budgets):

1. ``tests``: every test that skips without CUDA (``gpu_tests``);
2. ``nano_slice``: the Nano-width slice compiled, BF16 and FP8, against the prediction
   (``gpu_nano_slice``).

The second call, ``--only train_step,layers,moe,attention`` (:data:`SECOND_CALL`, 520 s):

3. ``train_step``: the 1B blueprint's BF16 step, eager and compiled, against the recorded
   39.8k tokens/s (``gpu_train``);
4. ``layers``: each layer type's block against its kernel alone and its GEMM floor
   (``gpu_layers``);
5. ``moe``: ``torch._grouped_mm`` against padded bmm, the Nano-width MoE block (``gpu_moe``);
6. ``attention``: document-masked attention, flex vs varlen vs masked SDPA (``gpu_attention``).

The sections whose figures are recorded in BENCHMARKS.md and which issue 38 does not change
run on request (``--only``, or ``--all``; together 340 s, a third call):

7. ``kernels``: Triton kernel bandwidth against the HBM peak (``gpu_kernels``);
8. ``transformers``: the 1B step, ours against transformers' NemotronH (``gpu_transformers``);
9. ``precision``: the emulated NVFP4 and MXFP8 and the real FP8 steps against BF16, and one
   FP8 linear's GEMMs against BF16 (``gpu_precision``);
10. ``nccl``: the distributed code paths on one NCCL rank (``gpu_nccl``).

Each section runs in its own process under its budget: one that fails or runs out of time
is recorded with its error (and whatever it measured before) and the command goes on; the
exit status is 1 when any failed. The results files are rewritten after every section, so
a device call cut short still returns what was done, and each call's sections, offline
install included, fit one 10-minute device call. ``--only a,b`` runs some sections.

``--dry-run`` runs the sections on CPU at tiny sizes (Triton under its interpreter, gloo
for NCCL), so CI keeps the command working (``--all`` for every one); its times are not
measurements.
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
    "nano_slice": "benchmarks.gpu_nano_slice",
    "train_step": "benchmarks.gpu_train",
    "layers": "benchmarks.gpu_layers",
    "moe": "benchmarks.gpu_moe",
    "attention": "benchmarks.gpu_attention",
    "kernels": "benchmarks.gpu_kernels",
    "transformers": "benchmarks.gpu_transformers",
    "precision": "benchmarks.gpu_precision",
    "nccl": "benchmarks.gpu_nccl",
}
DEFAULT = ("tests", "nano_slice")
"""What a plain run measures: the first device call of issue 38's sections."""
SECOND_CALL = ("train_step", "layers", "moe", "attention")
"""The rest of issue 38's sections, a second device call (``--only``, comma-separated). The
others' figures are recorded (BENCHMARKS.md, "gpu") and issue 38 does not change them:
``--only`` or ``--all``."""
ON_REQUEST = tuple(name for name in SECTIONS if name not in DEFAULT + SECOND_CALL)
DEVICE_CALL_S = 560
"""The budgets of a call's sections (:data:`DEFAULT`, :data:`SECOND_CALL`) may add up to this
much: a 10-minute device call less the offline install and the start (``tests/test_benchmarks_gpu.py`` checks the sum)."""
KERNEL_REPORT_BLUEPRINTS = ("gpu_nano_slice.yaml", "gpu_1b.yaml")
DRY_RUN_BUDGET_S = 180
"""Per section on CPU: generous for a loaded runner. Unloaded, a section's dry run takes
seconds to a minute; on two cores at a load average of 17, the emulated NVFP4/MXFP8 steps
(``precision``) ran past 120 s."""


def _device_description(dry_run: bool) -> str:
    import torch

    if dry_run:
        return f"dry run on CPU ({describe()}), Triton interpreter: times are not measurements"
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; host {describe()}"
    )


def kernel_report(dry_run: bool) -> list[str]:
    """The kernel report of the benchmark blueprints' models on this run's device: each
    operation's kernel, and why a fallback (the lines a training run prints first), each
    line once."""
    import factory
    from factory.graph.kernel_report import kernel_lines

    folder = Path(__file__).resolve().parent / "blueprints"
    lines: list[str] = []
    try:
        for name in KERNEL_REPORT_BLUEPRINTS:
            model = factory.load_blueprint(folder / name).model
            lines += [line for line in kernel_lines(model, "cpu" if dry_run else "cuda")
                      if line not in lines]  # fmt: skip
    except Exception as error:  # the report must not cost the measurements
        lines.append(f"kernels: the report failed: {type(error).__name__}: {error}")
    return lines


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


def _write(
    out: Path,
    device: str,
    dry_run: bool,
    kernels: list[str],
    sections: dict[str, dict[str, Any]],
) -> str:
    results = {"device": device, "dry_run": dry_run, "kernels": kernels, "sections": sections}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    text = f"Device: {device}\n\nKernel report (the benchmark blueprints' models):\n\n"
    text += "".join(f"    {line}\n" for line in kernels)
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
        "--only", default="", help="comma-separated sections (default: "
        + ",".join(DEFAULT) + "; second call: " + ",".join(SECOND_CALL)
        + "; on request: " + ",".join(ON_REQUEST) + ")",
    )  # fmt: skip
    parser.add_argument("--all", action="store_true", help="every section, in order")
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
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS if args.all else DEFAULT)
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
    kernels = kernel_report(args.dry_run)
    print("\n".join(kernels), flush=True)
    sections: dict[str, dict[str, Any]] = {}
    for name in chosen:
        print(f"gpu: section {name} ...", flush=True)
        sections[name] = _child(name, args)
        print(f"gpu: section {name}: {sections[name]['status']} in "
              f"{sections[name]['seconds']} s", flush=True)  # fmt: skip
        table = _write(args.out, device, args.dry_run, kernels, sections)
    print(table, end="")
    return 0 if all(s["status"] == "ok" for s in sections.values()) else 1
