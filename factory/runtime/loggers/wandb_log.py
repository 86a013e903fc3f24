"""Weights & Biases: a W&B run in ``<run>/wandb/``, offline unless ``WANDB_MODE`` says otherwise.

Offline by default because a training job must not reach the network, or wait
for a login, unless its user asked: ``WANDB_MODE=online`` (after ``wandb
login``) syncs as the run goes; an offline run is uploaded later with ``wandb
sync <run>/wandb/offline-run-*``. The other ``WANDB_*`` settings apply as W&B
documents them. The project is ``WANDB_PROJECT`` or the blueprint's name, the
run's name the run folder's, its config the blueprint.

The W&B run's id is kept in ``<run>/wandb/run-id``, so a resumed run continues
the same W&B run. Charts are drawn against ``step``, the schedule's step. W&B's
history only grows: after a rollback it keeps the refused steps as well, as
``metrics.jsonl`` does; the re-run overlays them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import wandb

from factory.io import atomic_write_text
from factory.runtime.loggers.tracker import Tracker

if TYPE_CHECKING:
    from factory.runtime.callbacks import TrainerView

__all__ = ["RUN_ID", "WandbLog"]

RUN_ID = Path("wandb") / "run-id"
"""Where in the run folder the W&B run's id is kept."""


class WandbLog(Tracker):
    """Rank 0's scalars and notes as the history of a W&B run."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self._run: Any = None

    def open(self, trainer: TrainerView) -> None:
        bp = trainer.compiled.blueprint
        try:
            self._run = wandb.init(
                project=None if os.environ.get("WANDB_PROJECT") else bp.meta.name,
                name=self.run_dir.name,
                id=self._run_id(),
                resume="allow",
                dir=str(self.run_dir),
                mode=None if os.environ.get("WANDB_MODE") else "offline",
                config=bp.model_dump(mode="json"),
            )
        except wandb.errors.Error as exc:  # no login, a server that does not answer
            # Tracking is not worth a run: metrics.jsonl has every record, and on several
            # ranks the others would wait at the first step for a rank 0 that has failed.
            first_line = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            trainer.options.notice(
                f"training.loggers: W&B did not start ({first_line}); training goes on "
                "without it (metrics.jsonl has every record)"
            )
            return
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def _run_id(self) -> str:
        """This run folder's W&B id: the one kept there, else a new one, kept."""
        path = self.run_dir / RUN_ID
        if path.is_file():
            return path.read_text(encoding="utf-8").strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        run_id = secrets.token_hex(8)
        atomic_write_text(path, run_id + "\n")
        return run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._run is not None:
            self._run.log({"step": step, **values})

    def note(self, step: int, tag: str, text: str) -> None:
        if self._run is not None:
            self._run.log({"step": step, f"notes/{tag}": text})

    def shut(self) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if self.completed else 1)
            self._run = None
