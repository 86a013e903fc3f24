"""``metrics.jsonl``: the run's record, one JSON object per line, flushed as it is written.

A killed run keeps everything up to its last step; ``factory report`` reads the
file (``factory.report.run_metrics``) into the same record types that are
written here (:data:`KINDS`): ``run`` (first), ``step``, ``event``,
``checkpoint``, ``rollback``, ``eval`` (a held-out set's loss, ``training.eval``) and ``end``; in a stage of a program every line also
names the stage (``"stage"``). A resumed run appends to the same
file, after cutting off a torn last line (a process killed mid-write), so the
file stays one JSON object per line. Rank 0 writes ``metrics.jsonl``; every other rank of a distributed run its
own ``ranks/rank_NNNNN.jsonl``. This module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from factory.layers.model_spec import model_spec
from factory.runtime.callbacks import Callback, Event, HeldoutMetrics, Rollback, TrainerView

if TYPE_CHECKING:
    from factory.runtime.history import RunHistory, StepRecord
    from factory.runtime.ranks import Ranks
    from factory.runtime.step import StepOutcome

__all__ = [
    "JSON_KEYS",
    "KINDS",
    "METRICS",
    "CheckpointSaved",
    "MetricsLog",
    "RunEnd",
    "RunInfo",
    "StepMetrics",
    "metrics_path",
    "remove_torn_tail",
    "step_metrics",
]

METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class RunInfo:
    """The first line of a run (and of each resumed part of it)."""

    name: str
    steps: int
    seq_len: int
    global_batch_size: int
    layers: tuple[str, ...]
    resumed_at: int = 0
    """The step a resumed run started from (0: a fresh start)."""
    started: str = ""


@dataclass(frozen=True)
class StepMetrics:
    """One applied optimizer step."""

    update: int
    step: int
    loss: float
    lm_loss: float
    lr: float
    grad_norm: float
    tokens_seen: int
    tokens_per_s: float
    seconds: float
    finite: bool
    max_vio: dict[str, float]
    residual_rms: dict[str, float]
    switched_to_bf16: bool = False


@dataclass(frozen=True)
class CheckpointSaved:
    update: int
    step: int
    path: str
    seconds: float
    is_async: bool


@dataclass(frozen=True)
class RunEnd:
    update: int
    step: int
    reason: str
    message: str


def step_metrics(record: StepRecord, outcome: StepOutcome) -> StepMetrics:
    """The record of an applied step, as ``metrics.jsonl`` and every tracker get it."""
    return StepMetrics(
        update=record.update,
        step=record.step,
        loss=record.loss,
        lm_loss=record.lm_loss,
        lr=record.lr,
        grad_norm=record.grad_norm,
        tokens_seen=record.tokens_seen,
        tokens_per_s=outcome.tokens / max(record.seconds, 1e-9),
        seconds=record.seconds,
        finite=True,
        max_vio=outcome.max_vio(),
        residual_rms=outcome.residual_rms,
        switched_to_bf16=record.switched_to_bf16,
    )


KINDS: dict[str, type] = {
    "run": RunInfo,
    "step": StepMetrics,
    "event": Event,
    "checkpoint": CheckpointSaved,
    "rollback": Rollback,
    "eval": HeldoutMetrics,
    "end": RunEnd,
}
"""Every line's ``kind`` and the record it holds."""
JSON_KEYS = {"is_async": "async"}  # `async` is a Python keyword


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def metrics_path(run_dir: Path, ranks: Ranks) -> Path:
    """Rank 0's ``metrics.jsonl``; every other rank's ``ranks/rank_NNNNN.jsonl``."""
    if ranks.is_main:
        return run_dir / METRICS
    return run_dir / "ranks" / f"rank_{ranks.rank:05d}.jsonl"


_KIND_OF = {record: kind for kind, record in KINDS.items()}

CHUNK_BYTES = 1 << 16
"""How much of the file's end is read at a time while looking for the last newline."""


def remove_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last complete line (one ending in a newline); the bytes cut.

    Lines are written whole and flushed, so only the last can be torn, by a process killed
    while writing it; what was appended after such a line would join it into one bad line.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    keep = size
    with path.open("rb") as handle:
        while keep > 0:
            start = max(0, keep - CHUNK_BYTES)
            handle.seek(start)
            chunk = handle.read(keep - start)
            if keep == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
    os.truncate(path, keep)
    return size - keep


class MetricsLog(Callback):
    """Appends the run's records to ``path`` as the trainer reports them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._stage: dict[str, str] = {}

    def write(self, record: Any) -> None:
        """One line for ``record`` (one of :data:`KINDS`' types), flushed; a stage of a
        program adds its name as ``"stage"``."""
        if self._file is None:
            return
        kind = _KIND_OF[type(record)]
        fields = {JSON_KEYS.get(k, k): _finite(v) for k, v in asdict(record).items()}
        line = {"kind": kind, **self._stage, **fields}
        self._file.write(json.dumps(line, sort_keys=False) + "\n")
        self._file.flush()

    def pre_train(self, trainer: TrainerView) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = remove_torn_tail(self.path)
        if torn and trainer.ranks.is_main:
            trainer.options.notice(
                f"{self.path}: removed a torn last line ({torn} bytes, from a run killed while "
                "writing it) before appending"
            )
        self._file = self.path.open("a", encoding="utf-8")
        stage = trainer.options.stage
        self._stage = {"stage": stage} if stage is not None else {}
        bp = trainer.compiled.blueprint
        self.write(
            RunInfo(
                name=bp.meta.name,
                steps=trainer.steps,
                seq_len=bp.data.seq_len,
                global_batch_size=bp.parallelism.global_batch_size,
                layers=tuple(layer.prefix for layer in model_spec(bp.model).layers),
                resumed_at=trainer.position.step,
                started=time.strftime("%Y-%m-%dT%H:%M:%S"),
            )
        )

    def on_event(self, trainer: TrainerView, event: Event) -> None:
        self.write(event)

    def on_rollback(self, trainer: TrainerView, rollback: Rollback) -> None:
        self.write(rollback)

    def post_step(self, trainer: TrainerView, record: StepRecord, outcome: StepOutcome) -> None:
        self.write(step_metrics(record, outcome))

    def on_evaluation(self, trainer: TrainerView, records: list[HeldoutMetrics]) -> None:
        for record in records:
            self.write(record)

    def on_checkpoint(self, trainer: TrainerView, path: Path, seconds: float) -> None:
        p = trainer.position
        self.write(
            CheckpointSaved(p.update, p.step, str(path), seconds, trainer.options.async_checkpoint)
        )

    def post_train(self, trainer: TrainerView, history: RunHistory) -> None:
        p = trainer.position
        self.write(RunEnd(p.update, p.step, history.end, history.message))

    def close(self, trainer: TrainerView) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
