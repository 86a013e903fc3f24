"""A small-scale replication of the NVFP4 paper's claim: NVFP4 pretraining tracks BF16.

The Super CPU proxy (``factory.compile(..., proxy=True)``) is trained on the
curated Super mixture of the shipped sample corpus (the data pipeline packs it
at the proxy's seq_len) in four configurations, all with the same seed, so the
same initial weights, and the same data order:

* ``bf16``: ``precision="off"``, every linear unquantized. On CPU the model
  computes in fp32, so this is the unquantized baseline the paper calls BF16;
* ``nvfp4``: the preset's policy, emulated (NVFP4 linears, MXFP8 Mamba
  out_proj, BF16 attention/latent/MTP and the last layers);
* ``nvfp4_no_hadamard``: the same with ``precision.nvfp4.hadamard=false``;
* ``nvfp4_no_sr``: the same with ``precision.nvfp4.stochastic_rounding=false``.

Training is :func:`factory.runtime.fit.fit` with the blueprint's AdamW,
WSD schedule, clipping and batch (global 8 x 256 tokens, micro 2).

What is measured and how it is summarized (loss gaps vs bf16, spikes, step
times) is :mod:`benchmarks.nvfp4_report`'s docstring.

Writes ``OUT/results.json`` (rewritten after every configuration, so a killed
run keeps what finished), ``OUT/loss_curves.png`` and ``OUT/report.html``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.machine import describe
from benchmarks.nvfp4_report import BASELINE, publish, summarize, write_results


class Config(NamedTuple):
    overrides: tuple[str, ...]
    backend: str
    description: str
    rounding_seed_offset: int = 0
    """Non-zero: compile with seed + offset (so stochastic rounding draws other numbers),
    then load the initial weights of ``seed``: the same run but for the rounding noise."""


CONFIGS: dict[str, Config] = {
    "bf16": Config((), "off", "unquantized baseline (fp32 on CPU)"),
    "nvfp4": Config((), "emulate", "the preset's NVFP4 policy"),
    "nvfp4_no_hadamard": Config(
        ("precision.nvfp4.hadamard=false",),
        "emulate",
        "NVFP4 without the wgrad random Hadamard transform",
    ),
    "nvfp4_no_sr": Config(
        ("precision.nvfp4.stochastic_rounding=false",),
        "emulate",
        "NVFP4 with round-to-nearest gradients",
    ),
    "nvfp4_sr_reseeded": Config(
        (),
        "emulate",
        "the preset's NVFP4 policy, stochastic rounding from another seed (same initial "
        "weights, same data): how far the gap moves on rounding noise alone",
        rounding_seed_offset=1,
    ),
}
DEFAULT_CONFIGS = ("bf16", "nvfp4", "nvfp4_no_hadamard", "nvfp4_no_sr")


def run_config(
    name: str, preset: str, seed: int, steps: int, data: Path, progress: bool, log_every: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train one configuration; return (its description, its run: records and flags)."""
    from dataclasses import asdict

    import torch

    import factory
    from factory.checks.validate import load_blueprint
    from factory.runtime.fit import fit
    from factory.runtime.loader import ShardLoader
    from factory.runtime.run_options import RunOptions

    config = CONFIGS[name]
    blueprint = load_blueprint(preset, list(config.overrides))
    offset = config.rounding_seed_offset
    compiled = factory.compile(blueprint, proxy=True, seed=seed + offset, precision=config.backend)
    if offset:
        initial = factory.compile(blueprint, proxy=True, seed=seed, precision=config.backend)
        compiled.model.load_state_dict(initial.model.state_dict())
    load_before = os.getloadavg()[0]
    options = RunOptions(log_every=log_every, progress=progress, seed=seed, description=name)
    micro = compiled.blueprint.parallelism.micro_batch_size
    with ShardLoader(data, micro, seed=seed) as batches:
        result = fit(compiled, batches, steps, options)
    described = {
        "description": config.description,
        "overrides": list(config.overrides),
        "precision": config.backend,
        "rounding_seed": seed + offset,
        "recipes": dict(compiled.precision.recipes()) if compiled.precision else {},
        "parameters": sum(p.numel() for p in compiled.model.parameters()),
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "threads": torch.get_num_threads(),
    }
    run = {"diverged": result.diverged, "records": [asdict(r) for r in result.records]}
    return described, run


