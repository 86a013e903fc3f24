"""One fp32 training step (forward + backward + AdamW) on CPU: ours vs transformers' NemotronH.

Both models hold the same weights: ours is built by ``factory.compile`` and
exported with ``export_hf``; theirs is that export loaded through
``AutoModelForCausalLM`` (its pure-PyTorch path: no ``mamba_ssm``, no
``causal_conv1d``). They see the same batch, the same loss (plain next-token
cross-entropy; our MoE aux loss is computed in train mode but not added, so
both optimise the same objective) and the same AdamW settings. Steps are
interleaved, ours then theirs, so that machine noise hits both alike. The
goal is ours >= 2x theirs in tokens/s.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import describe
from benchmarks.timing import interleaved, load_average, report

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

Forward = Callable[[torch.Tensor], torch.Tensor]
Step = Callable[[], float]
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")


def build_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours, and transformers' model loaded from our HF export (identical weights)."""
    from transformers import AutoModelForCausalLM

    import factory
    from factory.exports.hf import export_hf
    from factory.schemas import Blueprint

    blueprint = Blueprint.model_validate(BLUEPRINT)
    ours = factory.compile(blueprint, device="cpu", seed=0).model
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(ours, blueprint, Path(tmp) / "hf")
        theirs = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
    return ours, theirs


def forwards(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict[str, Forward]:
    """input ids -> logits [B, S, V] for each model."""
    return {
        "ours": lambda ids: ours(ids).logits,
        "theirs": lambda ids: theirs(ids, use_cache=False).logits,
    }


def max_logit_diff(
    models: list[torch.nn.Module], fwd: dict[str, Forward], ids: torch.Tensor
) -> float:
    for model in models:
        model.eval()
    with torch.no_grad():
        diff = (fwd["ours"](ids) - fwd["theirs"](ids)).abs().max().item()
    for model in models:
        model.train()
    return diff


def make_step(model: torch.nn.Module, forward: Forward, ids: torch.Tensor) -> Step:
    """A closure running one full training step and returning its wall time in seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    targets = ids[:, 1:].reshape(-1)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = forward(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def _category(op: str) -> str:
    if op in GEMMS:
        return "GEMM (mm/addmm/bmm)"
    if "scaled_dot_product" in op:
        return "SDPA attention"
    if op in ("aten::copy_", "aten::fill_", "aten::cat", "aten::flip", "aten::constant_pad_nd"):
        return "copies/fills"
    if "index" in op or op in ("aten::gather", "aten::scatter_"):
        return "gather/scatter/index"
    if "conv" in op:
        return "conv1d"
    return "other elementwise/reductions"


def profile(name: str, step: Step, rows: int) -> None:
    """Self CPU time of one step by op category; with rows > 0 also the top ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    by_category: collections.Counter[str] = collections.Counter()
    for event in events:
        by_category[_category(event.key)] += event.self_cpu_time_total
    print(f"\n{name}: profiled step {wall:.3f} s wall, {total / 1e6:.3f} s self CPU")
    for category, micros in by_category.most_common():
        print(f"  {category:30s} {micros / 1e6:6.3f} s {100 * micros / total:5.1f}%")
    if rows:
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train_step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--profile", action="store_true", help="profile one step of each")
    parser.add_argument("--rows", type=int, default=25, help="top ops listed for ours")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    ours, theirs = build_models()
    fwd = forwards(ours, theirs)
    ids = torch.randint(0, BLUEPRINT["model"]["vocab_size"], (BATCH, SEQ))
    diff = max_logit_diff([ours, theirs], fwd, ids)
    params = sum(p.numel() for p in ours.parameters())
    config = theirs.config

    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"model: {BLUEPRINT['model']['pattern']}, {params / 1e6:.1f}M params, fp32")
    print(
        f"theirs: {type(theirs).__name__} (pure PyTorch), attn={config._attn_implementation}, "
        f"experts={config._experts_implementation}"
    )
    print(f"batch: {BATCH} x {SEQ} tokens; loss: plain CE for both (our aux loss not added)")
    print(f"eval logits max |ours - theirs|: {diff:.2e} ({'ok' if diff < 1e-4 else 'MISMATCH'})")
    if diff >= 1e-4:
        return 1

    steps = {
        name: make_step(model, fwd[name], ids)
        for name, model in (("ours", ours), ("theirs", theirs))
    }
    load_before = load_average()
    times = interleaved(steps, args.steps, args.warmup)
    median = report(times, tokens=BATCH * SEQ)
    ratio = median["theirs"] / median["ours"]
    print(f"ratio ours/theirs tokens/s: {ratio:.2f} (goal >= 2), {args.steps} steps each")
    print(f"1-min load average before/after timing: {load_before:.2f}/{load_average():.2f}")
    if args.profile:
        profile("ours", steps["ours"], args.rows)
        profile("theirs", steps["theirs"], 0)
    return 0
