"""Section 5: the NVFP4, MXFP8 and FP8 training steps against the BF16 step, and one FP8 GEMM.

The section 3 blueprint four times, from the same seed, in BF16: unquantized
(``precision="off"``), and with ``precision.recipe=nvfp4``, ``mxfp8`` and ``fp8``
applied by ``factory.compile(precision="emulate")``. NVFP4 and MXFP8 are emulated (on
CUDA the casts run the Triton kernels; their block-scaled GEMMs need Blackwell, so every
GEMM runs on fake-quantized operands); FP8 current scaling runs its GEMMs on the FP8
tensor cores through ``torch._scaled_mm`` where the GPU has them (compute capability
>= 8.9, ``factory.kernels.fp8_gemm``). The four steps (ours: forward, backward, AdamW)
run interleaved; reported are the median step times, each over the BF16 step, the
linears per format and the kernel each recipe's GEMMs took on this device. Then one
linear's forward and backward (three GEMMs, casts included) in FP8 on the real path
against BF16 ``F.linear``, and the bare GEMMs (``torch._scaled_mm`` on given codes
against ``torch.mm``), at a 1B-model width.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_common import SectionContext, attempt, table, timed
from benchmarks.timing import interleaved

TITLE = "NVFP4, MXFP8 (emulated) and FP8 (torch._scaled_mm) steps vs BF16"
BUDGET_S = 120
"""On an H100: four 1B models, each stepped once (Triton compiles; about 11 s for three in
the last call), then 3 timed rounds of four steps, then the GEMM timings (a few seconds)."""

RECIPES = {
    "bf16": (),
    "nvfp4": ("precision.recipe=nvfp4",),
    "mxfp8": ("precision.recipe=mxfp8",),
    "fp8": ("precision.recipe=fp8",),
}
DRY_RUN_SKIPS = ("fp8",)
"""Steps the dry run leaves out to stay within its budget on two CPU cores: on CPU the FP8
step is the emulation the other two already run (the FP8 linear below still runs)."""
GEMM_SHAPE = {False: (8192, 2048, 8192), True: (32, 64, 48)}
"""(tokens, in, out) of the GEMM timings, by dry run: a 1B model's MLP width."""


def run(ctx: SectionContext) -> None:
    import factory
    from benchmarks.gpu_train import batch_shape, load, our_step, random_batch
    from factory.graph.loss import mtp_loss_scale

    steps, formats, kernels = {}, {}, {}
    recipes = {n: o for n, o in RECIPES.items() if not (ctx.dry_run and n in DRY_RUN_SKIPS)}
    quantized = [name for name, overrides in recipes.items() if overrides]
    for name, overrides in recipes.items():
        blueprint = load(ctx.dry_run, overrides)
        compiled = factory.compile(blueprint, device=ctx.device, seed=0, dtype=torch.bfloat16,
                                   precision="emulate" if overrides else "off")  # fmt: skip
        runtime = compiled.precision
        formats[name] = dict(runtime.recipes()) if runtime is not None else {}
        if runtime is not None:
            kernels[name] = [c.describe() for c in runtime.kernel_choices(ctx.device.type)]
        ids = random_batch(blueprint, batch_shape(blueprint, ctx.dry_run), ctx.device)
        steps[name] = our_step(compiled.model.train(), ids, mtp_loss_scale(blueprint.model))
        # Recorded as it goes: a section cut off by its budget still says how far it got.
        ctx.record("first_step_s", {**ctx.results.get("first_step_s", {}), name: steps[name]()})
    ctx.record("linears_per_format", formats)
    ctx.record("gemm_kernels", kernels)
    for name in quantized:
        if not formats[name]:
            ctx.fail(f"precision.recipe={name} quantized no linear")
    repeats, warmup = (1, 0) if ctx.dry_run else (3, 0)  # each ran once above
    times = interleaved(steps, repeats, warmup)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    ctx.record("step_s", median)
    ctx.record("over_bf16", {name: median[name] / median["bf16"] for name in quantized})
    attempt(ctx, "fp8 gemm timings", lambda: ctx.record("gemm_s", _gemm_timings(ctx)))


def _gemm_timings(ctx: SectionContext) -> dict[str, float]:
    """Median seconds of one linear's forward+backward in FP8 (real path where the device has
    it, else the emulation) and BF16, and of the bare FP8 and BF16 GEMMs."""
    import torch.nn.functional as F

    from factory.kernels import fp8, fp8_gemm
    from factory.precision.qlinear import quantized_matmul
    from factory.precision.quantizers import FP8Quantizer
    from factory.schemas.precision import FP8Options

    tokens, k, n = GEMM_SHAPE[ctx.dry_run]
    ctx.record("gemm_shape", [tokens, k, n])
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(tokens, k, device=ctx.device, generator=gen, dtype=torch.bfloat16)
    w = (0.02 * torch.randn(n, k, device=ctx.device, generator=gen)).requires_grad_()
    dy = torch.randn(tokens, n, device=ctx.device, generator=gen, dtype=torch.bfloat16)
    x.requires_grad_()
    quantizer = FP8Quantizer(FP8Options())
    ctx.record("fp8_linear_kernel", quantizer.gemm_kernel(ctx.device.type).describe())
    w_bf16 = w.detach().to(torch.bfloat16).requires_grad_()
    a, b = fp8.quantize_tensorwise(x.detach()), fp8.quantize_tensorwise(w.detach())

    def fp8_linear() -> None:
        quantized_matmul(x, w, quantizer).backward(dy)

    def bf16_linear() -> None:
        F.linear(x, w_bf16).backward(dy)

    calls = {
        "fp8 linear fwd+bwd": fp8_linear,
        "bf16 linear fwd+bwd": bf16_linear,
        "fp8 gemm": lambda: fp8_gemm.scaled_matmul(a.data, a.scale_inv, b.data.t(), b.scale_inv),
        "bf16 gemm": lambda: torch.mm(x.detach(), w_bf16.detach().t()),
    }
    steps = {name: (lambda call=call: timed(call, ctx.device)) for name, call in calls.items()}
    repeats, warmup = (1, 1) if ctx.dry_run else (20, 3)
    times = interleaved(steps, repeats, warmup)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def markdown(results: dict[str, Any]) -> str:
    median, ratio = results.get("step_s", {}), results.get("over_bf16", {})
    first, formats = results.get("first_step_s", {}), results.get("linears_per_format", {})
    kernels, gemm = results.get("gemm_kernels", {}), results.get("gemm_s", {})
    rows = [[name, first[name], median.get(name), ratio.get(name, 1.0 if name in median else None),
             str(formats.get(name, "")), "; ".join(kernels.get(name, []))]
            for name in first]  # fmt: skip
    steps = table(
        ["step", "first step s", "seconds", "over BF16", "linears per format", "GEMM kernel"], rows
    )
    if not gemm:
        return steps
    shape = " x ".join(map(str, results.get("gemm_shape", [])))
    gemm_rows = [[name, seconds] for name, seconds in gemm.items()]
    return (
        steps
        + f"\n\nOne linear (tokens x in x out = {shape}; "
        + f"{results.get('fp8_linear_kernel', '')}):\n\n"
        + table(["what", "seconds"], gemm_rows)
    )
