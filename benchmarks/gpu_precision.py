"""Section 5: the emulated NVFP4 and MXFP8 training steps against the BF16 step.

The section 3 blueprint three times, from the same seed, in BF16: unquantized
(``precision="off"``), and with ``precision.recipe=nvfp4`` and ``precision.recipe=mxfp8``
applied by ``factory.compile(precision="emulate")`` (on CUDA the emulation's casts run the
Triton kernels; Hopper has no FP4 or MXFP8 tensor cores, so every GEMM runs in BF16 on
fake-quantized operands). The three steps (ours: forward, backward, AdamW) run
interleaved; reported are the median step times and each emulated step over the BF16
step, the price of emulating a format on this device, and the linears per format.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, table
from benchmarks.timing import interleaved

TITLE = "Emulated NVFP4 and MXFP8 steps vs BF16"
BUDGET_S = 120
"""On an H100: three 1B models, each stepped once (Triton compiles), then 3 timed rounds of
three steps."""

RECIPES = {"bf16": (), "nvfp4": ("precision.recipe=nvfp4",), "mxfp8": ("precision.recipe=mxfp8",)}


def run(ctx: SectionContext) -> None:
    import factory
    from benchmarks.gpu_train import batch_shape, load, our_step, random_batch
    from factory.graph.loss import mtp_loss_scale

    steps, formats = {}, {}
    for name, overrides in RECIPES.items():
        blueprint = load(ctx.dry_run, overrides)
        compiled = factory.compile(blueprint, device=ctx.device, seed=0, dtype=torch.bfloat16,
                                   precision="emulate" if overrides else "off")  # fmt: skip
        runtime = compiled.precision
        formats[name] = dict(runtime.recipes()) if runtime is not None else {}
        ids = random_batch(blueprint, batch_shape(blueprint, ctx.dry_run), ctx.device)
        steps[name] = our_step(compiled.model.train(), ids, mtp_loss_scale(blueprint.model))
        # Recorded as it goes: a section cut off by its budget still says how far it got.
        ctx.record("first_step_s", {**ctx.results.get("first_step_s", {}), name: steps[name]()})
    ctx.record("linears_per_format", formats)
    for name in ("nvfp4", "mxfp8"):
        if not formats[name]:
            ctx.fail(f"precision.recipe={name} quantized no linear")
    repeats, warmup = (1, 0) if ctx.dry_run else (3, 0)  # each ran once above
    times = interleaved(steps, repeats, warmup)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    ctx.record("step_s", median)
    ctx.record("over_bf16", {name: median[name] / median["bf16"] for name in ("nvfp4", "mxfp8")})


def markdown(results: dict[str, Any]) -> str:
    median, ratio = results.get("step_s", {}), results.get("over_bf16", {})
    first, formats = results.get("first_step_s", {}), results.get("linears_per_format", {})
    rows = [[name, first[name], median.get(name), ratio.get(name, 1.0 if name in median else None),
             str(formats.get(name, ""))] for name in first]  # fmt: skip
    return table(["step", "first step s", "seconds", "over BF16", "linears per format"], rows)
