"""Section ``nano_slice``: the Nano-width slice (``benchmarks/blueprints/gpu_nano_slice.yaml``:
Nano's widths, 14 layers, 16 routed experts) trained on one GPU with ``training.compile``,
in BF16 and with the fp8 precision recipe, beside the performance model's prediction.

Each recipe in turn (the two models do not fit the device together): the model built by
``factory.compile`` in BF16 (the router in fp32; ``precision="auto"``, so the fp8 recipe
takes whatever GEMMs factory runs it with on this device), its blocks compiled by
``factory.compilation.compile_for_training`` (``training.compile``; a refusal is recorded and that
recipe is timed eager, so the figure says which), and the trainer's step: the blueprint's
micro-batches through ``factory.runtime.step.forward_backward`` (its loss, packed documents
apart) and the trainer's ``MasterOptimizer`` (AdamW over fp32 masters). The batch is random
tokens in ``DOCUMENTS`` packed documents per sequence.

Reported per recipe: the first step (it pays the compile), the median of the timed steps,
tokens/s, MFU = the plan's exact training FLOPs per token x tokens/s / the device's dense
BF16 peak (factory's GPU table: the formula of section ``train_step``; Megatron's
published Nano figures are of the BF16 peak too, whatever the recipe), the peak of
``torch.cuda.max_memory_allocated`` against the plan's memory total for that blueprint
(``factory.plan(...).memory.total``), and ``factory.plan(...).performance``'s predicted
tokens/s and MFU for the same blueprint and recipe. The issue's goals (issue 38): MFU >=
25% in BF16 and >= 32% with FP8 GEMMs. The dry run does all of it on the slice's CPU proxy.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.gpu_common import SectionContext, attempt, bf16_peak, table, timed
from benchmarks.timing import interleaved

TITLE = "Nano-width slice: training step compiled, BF16 and FP8, vs the prediction"
BUDGET_S = 300
"""On an H100: per recipe, building 2.1B parameters (~10 s), the first step with the compile of
the Mamba and attention blocks (~40-60 s), then 1 warm-up and 3 timed steps of ~1 s."""

BLUEPRINT = Path(__file__).resolve().parent / "blueprints" / "gpu_nano_slice.yaml"
RECIPES = {"bf16": (), "fp8": ("precision.recipe=fp8",)}
GOAL_MFU = {"bf16": 0.25, "fp8": 0.32}
"""Issue 38's goals, of the dense BF16 peak (Megatron-Bridge publishes Nano on H100 at 32-33%)."""
DOCUMENTS = 4
"""Packed documents per sequence: the mixers' document paths run, as in training."""
DRY_WIDTH, DRY_SEQ, DRY_MICRO, DRY_PATTERN = 64, 64, 1, "MEMEM*E"


def load(dry_run: bool, overrides: tuple[str, ...] = ()) -> Any:
    """The slice's blueprint (with ``overrides``); in a dry run the CPU proxy of one period of
    its pattern (the code paths are the same, CI's time half)."""
    import factory
    from factory.proxy import derive_proxy

    if not dry_run:
        return factory.load_blueprint(BLUEPRINT, list(overrides))
    blueprint = factory.load_blueprint(BLUEPRINT, [f"model.pattern={DRY_PATTERN}", *overrides])
    return derive_proxy(blueprint, width=DRY_WIDTH)


def step_shape(blueprint: Any, dry_run: bool) -> tuple[int, int, int]:
    """(micro-batches per step, micro-batch size, seq_len): the blueprint's, tiny in a dry run."""
    if dry_run:
        return DRY_MICRO, 1, DRY_SEQ
    p = blueprint.parallelism
    return p.global_batch_size // p.micro_batch_size, p.micro_batch_size, blueprint.data.seq_len