def new_results(
    argv: list[str], preset: str, proxy: Any, steps: int, seed: int, data: Path
) -> dict[str, Any]:
    """The results skeleton: what ran where, before any run."""
    import torch

    from factory.data.shards.shard_reader import read_samples

    tokens, mask = read_samples(data)
    par = proxy.parallelism
    return {
        "meta": {
            "command": "python -m benchmarks nvfp4_replication " + " ".join(argv),
            "machine": describe(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "preset": preset,
            "proxy": proxy.meta.name,
            "pattern": proxy.model.pattern,
            "steps": steps,
            "seed": seed,
            "batch": f"global {par.global_batch_size} x {proxy.data.seq_len} tokens, "
            f"micro {par.micro_batch_size}",
            "optimizer": proxy.training.optimizer.model_dump(),
            "schedule": proxy.training.schedule.model_dump(),
            "data": f"recipe {proxy.data.recipe} packed at {tokens.shape[1]}: "
            f"{tokens.shape[0]} samples, {mask.mean():.1%} of positions in the loss; "
            f"{steps * par.global_batch_size / tokens.shape[0]:.2f} epochs",
        },
        "configs": {},
        "runs": {},
        "summary": {},
    }


def main(argv: list[str]) -> int:
    import json

    from factory.proxy import PROXY_STEPS

    parser = argparse.ArgumentParser(prog="python -m benchmarks nvfp4_replication")
    parser.add_argument("--steps", type=int, default=PROXY_STEPS, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=Path("reports/nvfp4_replication"))
    parser.add_argument("--preset", default="super")
    parser.add_argument("--seed", type=int, default=None, help="default: training.seed")
    parser.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {list(CONFIGS)}"
    )
    parser.add_argument("--data", type=Path, default=None, help="reuse/build shards here")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs in OUT/results.json, add the others"
    )
    parser.add_argument(
        "--render", action="store_true", help="only redo the table and report from OUT/results.json"
    )
    args = parser.parse_args(argv)
    existing = args.out / "results.json"
    if args.render:
        return publish(args.out, json.loads(existing.read_text()))
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if BASELINE in names:  # the baseline first, so gaps can be shown as runs finish
        names.remove(BASELINE)
        names.insert(0, BASELINE)
    progress = sys.stderr.isatty() if args.progress is None else args.progress  # the bar's stream

    import torch

    from factory.checks.validate import load_blueprint
    from factory.proxy import derive_proxy
    from factory.runtime.batches import build_shards

    proxy = derive_proxy(load_blueprint(args.preset))
    seed = proxy.training.seed if args.seed is None else args.seed
    with tempfile.TemporaryDirectory(prefix="nvfp4-replication-") as tmp:
        data = build_shards(proxy, args.data or Path(tmp) / "data")
        results = new_results(argv, args.preset, proxy, args.steps, seed, data)
        if args.resume and existing.is_file():
            previous = json.loads(existing.read_text())
            same = ("preset", "steps", "seed", "data")
            if any(previous["meta"][k] != results["meta"][k] for k in same):
                parser.error(f"{existing} has other {', '.join(same)}; drop --resume")
            resumed = [*previous["meta"].get("resumed", []), results["meta"]["command"]]
            results["meta"] = {**previous["meta"], "resumed": resumed}
            results["configs"], results["runs"] = previous["configs"], previous["runs"]
        print(
            f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}"
        )
        print(f"{results['meta']['data']}; {args.steps} steps; seed {seed}")
        for name in (n for n in names if n not in results["runs"]):
            config, run = run_config(
                name, args.preset, seed, args.steps, data, progress, args.log_every
            )
            results["configs"][name], results["runs"][name] = config, run
            results["summary"] = summarize(results["runs"], args.steps)
            write_results(args.out, results)
            print(f"{name}: done, {results['summary'][name]['total_s']:.0f} s")
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return publish(args.out, results)
