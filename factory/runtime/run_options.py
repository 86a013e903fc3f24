"""How the trainer drives a run: where it writes, when it checkpoints, what it shows.

The blueprint says what is trained; :class:`RunOptions` says how one run of it
goes (``factory.runtime.trainer``), and the callbacks read it through the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from factory.runtime.ranks import Ranks, SingleProcess

__all__ = ["RunOptions", "StageStart"]


@dataclass(frozen=True)
class StageStart:
    """Where a stage of a program starts when it has no checkpoint of its own: the final
    checkpoint of the stage before (its boundary), and what of it the stage carries over."""

    checkpoint: Path
    optimizer: bool = True
    """Take the fp32 masters' Adam moments and step count too (else a fresh optimizer)."""
    data_position: bool = False
    """Read on at the boundary's data position (else this stage's data from its start)."""


@dataclass
class RunOptions:
    """How a run is driven (the blueprint says what is trained)."""

    run_dir: Path | None = None
    """Where ``checkpoints/`` and ``metrics.jsonl`` go; None writes neither."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (default: ``training.checkpoint_interval``)."""
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    resume: bool = False
    """Continue from the latest complete checkpoint in ``run_dir`` (an error if none)."""
    seed: int | None = None
    """Seeds torch's global generator (default ``training.seed``)."""
    progress: bool = False
    """Draw a rich progress bar (rank 0)."""
    log_every: int = 0
    """Without the bar, log a timestamped step line every this many steps (0: not by steps)."""
    log_every_s: float = 0.0
    """... or this many seconds after the last, whichever comes first (0: not by time)."""
    description: str = "train"
    ranks: Ranks = field(default_factory=SingleProcess)
    """The other processes of a distributed run (``factory.runtime.ranks``); this rank's
    batches are its data-parallel share. Rank 0 writes ``metrics.jsonl`` and shows progress;
    every other rank writes ``ranks/rank_NNNNN.jsonl``."""
    stop_on_signals: bool = False
    """Catch SIGTERM and SIGINT while training: checkpoint at the next step boundary and end
    the run ``interrupted`` (a second signal still ends the process at once)."""
    stage: str | None = None
    """The program stage this run is (``factory.schemas.program``): every record of
    ``metrics.jsonl`` and the trackers carry it; None for a blueprint without stages."""
    start_from: StageStart | None = None
    """Without a checkpoint to resume from, begin from the stage before's boundary."""
    schedule_offset: int = 0
    """Steps of the learning-rate schedule that earlier stages of the program took: local
    step ``s`` runs at ``learning_rate(schedule_offset + s, schedule_steps, ...)``."""
    schedule_steps: int | None = None
    """Steps the schedule spans (default: the run's own steps)."""
    heldout: Mapping[str, Path] = field(default_factory=dict)
    """The held-out sets ``training.eval`` evaluates, category to built folder
    (``factory.data.shards.heldout``); a run with ``training.eval`` needs at least one."""
    notice: Callable[[str], None] = field(default=lambda line: None)
    """Told, one line each, what the run repaired or skipped on its way (a damaged
    checkpoint passed over, a torn line of metrics.jsonl removed); rank 0 only."""