def packed_documents(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[batch, seq] document ids: ``DOCUMENTS`` documents of 40/30/20/10% of each row."""
    ends = [round(seq * f) for f in (0.4, 0.7, 0.9)]
    ids = torch.zeros(seq, dtype=torch.int64)
    for end in ends:
        ids[end:] += 1
    return ids.expand(batch, seq).contiguous().to(device)


def micro_batches(blueprint: Any, shape: tuple[int, int, int], device: torch.device) -> list[Any]:
    """The step's micro-batches: random tokens, every token a target, packed documents."""
    from factory.runtime.batches import MicroBatch

    count, batch, seq = shape
    gen = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(count):
        ids = torch.randint(0, blueprint.model.vocab_size, (batch, seq), generator=gen).to(device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        micro.append(MicroBatch(ids, mask, packed_documents(batch, seq, device)))
    return micro


def compiling(dry_run: bool) -> AbstractContextManager[Any]:
    """Where ``compile_for_training`` runs: as it is on the GPU; in a dry run with the
    ``aot_eager`` backend (the same graphs traced, no C++ compiler), its checks unchanged."""
    from factory import compilation
    from factory.graph.block_compile import compile_blocks

    if not dry_run:
        return nullcontext()
    patched = partial(compile_blocks, backend="aot_eager")
    return mock.patch.object(compilation, "compile_blocks", patched)


def trainer_step(model: torch.nn.Module, micro: list[Any], blueprint: Any) -> Any:
    """One optimizer step as the trainer takes it (forward/backward over the micro-batches,
    the fp32 masters' AdamW), returning its seconds."""
    from factory.graph.loss import mtp_loss_scale
    from factory.runtime.optimizer import MasterOptimizer
    from factory.runtime.step import forward_backward

    optimizer = MasterOptimizer(model, blueprint.training.optimizer)
    scale = mtp_loss_scale(blueprint.model)
    device = micro[0].input_ids.device

    def step() -> None:
        optimizer.zero_grad()
        forward_backward(model, micro, scale)
        optimizer.grads_to_masters()
        optimizer.step()

    return lambda: timed(step, device)


def prediction(blueprint: Any, flops_per_token: int) -> dict[str, Any]:
    """``factory.plan``'s predicted step for ``blueprint``, with its MFU also of the BF16 peak."""
    import factory
    from factory.schemas.parallelism import GPU_SPECS

    performance = factory.plan(blueprint).performance
    bf16 = GPU_SPECS[performance.gpu].bf16_dense_flops
    return {"gpu": performance.gpu, "step_s": performance.step_seconds,
            "tokens_per_s": performance.tokens_per_s_per_gpu, "mfu": performance.mfu,
            "peak_format": performance.peak_format,
            "mfu_of_bf16_peak": flops_per_token * performance.tokens_per_s_per_gpu / bf16}  # fmt: skip


def measure_recipe(ctx: SectionContext, name: str, overrides: tuple[str, ...]) -> None:
    """Build, compile and time one recipe's model; its figures under ``runs[name]``."""
    import factory
    from factory.compilation import compile_for_training
    from factory.planner.flops import flops_per_token

    blueprint = load(ctx.dry_run, overrides)
    count, batch, seq = shape = step_shape(blueprint, ctx.dry_run)
    flops = flops_per_token(blueprint.model, seq).exact
    run: dict[str, Any] = {"tokens_per_step": count * batch * seq, "flops_per_token": flops}
    run["prediction"] = attempt(ctx, f"{name} prediction", lambda: prediction(blueprint, flops))
    run["planned_memory_bytes"] = factory.plan(blueprint).memory.total

    def save() -> None:  # as it goes: a section cut off by its budget keeps what it measured
        ctx.record("runs", {**ctx.results.get("runs", {}), name: run})

    save()
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    compiled = factory.compile(blueprint, device=ctx.device, seed=0, dtype=torch.bfloat16,
                               precision="auto")  # fmt: skip
    runtime = compiled.precision
    run["linears_per_format"] = dict(runtime.recipes()) if runtime is not None else {}
    try:
        with compiling(ctx.dry_run):
            compile_for_training(compiled)
        run["compiled"] = True
    except ValueError as refusal:  # training.compile refused this policy: timed eager
        run["compiled"], run["compile_refused"] = False, str(refusal)
    save()
    model = compiled.model.train()
    step = trainer_step(model, micro_batches(blueprint, shape, ctx.device), blueprint)
    run["first_step_s"] = step()
    save()
    repeats, warmup = (1, 0) if ctx.dry_run else (3, 1)
    seconds = interleaved({name: step}, repeats, warmup)[name]
    median = sorted(seconds)[len(seconds) // 2]
    peak = bf16_peak(ctx.device)
    rate = run["tokens_per_step"] / median
    run.update(step_s=median, times_s=seconds, tokens_per_s=rate,
               mfu=None if peak is None else flops * rate / peak)  # fmt: skip
    if cuda:
        run["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        run["memory_over_plan"] = run["peak_memory_bytes"] / run["planned_memory_bytes"]
    save()


def run(ctx: SectionContext) -> None:
    blueprint = load(ctx.dry_run)
    count, batch, seq = step_shape(blueprint, ctx.dry_run)
    ctx.record("blueprint", {"name": blueprint.meta.name, "pattern": blueprint.model.pattern,
                             "micro_batches": count, "micro_batch_size": batch, "seq_len": seq,
                             "routed_experts": blueprint.model.moe.num_experts,
                             "documents_per_sequence": DOCUMENTS})  # fmt: skip
    ctx.record("goal_mfu", GOAL_MFU)
    for name, overrides in RECIPES.items():
        attempt(ctx, f"{name} step", lambda n=name, o=overrides: measure_recipe(ctx, n, o))
        release(ctx.device)


def release(device: torch.device) -> None:
    """Free what one recipe's model held (its compiled graphs too), whether it ended or failed:
    the next model needs the device's memory, and its peak is measured from zero."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def markdown(results: dict[str, Any]) -> str:
    bp = results.get("blueprint", {})
    text = (f"Blueprint {bp.get('name')} (`{bp.get('pattern')}`, {bp.get('routed_experts')} "
            f"routed experts), {bp.get('micro_batches')} micro-batches of "
            f"{bp.get('micro_batch_size')} x {bp.get('seq_len')} tokens per step, "
            f"{bp.get('documents_per_sequence')} packed documents per sequence. MFU of the "
            "dense BF16 peak; memory: `max_memory_allocated` over the plan's total.\n\n")  # fmt: skip
    goals = results.get("goal_mfu", {})
    rows = []
    for name, r in results.get("runs", {}).items():
        predicted = r.get("prediction") or {}
        mode = "compiled" if r.get("compiled") else ("eager" if "compiled" in r else None)
        memory = r.get("peak_memory_bytes")
        rows.append([name, mode, r.get("tokens_per_step"), r.get("first_step_s"), r.get("step_s"),
                     r.get("tokens_per_s"), r.get("mfu"), goals.get(name),
                     predicted.get("tokens_per_s"), predicted.get("mfu_of_bf16_peak"),
                     None if memory is None else memory / 2**30,
                     r["planned_memory_bytes"] / 2**30, r.get("memory_over_plan")])  # fmt: skip
    text += table(["recipe", "blocks", "tokens/step", "first step s", "step s", "tokens/s", "MFU",
                   "goal MFU", "predicted tokens/s", "predicted MFU", "peak GiB", "plan GiB",
                   "peak / plan"], rows)  # fmt: skip
    for name, r in results.get("runs", {}).items():
        if r.get("compile_refused"):
            text += f"\n{name}: `training.compile` refused ({r['compile_refused']}); timed eager.\n"
        if r.get("linears_per_format"):
            text += f"\n{name}: linears per format {r['linears_per_format']}.\n"
    return text
