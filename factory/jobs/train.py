"""``factory.train``: train a blueprint's model (or its CPU proxy) on its data recipe.

One process, the blueprint's optimizer, schedule, batch, precision policy and
stability monitors (``factory.runtime``). The run folder holds:

* ``data/``: the curated shards it trains on (not when ``data`` is given),
  built whole before training starts and checked again on every rerun;
* ``checkpoints/``: resumable checkpoints every ``checkpoint_every`` steps and
  at the end, each complete or absent (``factory.runtime.checkpoint``);
* ``metrics.jsonl``: one record per step, monitor event, checkpoint and
  rollback, flushed as it goes;
* at the end, ``train.json`` (what ran, one record per step), ``model/`` (a
  Hugging Face checkpoint that transformers and ``factory import hf`` load)
  and ``report/report.html`` (``factory report``), each written whole.

Rerunning into the same folder (or ``resume=True``, which insists) continues
from the latest complete checkpoint, exactly as the uninterrupted run would.
Full-size Nemotron 3 models need a cluster: a model whose fp32 weights,
gradients and Adam states would not fit this machine's memory is refused
(:class:`ModelTooBig`) before any work.

Importing this module does not import torch; calling :func:`train` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING

import factory
from factory.io import atomic_write_text
from factory.jobs.distributed_train import run_rank
from factory.jobs.launch import LaunchRefused, check_launch, launched_world_size
from factory.planner.params import count_params
from factory.precision.policy import uses_low_precision
from factory.progress import Progress, silent
from factory.proxy_layout import derive_proxy_layout
from factory.report.run_metrics import ReportError
from factory.report.run_page import write_report

if TYPE_CHECKING:
    from factory.compilation import Compiled, PrecisionBackend
    from factory.runtime.loop import StepRecord
    from factory.runtime.loop import TrainResult as LoopResult
    from factory.runtime.ranks import Ranks
    from factory.schemas.blueprint import Blueprint

__all__ = [
    "BackendUnavailable",
    "BadData",
    "CannotLaunch",
    "CannotResume",
    "CheckpointPolicy",
    "ModelTooBig",
    "TrainRefused",
    "TrainResult",
    "train",
]

BYTES_PER_PARAM = 16
"""fp32 weight + gradient + two Adam moments: what one process holds per parameter."""


class TrainRefused(Exception):
    """A training request this machine cannot run; nothing was written (the CLI exits 2)."""


class ModelTooBig(TrainRefused):
    """The model's training state needs more memory than this machine has."""

    def __init__(self, name: str, params: int, have_bytes: int, proxy: bool) -> None:
        self.params, self.need_bytes, self.have_bytes = params, params * BYTES_PER_PARAM, have_bytes
        hint = "" if proxy else "; train its CPU proxy (proxy=True, or --proxy)"
        super().__init__(
            f"{name} has {params:,} parameters, whose fp32 weights, gradients and Adam states "
            f"need {self.need_bytes / 2**30:,.0f} GiB, more than this machine's "
            f"{have_bytes / 2**30:,.0f} GiB{hint}"
        )


class BackendUnavailable(TrainRefused, ImportError):
    """The requested precision backend is not installed (Transformer Engine, for ``te``)."""


class CannotResume(TrainRefused):
    """Nothing to resume, a checkpoint of another model, or one that cannot be read."""


class CannotLaunch(TrainRefused):
    """The launch does not fit the blueprint's layout, or runs what factory's runtime does not
    (``factory.jobs.launch``); refused before any process group is made."""


