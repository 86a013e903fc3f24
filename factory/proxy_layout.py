"""A CPU proxy that keeps its blueprint's parallel layout, as far as the proxy allows.

``factory train --proxy`` launched on W processes trains the proxy
(``factory.proxy``) on W ranks. The proxy has few heads, experts and layers,
so the source's degrees may not fit it: each degree is kept when the proxy
can run it and reduced otherwise, and every change is said.

The rule, in this order, each time taking the largest divisor of the source's
degree that gives a layout the proxy passes ``factory.checks`` with and that
factory's runtime runs (``factory.checks.runtime_rules.runtime_refusals``, which
the launch asks too): context (cp: a blueprint asking for it wants long
sequences checked, and the proxy keeps its seq_len), pipeline (pp: 1 under
context parallelism, which the runtime does not run across stages), tensor (tp,
with sequence parallelism as the source has it, or as the model needs it:
``needs_sequence_parallel``), expert (ep), expert tensor (etp, which must also
divide the proxy's expert width); dp is what is left of W. When the proxy's
global batch of 8 sequences cannot feed dp replicas, it grows to the least
multiple that can.
"""

from __future__ import annotations

from typing import Any

from factory.checks import run_rules
from factory.checks.runtime_rules import needs_sequence_parallel, runtime_refusals
from factory.layers.model_spec import expert_layer_types
from factory.planner.layout import data_parallel_size, resolve_layout
from factory.proxy import PROXY_GLOBAL_BATCH, derive_proxy
from factory.schemas.blueprint import Blueprint

__all__ = ["ProxyLayout", "derive_proxy_layout", "proxy_with_layout"]

DEGREES = ("cp", "pp", "tp", "ep", "etp")
"""The degrees the proxy keeps where it can, in the order they are chosen."""


class ProxyLayout(tuple[Blueprint, list[str]]):
    """(the proxy blueprint, what changed in the layout, one sentence each)."""


def _divisors_down(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def proxy_with_layout(proxy: Blueprint, world: int, degrees: dict[str, Any]) -> Blueprint | None:
    """``proxy`` on ``world`` ranks with ``degrees`` (``pp``, ``tp``, ``ep``, ``cp`` and ``etp``
    (1 when absent), ``sp``: sequence parallelism where tp > 1), dp the rest; None if that
    breaks a validation rule or factory's runtime does not run it."""
    tp, pp, ep = degrees["tp"], degrees["pp"], degrees["ep"]
    cp, etp = degrees.get("cp", 1), degrees.get("etp", 1)
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        return None
    per_step = proxy.parallelism.micro_batch_size * data_parallel_size(world, tp, cp, pp)
    batch = -(-PROXY_GLOBAL_BATCH // per_step) * per_step
    data = proxy.model_dump(exclude_unset=True)
    data["parallelism"].update(
        world_size=world, tp=tp, pp=pp, ep=ep, etp=etp, cp=cp,
        sequence_parallel=degrees["sp"] and tp > 1, global_batch_size=batch,
    )  # fmt: skip
    if pp == 1:
        data["model"]["pattern"] = data["model"]["pattern"].replace("|", "")
    try:
        candidate = Blueprint.model_validate(data)
    except ValueError:
        return None
    errors = [f for _, f in run_rules(candidate) if f.severity == "error"]
    return None if errors or runtime_refusals(candidate) else candidate


def derive_proxy_layout(
    bp: Blueprint, world_size: int, width: int = 256, proxy: Blueprint | None = None
) -> ProxyLayout:
    """``bp``'s proxy (``proxy`` where the caller derived it: a program's stage,
    ``factory.proxy.derive_program_proxy``) laid out on ``world_size`` ranks, and the changes
    made to the layout."""
    proxy = derive_proxy(bp, width) if proxy is None else proxy
    if world_size == 1:
        return ProxyLayout((proxy, []))
    par = bp.parallelism
    has_moe = bool(expert_layer_types(bp.model))
    wanted = {
        "cp": par.cp,
        "pp": par.pp,
        "tp": par.tp,
        "ep": par.ep if has_moe else 1,
        "etp": par.expert_tp if has_moe else 1,
    }
    sp = par.sequence_parallel or needs_sequence_parallel(bp.model)
    degrees: dict[str, Any] = {**dict.fromkeys(DEGREES, 1), "sp": sp}
    for name in DEGREES:
        for value in _divisors_down(wanted[name]):
            if proxy_with_layout(proxy, world_size, {**degrees, name: value}) is not None:
                degrees[name] = value
                break
    chosen = proxy_with_layout(proxy, world_size, degrees)
    assert chosen is not None  # all-ones on world_size ranks is pure data parallelism
    changes = [
        f"{name} {wanted[name]} -> {degrees[name]}"
        for name in DEGREES
        if degrees[name] != wanted[name]
    ]
    if par.world_size != world_size:
        changes.insert(0, f"world_size {par.world_size} -> {world_size}")
    if chosen.parallelism.global_batch_size != PROXY_GLOBAL_BATCH:
        changes.append(
            f"global_batch_size {PROXY_GLOBAL_BATCH} -> {chosen.parallelism.global_batch_size} "
            f"(dp {resolve_layout(chosen).dp})"
        )
    return ProxyLayout((chosen, changes))
