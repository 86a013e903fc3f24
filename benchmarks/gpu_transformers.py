"""Section ``transformers`` (on request): one BF16 training step of the 1B blueprint
(``benchmarks/blueprints/gpu_1b.yaml``), ours eager against transformers' NemotronH.

Both models hold the same weights: ours is built by ``factory.compile`` in BF16 (router in
fp32) and exported with ``write_hf_checkpoint``; theirs is that export loaded by
``AutoModelForCausalLM`` in BF16 (its PyTorch Mamba path: the device's ``mamba_ssm`` is
built without its CUDA extension, so ``import mamba_ssm`` fails for transformers; factory
loads its Triton kernels without the package ``__init__``, ``factory.kernels.mamba_ssm_triton``).
Both see the same batch (the blueprint's micro-batch x seq_len of random
tokens, halved while theirs runs out of memory) and run forward, backward and a plain
``torch.optim.AdamW`` step on their BF16 parameters. Ours computes its training loss
(next-token CE, the MTP depth at its loss scale, the router's aux loss); theirs has no MTP
and computes plain CE. The two steps run interleaved, so noise hits each alike.

Reported: tokens/s per model; MFU = the plan's exact training FLOPs per token (for theirs
without the MTP share, which it does not run) x tokens/s / the device's dense BF16 peak;
the largest logit difference between the two in eval (BF16: a few 1e-2 is rounding). Its
figures are recorded (BENCHMARKS.md, "gpu": ours 6.5x theirs) and issue 38 does not change
theirs, so a plain ``python -m benchmarks gpu`` leaves it out. The dry run does all of it on
the blueprint's CPU proxy at a tiny batch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_common import SectionContext, attempt
from benchmarks.gpu_train import (
    Step,
    our_step,
    prepare,
    random_batch,
    rates,
    step_table,
    timed_step,
)
from benchmarks.timing import interleaved

TITLE = "Training step in BF16, 1B blueprint: ours vs transformers"
BUDGET_S = 100
"""On an H100: building and exporting 1B parameters (~30 s), theirs loading them, then 1
warm-up and 4 timed rounds of two ~0.2-1.5 s steps."""


def their_step(model: torch.nn.Module, ids: torch.Tensor) -> Step:
    """Theirs: next-token cross-entropy on its logits, backward, AdamW."""

    def loss() -> torch.Tensor:
        logits = model(ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    return timed_step(model, loss, ids.device)


def load_theirs(ours: torch.nn.Module, blueprint: Any, device: torch.device) -> torch.nn.Module:
    """transformers' model loaded in BF16 from our HF export of ``ours``."""
    from transformers import AutoModelForCausalLM

    from factory.exports.hf import write_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        write_hf_checkpoint(ours, blueprint, Path(tmp) / "hf")
        theirs = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.bfloat16)
    return theirs.to(device).train()


@torch.no_grad()
def max_logit_difference(
    ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor
) -> float:
    ours.eval(), theirs.eval()
    diff = (ours(ids).logits.float() - theirs(ids, use_cache=False).logits.float()).abs().max()
    ours.train(), theirs.train()
    return float(diff)


def _beside_theirs(
    ours: torch.nn.Module,
    theirs: torch.nn.Module,
    blueprint: Any,
    shape: tuple[int, int],
    mtp_scale: float,
    device: torch.device,
) -> tuple[dict[str, Step], int]:
    """Ours and theirs eager on one batch, each stepped once, and that batch's size: the
    blueprint's micro-batch, halved while theirs runs out of memory (its PyTorch Mamba
    path, without ``mamba_ssm``, holds far more activations than ours)."""
    batch, seq = shape
    while True:
        ids = random_batch(blueprint, (batch, seq), device)
        pair = {
            "ours eager": our_step(ours, ids, mtp_scale),
            "theirs eager": their_step(theirs, ids),
        }
        try:
            for step in pair.values():
                step()
            return pair, batch
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            del pair
            batch //= 2
            torch.cuda.empty_cache()


def run(ctx: SectionContext) -> None:
    setup = prepare(ctx)
    blueprint, batch, seq, ours, ids = (setup.blueprint, setup.batch, setup.seq, setup.ours,
                                        setup.ids)  # fmt: skip
    scale, flops, peak = setup.mtp_scale, setup.flops, setup.peak
    repeats, warmup = (1, 0) if ctx.dry_run else (4, 1)
    theirs = load_theirs(ours, blueprint, ctx.device)
    difference = attempt(ctx, "logits", lambda: max_logit_difference(ours, theirs, ids))
    ctx.record("max_logit_difference", difference)
    pair, shared = _beside_theirs(ours, theirs, blueprint, (batch, seq), scale, ctx.device)
    ctx.record("comparison_batch", shared)
    ctx.record("blueprint", {**ctx.results["blueprint"], "batch": shared})
    ctx.record("steps", rates(interleaved(pair, repeats, warmup), shared * seq, flops, peak))


def markdown(results: dict[str, Any]) -> str:
    bp = results.get("blueprint", {})
    difference = results.get("max_logit_difference")
    text = (f"Blueprint {bp.get('name')} ({results.get('parameters', 0) / 1e6:,.0f}M parameters), "
            f"batch {bp.get('batch')} x {bp.get('seq_len')}; max |logit difference| ours vs "
            f"theirs: {'n/a' if difference is None else f'{difference:.3g}'}\n\n")  # fmt: skip
    return text + step_table({"steps": results.get("steps", {})})
