"""Calibration for the MoE expert GEMM path choice (``factory.layers.moe.experts.choose_path``).

Times forward + backward of one layer's routed experts at the train_step proxy's shape
(``python -m benchmarks train_step --experts``) through each of the three paths, for
routings from balanced to one expert taking every token, so the rule in ``choose_path``
rests on numbers measured here, not on guesses.
"""

from __future__ import annotations

import statistics
import time

import torch

from factory.kernels.moe_dispatch import route_tokens
from factory.layers.moe.experts import PATHS, ExpertPath, choose_path
from factory.layers.moe.module import RoutedExperts

SKEWS = (0.0, 1.0, 2.0, 6.0)
"""Router logit slopes across the experts: 0 is balanced, 6 sends nearly all to the first k."""


def skewed_routing(tokens: int, experts: int, k: int, skew: float, seed: int) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn with probabilities ``softmax(-skew * e/E*4)``
    so that low-numbered experts get more tokens as a trained router's favourites do."""
    gen = torch.Generator().manual_seed(seed)
    logits = -skew * 4 * torch.arange(experts, dtype=torch.float32) / experts
    probs = logits.softmax(0).expand(tokens, experts)
    return torch.multinomial(probs, k, replacement=False, generator=gen)


def time_path(
    experts: RoutedExperts, x: torch.Tensor, index: torch.Tensor, path: ExpertPath
) -> float:
    """Seconds for routing + forward + backward of the routed experts by one path."""
    experts.path = path
    start = time.perf_counter()
    dispatch = route_tokens(index, experts.up_proj.shape[0])
    experts(x, dispatch, None).square().sum().backward()
    return time.perf_counter() - start


def calibrate(tokens: int, experts: int, k: int, width: int, hidden: int, reps: int) -> None:
    """Print per-path medians and the path ``choose_path`` takes, one row per skew."""
    torch.manual_seed(0)
    module = RoutedExperts(experts, width, hidden, "relu2")
    for p in module.parameters():
        torch.nn.init.normal_(p, std=width**-0.5)
    x = torch.randn(tokens, width, requires_grad=True)
    print(
        f"expert paths: T={tokens} k={k} E={experts} d={width} ff={hidden}, fwd+bwd, "
        f"median of {reps}, ms"
    )
    print(f"{'max/mean':>8} {'E*max/Tk':>8} " + " ".join(f"{p:>10}" for p in PATHS) + "  chosen")
    for skew in SKEWS:
        index = skewed_routing(tokens, experts, k, skew, seed=1)
        dispatch = route_tokens(index, experts)
        load = dispatch.tokens_per_expert.float()
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(reps):  # interleaved, so machine noise hits every path alike
            for path in PATHS:
                times[path].append(time_path(module, x, index, path))
        padding = experts * dispatch.max_tokens_per_expert / (tokens * k)
        cells = " ".join(f"{1e3 * statistics.median(times[p]):10.2f}" for p in PATHS)
        print(f"{load.max() / load.mean():8.2f} {padding:8.2f} {cells}  {choose_path(dispatch, x)}")
    module.path = None
