"""One fp32 training step (forward + backward + AdamW) on CPU: ours vs transformers' NemotronH.

Both models hold the same weights: ours is built by ``factory.compile`` and
exported with ``export_hf``; theirs is that export loaded through
``AutoModelForCausalLM`` (its pure-PyTorch path; ``mamba_ssm`` is not needed).
They see the same batch, the same loss (plain next-token cross-entropy: our
MoE aux loss is computed but left out, so both optimise the same objective)
and the same AdamW settings. Steps are interleaved, ours then theirs, so that
machine noise hits both alike. The goal (issue: train step) is a ratio >= 2.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import describe

BATCH, SEQ, LR = 4, 512, 1e-4

BLUEPRINT = {
    "meta": {"name": "train-step-proxy"},
    "model": {
        "pattern": "MEMEM*EMEM*E",
        "hidden_size": 512,
        "vocab_size": 4096,
        "max_seq_len": 4096,
        "attention": {"heads": 8, "kv_heads": 2, "head_dim": 64},
        "mamba": {"heads": 16, "head_dim": 64, "state_size": 64, "groups": 2, "conv_kernel": 4},
        "moe": {
            "num_experts": 16,
            "top_k": 4,
            "expert_intermediate_size": 256,
            "shared_expert_intermediate_size": 512,
            "latent_size": 128,
            "router": {"score_function": "sigmoid", "expert_bias": True, "normalize_top_k": True},
        },
    },
    "parallelism": {"world_size": 1, "global_batch_size": BATCH},
    "data": {"recipe": "nano", "seq_len": SEQ, "tokens": "1B"},
    "training": {"optimizer": {"lr": LR}, "steps": 100},
}

Step = Callable[[], float]


def build_models() -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """Ours and transformers' model with identical weights; also a note on their kernels."""
    from transformers import AutoModelForCausalLM

    import factory
    from factory.exports.hf import export_hf
    from factory.schemas import Blueprint

    blueprint = Blueprint.model_validate(BLUEPRINT)
    ours = factory.compile(blueprint, device="cpu", seed=0).model
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(ours, blueprint, Path(tmp) / "hf")
        theirs = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
    config = theirs.config
    note = (
        f"{type(theirs).__name__}, attn={config._attn_implementation}, "
        f"experts={config._experts_implementation}"
    )
    return ours, theirs, note


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids) if not hasattr(model, "config") else model(ids, use_cache=False).logits
    return out


def max_logit_diff(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor) -> float:
    ours.eval(), theirs.eval()
    with torch.no_grad():
        diff = (logits_of(ours, ids) - logits_of(theirs, ids)).abs().max().item()
    ours.train(), theirs.train()
    return diff


def make_step(model: torch.nn.Module, ids: torch.Tensor) -> Step:
    """A closure running one full training step and returning its wall time in seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    targets = ids[:, 1:].reshape(-1)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = logits_of(model, ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def profile(step: Step, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train_step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--profile", action="store_true", help="print our step's top ops")
    parser.add_argument("--rows", type=int, default=30, help="rows of the --profile table")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    ours, theirs, note = build_models()
    ids = torch.randint(0, BLUEPRINT["model"]["vocab_size"], (BATCH, SEQ))
    diff = max_logit_diff(ours, theirs, ids)
    params = sum(p.numel() for p in ours.parameters())

    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"model: {BLUEPRINT['model']['pattern']}, {params / 1e6:.1f}M params, fp32")
    print(f"theirs: {note}")
    print(f"batch: {BATCH} x {SEQ} tokens; loss: plain CE for both (our aux loss not added)")
    print(f"eval logits max |ours - theirs|: {diff:.2e} ({'ok' if diff < 1e-4 else 'MISMATCH'})")
    if diff >= 1e-4:
        return 1

    steps = {"ours": make_step(ours, ids), "theirs": make_step(theirs, ids)}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(step())

    tokens = BATCH * SEQ
    median = {name: statistics.median(ts) for name, ts in times.items()}
    for name, seconds in median.items():
        spread = f"min {min(times[name]):.3f} max {max(times[name]):.3f}"
        print(f"{name:7s} median step {seconds:.3f} s ({spread}), {tokens / seconds:,.0f} tokens/s")
    ratio = median["theirs"] / median["ours"]
    print(f"ratio ours/theirs tokens/s: {ratio:.2f} (goal >= 2), {args.steps} steps each")
    if args.profile:
        profile(steps["ours"], args.rows)
    return 0
