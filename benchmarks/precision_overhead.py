"""Cost of emulating a precision policy on CPU: proxy step time quantized over unquantized.

Both models are the Super CPU proxy built from the same seed: one with the
preset's precision table applied by ``factory.compile(precision="emulate")``
(NVFP4 linears, MXFP8 Mamba out_proj, BF16 exceptions), one with
``precision="off"`` (every linear unquantized, i.e. the BF16 baseline computed
in fp32 on CPU). A step is forward + backward + AdamW on the same batch (the
proxy's micro batch shape unless overridden). Steps alternate between the two
models so that machine noise hits both alike. The issue's goal: the NVFP4 step
at most 3x the BF16 step.

``--recipe`` replaces the preset's default recipe (``fp8``, ``mxfp8``, ``mor``)
to price the other emulated formats the same way; ``--profile`` breaks one
quantized step down by op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.machine import describe

Step = Callable[[], float]


def make_step(model: torch.nn.Module, ids: torch.Tensor, mtp_scale: float) -> Step:
    from factory.graph.loss import language_model_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids)
        language_model_loss(logits, ids, mtp_loss_scale=mtp_scale).total.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks precision_overhead")
    parser.add_argument("--preset", default="super")
    parser.add_argument("--recipe", default=None, help="override precision.recipe")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)

    import factory
    from factory.loading.load import load_blueprint

    overrides = [f"precision.recipe={args.recipe}"] if args.recipe else []
    blueprint = load_blueprint(args.preset, overrides)
    quantized = factory.compile(blueprint, proxy=True, seed=0, precision="emulate")
    baseline = factory.compile(blueprint, proxy=True, seed=0, precision="off")
    runtime = quantized.precision
    recipes = dict(runtime.recipes()) if runtime else {}
    vocab = quantized.blueprint.model.vocab_size
    ids = torch.randint(
        0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    mtp = quantized.blueprint.model.mtp
    scale = mtp.loss_scale if mtp is not None else 0.0
    steps = {
        "quantized": make_step(quantized.model, ids, scale),
        "bf16": make_step(baseline.model, ids, scale),
    }

    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    params = sum(p.numel() for p in quantized.model.parameters())
    print(
        f"model: {quantized.blueprint.meta.name}, {params / 1e6:.1f}M params, fp32 master weights"
    )
    print(f"linears per format (quantized model): {recipes}")
    print(f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps each, interleaved")
    load_before = os.getloadavg()[0]
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(step())
    median = {name: statistics.median(ts) for name, ts in times.items()}
    for name, seconds in median.items():
        spread = f"min {min(times[name]):.3f}, max {max(times[name]):.3f}"
        print(f"{name:9s} median step {seconds:.3f} s ({spread})")
    ratio = median["quantized"] / median["bf16"]
    print(f"overhead quantized/bf16 step time: {ratio:.2f}x (goal <= 3)")
    if runtime is not None and (fraction := runtime.mor_fp8_fraction()) is not None:
        print(f"MoR: {fraction:.2%} of tensors kept in FP8")
    print(f"1-min load average before/after timing: {load_before:.2f}/{os.getloadavg()[0]:.2f}")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            steps["quantized"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0
