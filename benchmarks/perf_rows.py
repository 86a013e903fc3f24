"""The published throughput rows the performance model is fitted on, as blueprints.

Reads ``benchmarks/data/training_throughput_published.csv`` and keeps a row only where
it is a pretraining measurement of a layout we can rebuild: the reason every other row
is dropped is counted (``Rows.dropped``). A kept row becomes a blueprint: the ``nano``
preset's data and training sections with the row's architecture
(``benchmarks.perf_families``), GPU, precision, layout, batch and sequence length.
"""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.perf_families import FAMILIES, SKIPPED, family_of, model_section
from factory.checks.registry import run_rules
from factory.checks.validate import load_blueprint
from factory.schemas.blueprint import Blueprint

__all__ = ["CSV", "Row", "Rows", "published_rows"]

CSV = Path(__file__).parent / "data" / "training_throughput_published.csv"

_PRECISION = {"BF16": "bf16", "MXFP8": "mxfp8", "NVFP4": "nvfp4"}


@dataclass(frozen=True)
class Row:
    model: str
    family: str
    gpu: str
    num_gpus: int
    precision: str
    tokens_per_s_per_gpu: float
    blueprint: Blueprint
    source: str

    @property
    def label(self) -> str:
        p = self.blueprint.parallelism
        return (
            f"{self.model} {self.gpu} x{self.num_gpus} {self.precision} tp{p.tp} pp{p.pp} "
            f"cp{p.cp} ep{p.ep} mbs{p.micro_batch_size} gbs{p.global_batch_size}"
        )


@dataclass
class Rows:
    used: list[Row] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)


def _int(cell: str) -> int | None:
    return int(cell) if cell.strip().isdigit() else None


def _precision(cell: str) -> str:
    head = cell.split("(")[0].strip().removesuffix("-CS")
    return _PRECISION.get(head, "fp8" if head.startswith("FP8") else head.lower())


def _recompute(notes: str) -> str:
    if "recompute_granularity=full" in notes or "recompute_num_layers" in notes:
        return "full"
    if "recompute_modules=[" in notes and "recompute_modules=[]" not in notes:
        return "selective"
    return "selective" if "recompute_granularity=selective" in notes else "none"


def _why_not(cells: dict[str, str]) -> str | None:
    """Why a row cannot be used, or None."""
    notes = cells["notes"]
    checks = (
        (not notes.startswith("task=pretrain"), "not pretraining (SFT or LoRA)"),
        (not cells["tokens_per_s_per_gpu"], "no tokens/s published"),
        ("WITHDRAWN" in notes, "withdrawn by its source"),
        ("regression known issue" in notes, "a performance regression its source flags"),
        ("DIFFERS" in notes, "published layout differs from every config"),
        (cells["model"] in SKIPPED, SKIPPED.get(cells["model"], "")),
        (cells["model"] not in FAMILIES, "architecture not in benchmarks.perf_families"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    if None in (_int(cells[k]) for k in ("num_gpus", "gbs", "mbs", "seq_len", "tp", "pp")):
        return "batch, sequence length or layout not given"
    return None


@cache
def _base() -> dict[str, Any]:
    return load_blueprint("nano").model_dump(mode="json", exclude_defaults=True)


def _pattern(pattern: str, pp: int, vp: int) -> str:
    """Split the stack into pp x vp pipeline segments where Megatron's even split would not
    do (interleaving, or layers pp does not divide), as even as the layers allow: a
    Transformer layer ('*-', '*E') is never cut in two."""
    unit = 1 if "M" in pattern else 2
    layers = len(pattern) // unit
    pieces = pp * vp
    if vp <= 1 and layers % pp == 0:
        return pattern
    cuts = [unit * round(i * layers / pieces) for i in range(pieces + 1)]
    return "|".join(pattern[a:b] for a, b in pairwise(cuts))


def _blueprint(cells: dict[str, str]) -> Blueprint:
    seq, tp, pp = int(cells["seq_len"]), int(cells["tp"]), int(cells["pp"])
    model = model_section(cells["model"], _base()["model"], seq)
    model["pattern"] = _pattern(model["pattern"], pp, _int(cells["vp"]) or 1)
    parallelism = {
        "world_size": int(cells["num_gpus"]),
        "gpu": cells["gpu"].lower(),
        "tp": tp,
        "pp": pp,
        "cp": _int(cells["cp"]) or 1,
        "ep": _int(cells["ep"]) or 1,
        "sequence_parallel": tp > 1,
        "micro_batch_size": int(cells["mbs"]),
        "global_batch_size": int(cells["gbs"]),
        "recompute": _recompute(cells["notes"]),
    }
    if "moe" in model:
        parallelism["etp"] = _int(cells["etp"]) or 1  # unknown: Bridge's MoE recipes use 1
    data = {**_base(), "model": model, "parallelism": parallelism}
    data["data"] = {**data["data"], "seq_len": seq}
    data["precision"] = {"recipe": _precision(cells["precision"])}
    return Blueprint.model_validate(data)


def _refusals(bp: Blueprint) -> list[str]:
    """Rules ``factory validate`` fails, memory aside: a published layout ran, so our
    memory estimate is not a reason to drop it."""
    return sorted(
        rule.name
        for rule, finding in run_rules(bp)
        if finding.severity == "error" and not rule.name.startswith("memory")
    )


def published_rows(path: Path = CSV) -> Rows:
    """Every row of the table, used or counted by why not."""
    rows = Rows()
    with path.open(newline="") as handle:
        for cells in csv.DictReader(handle):
            reason = _why_not(cells)
            if reason is None:
                bp = _blueprint(cells)
                refused = _refusals(bp)
                reason = f"factory validate refuses it ({', '.join(refused)})" if refused else None
            if reason is not None:
                rows.dropped[reason] += 1
                continue
            rows.used.append(
                Row(
                    model=cells["model"],
                    family=family_of(cells["model"]),
                    gpu=cells["gpu"].lower(),
                    num_gpus=int(cells["num_gpus"]),
                    precision=bp.precision.recipe,
                    tokens_per_s_per_gpu=float(cells["tokens_per_s_per_gpu"]),
                    blueprint=bp,
                    source=cells["source"],
                )
            )
    return rows
