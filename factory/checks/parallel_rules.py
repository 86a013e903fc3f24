"""Rules on the ``parallelism`` section against the model, data and GPU.

Megatron-Core factorises the world twice, TP·CP·DP·PP for dense layers and
ETP·EP·EDP·PP for experts (``docs/parallelism.md``, 'Two grids'), and
checks each factor against the layer it shards. These rules report the same
conditions before a job is launched, in Megatron's words where it has them.
Every division is guarded: a rule never crashes on a layout another rule
already rejects.
"""

from __future__ import annotations

from collections.abc import Iterator

from factory.checks.registry import Finding, layer_rule, rule
from factory.dotted_paths import join_path
from factory.layers.model_spec import expert_layer_types
from factory.planner.layout import data_parallel_size, expert_data_parallel_size
from factory.schemas.blueprint import Blueprint
from factory.schemas.parallelism import GPU_SPECS
from factory.spec.layer_type import LayerType

__all__: list[str] = []


def _dp(bp: Blueprint) -> int | None:
    """The layout's data-parallel size, or None when tp*cp*pp does not divide the world."""
    par = bp.parallelism
    if par.world_size % (par.tp * par.cp * par.pp):
        return None
    return data_parallel_size(par.world_size, par.tp, par.cp, par.pp)


def _edp(bp: Blueprint) -> int | None:
    """Derived expert data-parallel size, or None when etp*ep*pp does not divide the world."""
    par = bp.parallelism
    if par.world_size % (par.expert_tp * par.ep * par.pp):
        return None
    return expert_data_parallel_size(par.world_size, par.ep, par.expert_tp, par.pp)


