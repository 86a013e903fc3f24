"""Cost of emulating a precision policy on CPU: proxy step time quantized over unquantized.

Both models are the Super CPU proxy built from the same seed: one with the
preset's precision table applied by ``factory.compile(precision="emulate")``
(NVFP4 linears, MXFP8 Mamba out_proj, BF16 exceptions), one with
``precision="off"`` (every linear unquantized, i.e. the BF16 baseline computed
in fp32 on CPU). A step is the proxy's training step: forward + backward over
its micro-batches (gradient accumulation to the global batch), then AdamW. Steps alternate between the two
models so that machine noise hits both alike. The goal: the NVFP4 step at most
3x the BF16 step.

``--recipe`` replaces the preset's default recipe (``fp8``, ``mxfp8``, ``mor``)
to price the other emulated formats the same way; ``--profile`` breaks one
quantized step down by op.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.machine import describe
from benchmarks.timing import interleaved, load_average, report

Step = Callable[[], float]


def make_step(model: torch.nn.Module, micro_batches: list[torch.Tensor], mtp_scale: float) -> Step:
    """One optimizer step over the micro-batches (gradient accumulation), timed."""
    from factory.graph.loss import language_model_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for ids in micro_batches:
            loss = language_model_loss(model(ids), ids, mtp_loss_scale=mtp_scale).total
            (loss / len(micro_batches)).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks precision_overhead")
    parser.add_argument("--preset", default="super")
    parser.add_argument("--recipe", default=None, help="override precision.recipe")
    parser.add_argument("--batch", type=int, default=None, help="default: the proxy's global batch")
    parser.add_argument("--micro", type=int, default=None, help="default: the proxy's micro batch")
    parser.add_argument("--seq", type=int, default=None, help="default: the proxy's seq_len")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)

    import factory
    from factory.checks.validate import load_blueprint

    overrides = [f"precision.recipe={args.recipe}"] if args.recipe else []
    blueprint = load_blueprint(args.preset, overrides)
    quantized = factory.compile(blueprint, proxy=True, seed=0, precision="emulate")
    baseline = factory.compile(blueprint, proxy=True, seed=0, precision="off")
    runtime = quantized.precision
    recipes = dict(runtime.recipes()) if runtime else {}
    proxy = quantized.blueprint
    batch = args.batch or proxy.parallelism.global_batch_size
    micro = args.micro or proxy.parallelism.micro_batch_size
    seq = args.seq or proxy.data.seq_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, proxy.model.vocab_size, (batch, seq), generator=gen)
    micro_batches = list(ids.split(micro))
    mtp = quantized.blueprint.model.mtp
    scale = mtp.loss_scale if mtp is not None else 0.0
    steps = {
        "quantized": make_step(quantized.model, micro_batches, scale),
        "bf16": make_step(baseline.model, micro_batches, scale),
    }

    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    params = sum(p.numel() for p in quantized.model.parameters())
    print(
        f"model: {quantized.blueprint.meta.name}, {params / 1e6:.1f}M params, fp32 master weights"
    )
    print(f"linears per format (quantized model): {recipes}")
    print(
        f"step: {batch} x {seq} tokens in micro-batches of {micro}, "
        f"{args.steps} timed steps each, interleaved"
    )
    load_before = load_average()
    times = interleaved(steps, args.steps, args.warmup)
    median = report(times)
    ratio = median["quantized"] / median["bf16"]
    print(f"overhead quantized/bf16 step time: {ratio:.2f}x (goal <= 3)")
    if runtime is not None and (fraction := runtime.mor_fp8_fraction()) is not None:
        print(f"MoR: {fraction:.2%} of tensors kept in FP8")
    print(f"1-min load average before/after timing: {load_before:.2f}/{load_average():.2f}")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            steps["quantized"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0