class BadData(TrainRefused):
    """The data folder does not match its manifest (missing, truncated or changed shards)."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When and how checkpoints are written and whether the run must resume from one."""

    every: int | None = None
    """Steps between checkpoints (default: the blueprint's ``training.checkpoint_interval``)."""
    keep: int = 3
    """Complete checkpoints kept (a rollback needs one from before the trouble)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""
    resume: bool = False
    """Insist on resuming (an error when the folder has no complete checkpoint). Without it a
    folder that has one resumes anyway, and one that has none starts afresh."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :func:`train` ran and wrote."""

    out: Path
    """The run folder (absolute): train.json, model/ and, unless data was given, data/."""
    blueprint: Blueprint
    """The blueprint that trained: the proxy's with ``proxy=True``."""
    device: str
    precision: dict[str, str]
    """Recipe per module kind as installed (empty with precision="off" or an all-BF16 policy)."""
    seed: int
    data: Path
    """The shards it trained on."""
    history: LoopResult
    """The loop's records (one per optimizer step) and whether it diverged."""

    @property
    def records(self) -> list[StepRecord]:
        return self.history.records

    @property
    def diverged(self) -> bool:
        return self.history.diverged


def train(
    blueprint: Blueprint,
    *,
    out: Path | None = None,
    proxy: bool = False,
    steps: int | None = None,
    data: Path | None = None,
    precision: PrecisionBackend = "auto",
    seed: int | None = None,
    workers: int = 1,
    progress: Progress | None = None,
    show_steps: bool = False,
    checkpoints: CheckpointPolicy | None = None,
) -> TrainResult:
    """Train ``blueprint`` (its CPU proxy with ``proxy=True``) and write ``out``.

    ``out`` defaults to ``runs/NAME`` (the proxy's name with ``proxy=True``).
    ``steps`` defaults to the blueprint's; ``seed`` to ``training.seed``.
    ``data`` trains on shards built already instead of building the recipe
    (with ``workers`` processes) at the blueprint's ``data.seq_len``.
    ``precision`` picks the backend of :func:`factory.compile`. ``progress``
    gets the data build's stages, ``compile``, ``train`` (optimizer steps) and
    ``export``; ``show_steps`` lets the training loop draw its own rich bar
    with the loss per step instead of reporting ``train``. ``checkpoints`` sets
    the checkpoint cadence and resume behaviour (:class:`CheckpointPolicy`).

    Raises :class:`ModelTooBig` or :class:`BackendUnavailable` before any work,
    :class:`CannotResume` or :class:`BadData` before any step, and ``ValueError``
    for a precision backend that does not exist.
    """
    bp = trained_blueprint(blueprint, proxy, launched_world_size())
    _check_request(bp, proxy, precision)
    try:
        check_launch(bp, launched_world_size())
    except LaunchRefused as exc:
        raise CannotLaunch(str(exc)) from exc
    destination = (out or Path("runs") / bp.meta.name).resolve()
    run_seed = bp.training.seed if seed is None else seed
    job = _Job(
        bp,
        destination,
        data,
        steps,
        precision,
        run_seed,
        workers,
        progress or silent,
        show_steps,
        checkpoints or CheckpointPolicy(),
    )
    return job.run()


def trained_blueprint(blueprint: Blueprint, proxy: bool, world_size: int = 1) -> Blueprint:
    """The blueprint that trains: ``blueprint``, or its proxy laid out on ``world_size`` ranks
    (``factory.proxy_layout``)."""
    if not proxy:
        return blueprint
    return derive_proxy_layout(blueprint, world_size)[0]


def _check_request(bp: Blueprint, proxy: bool, precision: str) -> None:
    """Refuse what cannot run here, before any data is curated."""
    from factory.compilation import PRECISION_OFF, PrecisionBackend

    backends = typing.get_args(PrecisionBackend)
    if precision not in backends:
        raise ValueError(f"precision must be one of {', '.join(backends)}, not {precision!r}")
    if bp.training.compile and precision != "off" and uses_low_precision(bp):
        raise ValueError(f"{PRECISION_OFF}; run with --precision off or training.compile: false")
    if precision == "te":
        from factory.precision.te_backend import require_te

        try:
            require_te()
        except ImportError as exc:
            raise BackendUnavailable(str(exc)) from exc
    params, have = count_params(bp.model).total, _memory_bytes()
    if have and params * BYTES_PER_PARAM > have:
        raise ModelTooBig(bp.meta.name, params, have, proxy)


def _memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