def _vpp(bp: Blueprint) -> int:
    """Virtual stages per rank: written, else '|' segments / pp, else 1."""
    par, parsed = bp.parallelism, bp.model.parsed_pattern
    if par.vpp is not None:
        return par.vpp
    if parsed.has_pipes:
        return max(1, len(parsed.segments) // par.pp)
    return 1


def _configured(kind: LayerType, bp: Blueprint) -> bool:
    """The pattern uses ``kind`` and the blueprint has its section (``model.layer_sections``
    reports a missing one)."""
    if not kind.used_by(bp.model):
        return False
    return kind.section is None or getattr(bp.model, kind.section) is not None


@rule("parallelism.world_size")
def world_size(bp: Blueprint) -> Iterator[Finding]:
    """The world factorises as TP·CP·DP·PP; a written dp must match the derived one."""
    par = bp.parallelism
    model_size = par.tp * par.cp * par.pp
    dp = _dp(bp)
    if dp is None:
        yield Finding(
            "parallelism.world_size",
            f"world_size ({par.world_size}) is not divisible by tp*cp*pp = "
            f"{par.tp}*{par.cp}*{par.pp} = {model_size}",
        )
    elif par.dp is not None and par.dp != dp:
        yield Finding(
            "parallelism.dp",
            f"dp={par.dp} but world_size/(tp*cp*pp) = {par.world_size}/{model_size} = {dp}",
        )


@rule("parallelism.expert_grid")
def expert_grid(bp: Blueprint) -> Iterator[Finding]:
    """The world also factorises as ETP·EP·EDP·PP (MoE parallel folding)."""
    par = bp.parallelism
    if _edp(bp) is None:
        yield Finding(
            "parallelism.ep",
            f"world_size ({par.world_size}) is not divisible by expert grid etp*ep*pp = "
            f"{par.expert_tp}*{par.ep}*{par.pp} = {par.expert_tp * par.ep * par.pp}",
        )


@layer_rule(
    "parallelism.tp",
    applies=lambda kind: type(kind).tp_rules is not LayerType.tp_rules,
    summary=lambda kind: (type(kind).tp_rules.__doc__ or "").strip().splitlines()[0],
)
def tp_layer(kind: LayerType, bp: Blueprint) -> Iterator[Finding]:
    """``parallelism.tp_<name>``: the layer type's own TP rules, where the pattern uses it."""
    if not _configured(kind, bp):
        return
    for message in kind.tp_rules(bp.model, bp.parallelism.tp):
        yield Finding("parallelism.tp", message)


@layer_rule(
    "parallelism.cp",
    applies=lambda kind: type(kind).cp_rules is not LayerType.cp_rules,
    summary=lambda kind: (type(kind).cp_rules.__doc__ or "").strip().splitlines()[0],
)
def cp_layer(kind: LayerType, bp: Blueprint) -> Iterator[Finding]:
    """``parallelism.cp_<name>``: the layer type's own CP rules, where the pattern uses it."""
    if bp.parallelism.cp == 1 or not _configured(kind, bp):
        return
    for message in kind.cp_rules(bp.model, bp.parallelism.tp, bp.parallelism.cp):
        yield Finding("parallelism.cp", message)


@rule("parallelism.ep_experts")
def ep_experts(bp: Blueprint) -> Iterator[Finding]:
    """EP splits the routed experts of the layers that have them, each as its type says."""
    yield from _expert_split(bp, bp.parallelism.ep, "parallelism.ep")


def _expert_split(bp: Blueprint, ep: int, path: str) -> Iterator[Finding]:
    """Findings on splitting ``bp``'s routed experts over ``ep`` ranks, at ``path``."""
    kinds = _routing_kinds(bp)
    if not kinds and ep > 1:
        yield Finding(path, f"ep={ep} needs layers with routed experts (MoE)")
    for message in dict.fromkeys(m for kind in kinds for m in kind.ep_rules(bp.model, ep)):
        yield Finding(path, message)


def _routing_kinds(bp: Blueprint) -> list[LayerType]:
    """The configured layer types of ``bp`` that route tokens to experts."""
    return [kind for kind in expert_layer_types(bp.model) if _configured(kind, bp)]


@rule("parallelism.etp_experts")
def etp_experts(bp: Blueprint) -> Iterator[Finding]:
    """ETP splits each routed expert's matrices, as the expert layers' types say."""
    par = bp.parallelism
    defaulted = " (etp defaults to tp)" if par.etp is None else ""
    yield from _expert_tp_split(bp, par.expert_tp, "parallelism.etp", defaulted)


def _expert_tp_split(bp: Blueprint, etp: int, path: str, note: str = "") -> Iterator[Finding]:
    """Findings on splitting each of ``bp``'s routed experts over ``etp`` ranks, at ``path``
    (ETP without routed experts splits nothing: Megatron ignores it, and it defaults to TP)."""
    kinds = _routing_kinds(bp)
    for message in dict.fromkeys(m for kind in kinds for m in kind.etp_rules(bp.model, etp)):
        yield Finding(path, message + note)


@rule("parallelism.pipeline")
def pipeline(bp: Blueprint) -> Iterator[Finding]:
    """'|' segments fill pp ranks evenly; vpp agrees with them; no-pipe splits are even."""
    par, parsed = bp.parallelism, bp.model.parsed_pattern
    pp, segments = par.pp, len(parsed.segments)
    if parsed.has_pipes:
        if segments % pp:
            yield Finding(
                "parallelism.pp",
                f"the pattern's {segments} '|' segments must be evenly divisible by pp={pp}",
            )
        elif par.vpp is not None and par.vpp != segments // pp:
            yield Finding(
                "parallelism.vpp",
                f"vpp={par.vpp} but {segments} '|' segments over pp={pp} give "
                f"{segments // pp} virtual stages per rank",
            )
    else:
        if par.vpp is not None:
            yield Finding(
                "parallelism.vpp",
                f"vpp={par.vpp} needs '|' stage boundaries in model.pattern "
                "(Megatron does not interleave a pattern without pipes)",
            )
        if pp > 1 and parsed.num_layers % pp:
            yield Finding(
                "parallelism.pp",
                f"pp={pp} must divide num_layers ({parsed.num_layers}) when the pattern has no '|'",
            )
        elif pp > 1:
            yield Finding(
                "model.pattern",
                f"DEPRECATION: pp={pp} with a pattern without '|' separators splits "
                f"{parsed.num_layers} layers evenly; mark the stage boundaries with '|'",
                "warning",
            )
    vpp = _vpp(bp)
    if vpp > 1 and pp == 1:
        why = "" if par.vpp is not None else f" ({segments} '|' segments on pp=1 interleave)"
        yield Finding(
            "parallelism.pp", f"interleaving with vpp={vpp}{why} requires pp > 1, got pp={pp}"
        )


@rule("parallelism.interleaved_microbatches")
def interleaved_microbatches(bp: Blueprint) -> Iterator[Finding]:
    """The interleaved schedule needs a multiple of pp microbatches, at least pp."""
    par, dp = bp.parallelism, _dp(bp)
    if _vpp(bp) <= 1 or par.pp <= 1 or dp is None:
        return
    num_microbatches = par.global_batch_size // (par.micro_batch_size * dp)
    if num_microbatches < par.pp or num_microbatches % par.pp:
        yield Finding(
            "parallelism.global_batch_size",
            f"interleaved schedule needs num_microbatches >= pp and divisible by pp; "
            f"global_batch_size/(micro_batch_size*dp) = {par.global_batch_size}/"
            f"({par.micro_batch_size}*{dp}) = {num_microbatches} microbatches, pp={par.pp}",
        )


@rule("parallelism.seq_len")
def seq_len(bp: Blueprint) -> Iterator[Finding]:
    """CP splits each sequence in 2*cp chunks; SP further splits each CP shard over TP."""
    par, seq = bp.parallelism, bp.data.seq_len
    if par.cp > 1 and seq % (2 * par.cp):
        yield Finding(
            "data.seq_len",
            f"seq_len={seq} must be a multiple of 2*cp = {2 * par.cp} when cp > 1",
        )
    if par.sequence_parallel and par.tp > 1 and seq % par.cp == 0 and (seq // par.cp) % par.tp:
        yield Finding(
            "data.seq_len",
            f"with sequence parallelism, seq_len/cp = {seq}/{par.cp} = {seq // par.cp} "
            f"must be divisible by tp={par.tp}",
        )


@rule("parallelism.global_batch")
def global_batch(bp: Blueprint) -> Iterator[Finding]:
    """The global batch is a whole number of micro-batches on every DP rank."""
    par, dp = bp.parallelism, _dp(bp)
    if dp is not None and par.global_batch_size % (par.micro_batch_size * dp):
        yield Finding(
            "parallelism.global_batch_size",
            f"global batch size ({par.global_batch_size}) is not divisible by micro batch size "
            f"({par.micro_batch_size}) times data parallel size ({dp})",
        )


@rule("parallelism.sequence_parallel")
def sequence_parallel(bp: Blueprint) -> Iterator[Finding]:
    """SP without TP does nothing (``runtime.moe_sequence_parallel`` says when TP needs it)."""
    par = bp.parallelism
    if par.sequence_parallel and par.tp == 1:
        yield Finding(
            "parallelism.sequence_parallel",
            "sequence_parallel has no effect with tp=1; Megatron turns it off",
            "warning",
        )


@rule("parallelism.distributed_optimizer_instances")
def distributed_optimizer_instances(bp: Blueprint) -> Iterator[Finding]:
    """Each partial distributed-optimizer instance shards over an equal slice of DP and EDP."""
    par, k = bp.parallelism, bp.parallelism.distributed_optimizer_instances
    dp, edp = _dp(bp), _edp(bp)
    path = "parallelism.distributed_optimizer_instances"
    if k == 1:
        return
    if dp is not None and (dp * par.cp) % k:
        yield Finding(
            path,
            f"data parallel size dp*cp = {dp}*{par.cp} = {dp * par.cp} is not divisible by {k}",
        )
    if edp is not None and edp % k:
        yield Finding(path, f"expert data parallel size ({edp}) is not divisible by {k}")


@rule("parallelism.nvlink_domain")
def nvlink_domain(bp: Blueprint) -> Iterator[Finding]:
    """TP and the expert group (etp*ep) communicate every layer; keep them inside NVLink."""
    par = bp.parallelism
    domain = GPU_SPECS[par.gpu].nvlink_domain
    expert_group = par.expert_tp * par.ep
    if expert_group > domain:
        yield Finding(
            "parallelism.ep",
            f"expert group etp*ep = {par.expert_tp}*{par.ep} = {expert_group} exceeds the "
            f"{par.gpu} NVLink domain ({domain} GPUs); all-to-all will cross the network",
            "warning",
        )
    if par.tp > domain:
        yield Finding(
            "parallelism.tp",
            f"tp={par.tp} exceeds the {par.gpu} NVLink domain ({domain} GPUs)",
            "warning",
        )


@rule("parallelism.modules")
def modules(bp: Blueprint) -> Iterator[Finding]:
    """Per-module grids factorise their ranks and tile [0, world) colocated or disjointly."""
    par = bp.parallelism
    if not par.modules:
        return
    world = par.world_size
    for name, mod in par.modules.items():
        base = join_path("parallelism.modules", name)
        dense, expert = mod.tp * mod.cp * mod.pp, mod.etp * mod.ep * mod.pp
        if mod.num_ranks % dense:
            yield Finding(
                f"{base}.num_ranks",
                f"num_ranks ({mod.num_ranks}) must be divisible by tp*cp*pp = "
                f"{mod.tp}*{mod.cp}*{mod.pp} = {dense}",
            )
        if mod.num_ranks % expert:
            yield Finding(
                f"{base}.num_ranks",
                f"num_ranks ({mod.num_ranks}) must be divisible by etp*ep*pp = "
                f"{mod.etp}*{mod.ep}*{mod.pp} = {expert}",
            )
        end = mod.rank_offset + mod.num_ranks
        if end > world:
            yield Finding(
                f"{base}.rank_offset",
                f"ranks [{mod.rank_offset}, {end}) fall outside the world [0, {world})",
            )
        if name == "language":
            yield from _expert_split(bp, mod.ep, f"{base}.ep")
            yield from _expert_tp_split(bp, mod.etp, f"{base}.etp")
    yield from _module_tiling(bp)


def _module_tiling(bp: Blueprint) -> Iterator[Finding]:
    """Colocated (every grid is [0, world)) or disjoint grids that cover [0, world) exactly."""
    world = bp.parallelism.world_size
    spans = sorted(
        (m.rank_offset, m.rank_offset + m.num_ranks, name)
        for name, m in bp.parallelism.modules.items()
    )
    if len({(start, end) for start, end, _ in spans}) == 1:
        start, end, _ = spans[0]
        if (start, end) != (0, world):
            yield Finding(
                "parallelism.modules",
                f"colocated module grids span ranks [{start}, {end}) but must span every rank "
                f"[0, {world})",
            )
        return
    cursor = 0
    for start, end, name in spans:
        if start < cursor:
            yield Finding(
                "parallelism.modules",
                f"module grids must be colocated or disjoint: {name!r} ranks [{start}, {end}) "
                f"overlap ranks below {cursor}",
            )
        elif start > cursor:
            yield Finding(
                "parallelism.modules",
                f"module grids leave ranks [{cursor}, {start}) unused before {name!r}",
            )
        cursor = max(cursor, end)
    if cursor < world:
        yield Finding(
            "parallelism.modules",
            f"module grids leave ranks [{cursor}, {world}) unused (world_size={world})",
        )
