"""One fp32 training step (forward + backward + AdamW) on CPU: ours vs transformers' NemotronH.

Both models hold the same weights: ours is built by ``factory.compile`` and
exported with ``write_hf_checkpoint``; theirs is that export loaded through
``AutoModelForCausalLM`` (its pure-PyTorch path: no ``mamba_ssm``, no
``causal_conv1d``). They see the same batch, the same loss (plain next-token
cross-entropy; our MoE aux loss is computed in train mode but not added, so
both optimise the same objective) and the same AdamW settings. Steps are
interleaved, ours then theirs, so that machine noise hits both alike.

The yardstick is the GEMM floor: the step's GEMM FLOPs (profiler) over this machine's fp32
SGEMM peak measured in the same run. Goals (issue #16): ours <= 1.2x the floor and >= 1.35x
theirs, for balanced routing and for a skewed one (``skew_routers``) where the padded-bmm
expert path would multiply up to E/k times the rows. The floor's FLOPs are the smaller of the
two models' counts, so a forced ``--expert-path padded_bmm`` run does not lower its own bar
by its padding (it can still raise it to theirs, which counts extra Mamba GEMMs).
``--compile`` runs both with their non-MoE blocks under ``torch.compile`` (``compile_both``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.machine import describe
from benchmarks.timing import interleaved, load_average, report
from factory.layers.moe.experts import PATHS
from factory.layers.moe.module import RoutedExperts

BATCH, SEQ, LR = 4, 512, 1e-4

BLUEPRINT = {
    "meta": {"name": "train-step-proxy"},
    "model": {
        "pattern": "MEMEM*EMEM*E",
        "hidden_size": 512,
        "vocab_size": 4096,
        "max_seq_len": 4096,
        "attention": {"heads": 8, "kv_heads": 2, "head_dim": 64},
        # transformers clamps dt from below at time_step_min, which exports carry as dt_min
        # (0.001, as released configs do); training clamps at dt_limit_min (0, Megatron's).
        # Equal clamps make both models compute the same function (docs/architecture.md,
        # "dt clamp and init"): at 0, these random weights reach dt < 0.001 and the logits
        # differ by ~2e-3. The clamp is one op either way, so the timing is unchanged.
        "mamba": {
            "heads": 16,
            "head_dim": 64,
            "state_size": 64,
            "groups": 2,
            "conv_kernel": 4,
            "dt_limit_min": 0.001,
        },
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
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")
SKEW = 0.2
"""Expert bias scale of the skewed variant: about 3-3.5x the mean load on the top experts."""


def build_models(skew: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours, and transformers' model loaded from our HF export (identical weights). With
    ``skew`` > 0 the routers' expert biases favour the low-numbered experts first."""
    from transformers import AutoModelForCausalLM

    import factory
    from factory.exports.hf import write_hf_checkpoint
    from factory.schemas import Blueprint

    blueprint = Blueprint.model_validate(BLUEPRINT)
    ours = factory.compile(blueprint, device="cpu", seed=0).model
    skew_routers(ours, skew)
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_checkpoint(ours, blueprint, Path(tmp) / "hf")
        theirs = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
    return ours, theirs


@torch.no_grad()
def skew_routers(model: torch.nn.Module, skew: float) -> None:
    """Skewed routing as a trained router has it: expert e's bias is ``skew * 0.5**e``, so
    a few experts win most top-k choices. The bias only picks experts (the weights stay the
    unbiased scores) and exports as ``e_score_correction_bias``, so theirs routes alike."""
    from factory.layers.moe.module import Router

    for module in model.modules():
        if isinstance(module, Router) and module.e_score_correction_bias is not None:
            experts = module.num_experts
            module.e_score_correction_bias.copy_(skew * 0.5 ** torch.arange(experts))


