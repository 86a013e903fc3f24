"""Resolve a blueprint's parallelism section into the full rank layout.

DP and EDP are derived (``world / (tp*cp*pp)`` and ``world / (etp*ep*pp)``),
the virtual-stage count comes from the pattern's ``|`` segments, and each
pipeline rank gets its layers. Segment ``i`` runs on pipeline rank
``i % pp`` as virtual stage ``i // pp`` (Megatron's round-robin assignment).
Resolution assumes the blueprint passed ``factory.checks``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from factory.schemas.blueprint import Blueprint

__all__ = ["Layout", "data_parallel_size", "expert_data_parallel_size", "resolve_layout"]


@dataclass(frozen=True)
class Layout:
    """Every degree of the dense and expert grids, and what each pipeline rank holds."""

    world_size: int
    tp: int
    cp: int
    dp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    edp: int
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    stage_patterns: tuple[tuple[str, ...], ...]
    """stage_patterns[pp_rank][virtual_stage]: the layer symbols that stage runs."""
    mtp_on_rank: int
    """Pipeline rank that runs the MTP blocks (the last, as in Megatron)."""

    def layers_on_rank(self, pp_rank: int) -> str:
        return "".join(self.stage_patterns[pp_rank])

    def layer_indices_on_rank(self, pp_rank: int) -> list[int]:
        """Main-stack indices of the layers ``pp_rank`` runs: segment ``v * pp + r`` of the
        stack is virtual stage ``v`` of rank ``r``."""
        indices, start = [], 0
        for v in range(self.vpp):
            for rank in range(self.pp):
                length = len(self.stage_patterns[rank][v])
                if rank == pp_rank:
                    indices.extend(range(start, start + length))
                start += length
        return indices

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["stage_patterns"] = [list(stages) for stages in self.stage_patterns]
        out["layers_per_rank"] = [len(self.layers_on_rank(r)) for r in range(self.pp)]
        return out


def _segments(bp: Blueprint) -> list[str]:
    """Pipeline segments: the '|' segments, or an even split of the stack into pp pieces."""
    parsed = bp.model.parsed_pattern
    pp = bp.parallelism.pp
    if parsed.has_pipes:
        return list(parsed.segments)
    main = parsed.main
    per = -(-len(main) // pp)
    return [main[i * per : (i + 1) * per] for i in range(pp)]


def data_parallel_size(world_size: int, tp: int, cp: int, pp: int) -> int:
    """DP: the copies of one model replica (``tp*cp*pp`` ranks) that ``world_size`` ranks
    hold, at least 1. The one formula: a resolved :class:`Layout` carries it, and what
    chooses a layout before it has a blueprint asks here (``parallelism.world_size`` says
    when tp*cp*pp does not divide the world)."""
    return max(1, world_size // (tp * cp * pp))


def expert_data_parallel_size(world_size: int, ep: int, etp: int, pp: int) -> int:
    """EDP: the copies of one expert replica (``etp*ep*pp`` ranks, MoE parallel folding) that
    ``world_size`` ranks hold, at least 1; like :func:`data_parallel_size`, the one formula."""
    return max(1, world_size // (etp * ep * pp))


def resolve_layout(bp: Blueprint) -> Layout:
    par = bp.parallelism
    tp, cp, pp, ep, etp = par.tp, par.cp, par.pp, par.ep, par.expert_tp
    dp = data_parallel_size(par.world_size, tp, cp, pp)
    edp = expert_data_parallel_size(par.world_size, ep, etp, pp)
    segments = _segments(bp)
    vpp = max(1, len(segments) // pp)
    stages = tuple(tuple(segments[v * pp + r] for v in range(vpp)) for r in range(pp))
    return Layout(
        world_size=par.world_size,
        tp=tp,
        cp=cp,
        dp=dp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        edp=edp,
        sequence_parallel=par.sequence_parallel and tp > 1,
        micro_batch_size=par.micro_batch_size,
        global_batch_size=par.global_batch_size,
        num_microbatches=max(1, par.global_batch_size // (par.micro_batch_size * dp)),
        stage_patterns=stages,
        mtp_on_rank=pp - 1,
    )