@dataclasses.dataclass(frozen=True)
class _Job:
    """One validated training request; :meth:`run` does it in the run folder."""

    bp: Blueprint
    out: Path
    data: Path | None
    steps: int | None
    precision: PrecisionBackend
    seed: int
    workers: int
    report: Progress
    show_steps: bool
    checkpoints: CheckpointPolicy

    def run(self) -> TrainResult:
        import torch

        shards = self.data if self.data is not None else self.out / "data"
        if launched_world_size() > 1:
            compiled, history, device = run_rank(self)
            main = int(os.environ.get("RANK", "0")) == 0
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.out.mkdir(parents=True, exist_ok=True)
            if self.data is None:
                self._build_data(shards)
            (compiled, history), main = self._train(shards, device), True
        table = dict(compiled.precision.recipes()) if compiled.precision else {}
        if main:
            self._write(compiled, history, device, table)
        return TrainResult(self.out, self.bp, device, table, self.seed, shards, history)

    def _build_data(self, folder: Path) -> Path:
        """The recipe's shards, built whole (a rerun finds them and keeps them)."""
        from factory.data.build_job import build as build_data

        if (folder / "manifest.json").is_file():
            return folder
        build_data(
            self.bp.data.recipe,
            folder,
            workers=self.workers,
            seq_len=self.bp.data.seq_len,
            progress=self.report,
            keep_work=False,  # intermediates only; the run folder holds what trained
        )
        return folder

    def _train(self, shards: Path, device: str) -> tuple[Compiled, LoopResult]:
        self.report("compile", 0, 1)
        compiled = factory.compile(self.bp, device=device, seed=self.seed, precision=self.precision)
        self.report("compile", 1, 1)
        return compiled, self._train_loop(compiled, shards)

    def _train_loop(
        self, compiled: Compiled, shards: Path, ranks: Ranks | None = None
    ) -> LoopResult:
        """Train ``compiled`` on ``shards`` (this rank's data-parallel share of them)."""
        from factory.runtime.checkpoint import CheckpointError, complete_checkpoints
        from factory.runtime.loader import DataError, ShardLoader
        from factory.runtime.loop import RunOptions
        from factory.runtime.loop import train as train_loop
        from factory.runtime.ranks import SingleProcess

        ranks = ranks or SingleProcess()
        bp, policy = self.bp, self.checkpoints
        total = self.steps if self.steps is not None else bp.training_steps
        resume = policy.resume or bool(complete_checkpoints(self.out / "checkpoints"))
        report = self.report if ranks.is_main else silent
        options = RunOptions(
            run_dir=self.out,
            checkpoint_every=policy.every,
            keep_checkpoints=policy.keep,
            async_checkpoint=policy.async_save,
            resume=resume,
            seed=self.seed,
            progress=self.show_steps,
            on_step=None if self.show_steps else lambda done: report("train", done, total),
            ranks=ranks,
        )
        if not self.show_steps:
            report("train", 0, total)
        micro = bp.parallelism.micro_batch_size
        share = {"rank": ranks.data_rank, "world_size": ranks.data_size}
        try:
            with ShardLoader(shards, micro, seed=self.seed, verify=True, **share) as batches:
                return train_loop(compiled, batches, total, options)
        except DataError as exc:
            raise BadData(str(exc)) from exc
        except CheckpointError as exc:
            raise CannotResume(str(exc)) from exc

    def _write(
        self, compiled: Compiled, history: LoopResult, device: str, table: dict[str, str]
    ) -> None:
        """train.json, the Hugging Face checkpoint in model/ and the report, each whole."""
        from factory.exports.hf import export_hf

        summary = {
            "blueprint": self.bp.meta.name,
            "device": device,
            "precision": table,
            "seed": self.seed,
            "data": str(self.data if self.data is not None else "data/"),
            "end": history.end,
            "message": history.message,
            "diverged": history.diverged,
            "records": [dataclasses.asdict(r) for r in history.records],
        }
        atomic_write_text(self.out / "train.json", json.dumps(summary, indent=2) + "\n")
        self.report("export", 0, 1)
        export_hf(compiled.model, compiled.blueprint, self.out / "model")
        with contextlib.suppress(ReportError):  # a run stopped before its first step
            write_report(self.out)
        self.report("export", 1, 1)