def load_skew(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """Measured max/mean expert load on this batch: the mean over MoE layers of each
    layer's max/mean, and the largest over layers."""
    model.eval()
    with torch.no_grad():
        loads = model(ids).tokens_per_expert.values()
    model.train()
    ratios = [float(load.max() / load.float().mean()) for load in loads]
    return sum(ratios) / len(ratios), max(ratios)


def compile_both(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """``torch.compile`` the blocks of both models: ours by ``compile_blocks`` (the MoE blocks
    too where their dispatch is sync-free: BF16 ``_grouped_mm``), theirs the decoder layers
    whose Hugging Face block type has static shapes (every type but MoE: transformers' experts
    loop reads the counts on the host). The warm-up steps pay the compile."""
    from factory.graph.block_compile import compile_blocks
    from factory.spec.layer_type import LAYER_TYPES

    compile_blocks(ours)
    static = {t.hf_block_type for t in LAYER_TYPES.values() if t.static_shapes}
    for layer in theirs.model.layers:
        if layer.block_type in static:
            layer.compile(dynamic=False)


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
        return "GEMM (mm/addmm/bmm/baddbmm/_grouped_mm)"
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


def sgemm_peak(repeats: int = 3) -> float:
    """This machine's fp32 GEMM rate now, in FLOP/s: the best of ``repeats`` runs of a 4096^3
    ``torch.mm`` and of the step's largest GEMM (the head, [B*S, d] x [d, V])."""
    shapes = [(4096, 4096, 4096), (BATCH * SEQ, BLUEPRINT["model"]["hidden_size"], 4096)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)  # warm-up: first-call allocation and thread start
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


def _grouped_mm_flops(shapes: list[list[int]]) -> float:
    """The profiler counts no FLOPs for ``_grouped_mm``; every form the experts use (2D x 3D
    forward and input gradient, 2D x 2D weight gradient) does 2 * numel(a) * b.shape[-1]."""
    a, b = shapes[0], shapes[1]
    return 2.0 * math.prod(a) * b[-1]


def _alone(key: str, shapes: list[list[int]], repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds of one GEMM of these shapes run on its own, on fresh
    contiguous operands. A ``_grouped_mm`` runs as the one ``mm`` of its FLOPs: the rate a
    GEMM of that size reaches here, not the ragged split's."""
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    if key in ("aten::addmm", "aten::baddbmm"):  # (bias, a, b): the bias is added, not multiplied
        a, b, bias = b, torch.randn(shapes[2]), a
        add = torch.addmm if key == "aten::addmm" else torch.baddbmm
        call = lambda: add(bias, a, b)  # noqa: E731
    elif key == "aten::bmm":
        call = lambda: torch.bmm(a, b)  # noqa: E731
    else:
        b = b if b.ndim == 2 else b[0]
        call = lambda: torch.mm(a, b)  # noqa: E731
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_work(step: Step) -> dict[str, float]:
    """One profiled step's GEMMs (mm/addmm/bmm/baddbmm/_grouped_mm; ``linear`` counts through the
    addmm/mm it calls): FLOPs, self CPU seconds in the step, and seconds for the same GEMMs
    each run alone at its own shape (the floor at the step's shapes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True
    ) as prof:
        step()
    work = {"flops": 0.0, "seconds": 0.0, "alone": 0.0}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in GEMMS:
            continue
        work["seconds"] += event.self_cpu_time_total / 1e6
        work["alone"] += _alone(event.key, event.input_shapes) * event.count
        if event.key == "aten::_grouped_mm":
            work["flops"] += _grouped_mm_flops(event.input_shapes) * event.count
        else:
            work["flops"] += event.flops or 0  # summed over the calls of that shape
    return work


def run_variant(name: str, skew: float, args: argparse.Namespace, peak: float) -> dict[str, float]:
    """Logits check, measured load, interleaved timing and the GEMM floor of one routing."""
    torch.manual_seed(0)
    ours, theirs = build_models(skew)
    for module in ours.modules():
        if isinstance(module, RoutedExperts):
            module.path = args.expert_path  # None: chosen per call by the load
    eager = [copy.deepcopy(ours), copy.deepcopy(theirs)] if args.compile else []
    if args.compile:
        compile_both(ours, theirs)
    fwd = forwards(ours, theirs)
    ids = torch.randint(0, BLUEPRINT["model"]["vocab_size"], (BATCH, SEQ))
    diff = max_logit_diff([ours, theirs], fwd, ids)
    mean_skew, max_skew = load_skew(ours, ids)
    print(
        f"\n[{name}] expert bias scale {skew}: expert load max/mean {mean_skew:.2f} "
        f"(mean over MoE layers), {max_skew:.2f} (worst layer)"
    )
    print(f"eval logits max |ours - theirs|: {diff:.2e} ({'ok' if diff < 1e-4 else 'MISMATCH'})")
    if diff >= 1e-4:
        raise SystemExit(1)
    steps = {n: make_step(m, fwd[n], ids) for n, m in (("ours", ours), ("theirs", theirs))}
    eager_steps = {}  # with --compile, the eager models run in the same rounds
    if eager:
        eager_fwd = forwards(*eager)
        for n, m in zip(("ours", "theirs"), eager, strict=True):
            eager_steps[f"{n} eager"] = make_step(m, eager_fwd[n], ids)
    load_before = load_average()
    median = report(interleaved(steps | eager_steps, args.steps, args.warmup), tokens=BATCH * SEQ)
    print(f"1-min load average before/after timing: {load_before:.2f}/{load_average():.2f}")
    if eager:
        print(
            f"eager in the same rounds: ours/theirs tokens/s "
            f"{median['theirs eager'] / median['ours eager']:.2f}; compiled blocks make ours "
            f"{median['ours eager'] / median['ours']:.2f}x and theirs "
            f"{median['theirs eager'] / median['theirs']:.2f}x as fast"
        )
    work = {n: gemm_work(step) for n, step in steps.items()}
    flops = min(w["flops"] for w in work.values())  # the work both must do, padding aside
    floor, alone = flops / peak, min(w["alone"] for w in work.values())
    for n, w in work.items():
        print(
            f"{n:6s} GEMMs {w['flops'] / 1e9:6.1f} GFLOP, {w['seconds']:.3f} s in the step "
            f"({w['flops'] / w['seconds'] / 1e9:.0f} GFLOP/s), {w['alone']:.3f} s alone; "
            f"step {median[n]:.3f} s = {median[n] / floor:.2f}x the floor"
        )
    print(
        f"floor {flops / 1e9:.1f} GFLOP / peak = {floor:.3f} s (at the step's own shapes "
        f"{alone:.3f} s); ours/theirs tokens/s {median['theirs'] / median['ours']:.2f} "
        "(goals: ours <= 1.2x the floor, >= 1.35x theirs)"
    )
    if args.profile:
        profile(f"ours [{name}]", steps["ours"], args.rows)
        profile(f"theirs [{name}]", steps["theirs"], 0)
    return {
        "floor": floor,
        "ours": median["ours"],
        "theirs": median["theirs"],
        "skew": mean_skew,
        "flops": flops,
        "alone": alone,
        **{k.replace(" ", "_"): median[k] for k in eager_steps},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train_step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--profile", action="store_true", help="profile one step of each")
    parser.add_argument("--rows", type=int, default=25, help="top ops listed for ours")
    parser.add_argument("--variants", default="balanced,skewed", help="routings to run")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the non-MoE blocks of both models"
    )
    parser.add_argument("--experts", action="store_true", help="calibrate expert GEMM paths")
    parser.add_argument(
        "--expert-path", choices=PATHS, help="force our expert GEMM path (default: by load)"
    )
    args = parser.parse_args(argv)
    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.experts:
        from benchmarks.train_step_experts import calibrate

        moe = BLUEPRINT["model"]["moe"]
        for tokens in (BATCH * SEQ, 256, 32):  # the step's tokens, and small batches
            calibrate(
                tokens,
                moe["num_experts"],
                moe["top_k"],
                moe["latent_size"],
                moe["expert_intermediate_size"],
                reps=max(args.steps, 3),
            )
        return 0
    print(
        f"model: {BLUEPRINT['model']['pattern']}, fp32, batch {BATCH} x {SEQ} tokens; "
        "loss: plain CE for both (our aux loss not added); "
        f"{'non-MoE blocks compiled in both' if args.compile else 'eager'}"
    )
    peak = sgemm_peak()
    print(f"fp32 SGEMM peak now (best of 4096^3 and the head's GEMM): {peak / 1e9:.0f} GFLOP/s")
    skews = {"balanced": 0.0, "skewed": SKEW}
    results = {v: run_variant(v, skews[v], args, peak) for v in args.variants.split(",")}
    print(
        "\n| routing | load max/mean | GEMM GFLOP | floor | floor at shapes | ours | theirs "
        "| ours/floor | ours vs theirs |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for v, r in results.items():
        print(
            f"| {v} | {r['skew']:.2f} | {r['flops'] / 1e9:.1f} | {r['floor']:.3f} s | "
            f"{r['alone']:.3f} s | "
            f"{r['ours']:.3f} s | {r['theirs']:.3f} s | {r['ours'] / r['floor']:.2f}x | "
            f"{r['theirs'] / r['ours']:.2f}x |"
        )
    if args.compile:
        print(
            "\n| routing | ours eager | theirs eager | ours vs theirs, eager | ours compiled "
            "| theirs compiled | ours vs theirs, compiled |\n|---|---:|---:|---:|---:|---:|---:|"
        )
        for v, r in results.items():
            print(
                f"| {v} | {r['ours_eager']:.3f} s | {r['theirs_eager']:.3f} s | "
                f"{r['theirs_eager'] / r['ours_eager']:.2f}x | {r['ours']:.3f} s | "
                f"{r['theirs']:.3f} s | {r['theirs'] / r['ours']:.2f}x |"
            )
    return 0
