"""One process's share of ``factory.train``: join the ranks, curate, compile, lay out, train, write.

Every process of a launch runs :func:`run_rank` with the same
:class:`~factory.jobs.train_request.TrainRequest`; on one process it is world size 1
of the same code (``factory.runtime.ranks``):

1. rank 0 builds the data recipe's shards (the others wait at a barrier);
2. every rank builds the model on the meta device, lays it out over the
   layout's meshes and fills only its own shards, each tensor initialised from
   the seed and its name (or read from ``model.init.checkpoint``), so no rank
   ever holds the whole model (``factory.runtime.placement``);
3. every rank trains on its data-parallel share (``factory.runtime.trainer``)
   with the standard callbacks (``factory.runtime.fit``), the job's progress reports
   and the run report;
4. the trained weights are gathered whole on rank 0, which writes ``train.json``
   and ``model/`` (and ``averaged/ema/`` with ``training.average``, from the final
   checkpoint) (not after a stop signal: the run is to be resumed, and the time
   before the scheduler's SIGKILL is short).

The run folder is held (``factory.jobs.run_lock``) from before the data build to
the end: by the launching ``factory train --nproc``, or here by rank 0, whose
answer every rank takes.

This module imports torch; ``factory.jobs.train`` imports it when a run starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from factory import compilation
from factory.compilation import Compiled
from factory.data.build_job import build as build_data
from factory.exports.hf import write_hf_checkpoint
from factory.folder_lock import release
from factory.io import atomic_write_text
from factory.jobs.average import write_running_average
from factory.jobs.run_lock import RunFolderBusy, held_by_launcher, lock_run_folder
from factory.jobs.train_errors import BadData, CannotResume, RankLost, TrainRefused
from factory.jobs.train_request import (
    RUN_FILE,
    StageRun,
    TrainRequest,
    TrainResult,
    evaluated_sets,
)
from factory.planner.layout import resolve_layout
from factory.progress import PLAIN_EVERY_S, PLAIN_EVERY_STEPS
from factory.report.run_metrics import ReportError
from factory.report.run_page import write_report
from factory.runtime.callbacks import Callback, TrainerView
from factory.runtime.checkpoint import CheckpointError, complete_checkpoints
from factory.runtime.display import StepProgress
from factory.runtime.fit import fit
from factory.runtime.history import RunHistory, StepRecord
from factory.runtime.loader import DataError, ShardLoader
from factory.runtime.placement import full_weights, lay_out, materialize_shards
from factory.runtime.ranks import Ranks, is_transport_failure, joined_ranks
from factory.runtime.run_kernels import run_kernel_lines
from factory.runtime.run_options import RunOptions, StageStart

__all__ = ["run_rank"]


def run_rank(request: TrainRequest) -> TrainResult:
    """Train this process's share of ``request`` into its run folder."""
    bp, out, seed = request.blueprint, request.out, request.seed
    progress = request.settings.progress
    try:
        with joined_ranks(resolve_layout(bp)) as ranks, _holding(out, ranks):
            finished = _finished(request, ranks)
            if finished is not None:
                return finished
            shards = _curated(request, ranks)
            if ranks.is_main:
                progress("compile", 0, 1)
            # Built on meta, laid out, then each rank fills only its shards. Upcycling and
            # tied embeddings need the whole model first: every rank builds it.
            deferred = not (bp.model.init.upcycle_from or bp.model.tie_embeddings)
            compiled = compilation.compile(
                bp, device=ranks.device, seed=seed, precision=request.precision, deferred=deferred
            )
            lay_out(compiled, ranks)
            if deferred:
                materialize_shards(compiled, ranks, seed)
            if ranks.is_main:
                progress("compile", 1, 1)
            history = _fit(compiled, shards, request, ranks)
            stopped = history.end == "interrupted"  # the same on every rank
            weights = None if stopped else full_weights(compiled.model, ranks)
            kernels = tuple(run_kernel_lines(compiled, ranks.device.type))
            result = TrainResult(out, bp, ranks.device.type, _recipes(compiled), seed, shards,
                                 history, kernels=kernels)  # fmt: skip
            if weights is not None:  # rank 0, still holding the run folder
                progress("export", 0, 1)
                _write_summary(result, request.settings.data, request.stage)
                write_hf_checkpoint(weights, bp, out / "model")
                if bp.training.average is not None:
                    write_running_average(out, bp, request.stage.name if request.stage else None)
                progress("export", 1, 1)
    except (dist.DistError, RuntimeError) as exc:
        if not is_transport_failure(exc):
            raise
        first_line = str(exc).strip().splitlines()[0][:300]
        raise RankLost(
            f"rank {os.environ.get('RANK', '0')}: a collective failed, so another rank has died or stopped "
            f"answering ({first_line}); the launcher names the rank that failed first, and "
            "rerunning the same command resumes from the last checkpoint"
        ) from exc
    return result


def _finished(request: TrainRequest, ranks: Ranks) -> TrainResult | None:
    """The run in the run folder when it already completed all its steps, as rank 0 finds it: the
    rerun then writes nothing (no checkpoint saved again, no ``run`` and ``end`` lines
    appended to metrics.jsonl, no new report). ``train.json`` and ``model/`` are written
    last: with both there, ``train.json`` saying completed and the newest checkpoint at the
    last step, the export finished too; without them the rerun resumes there and exports."""
    bp, out, data = request.blueprint, request.out, request.settings.data
    total = bp.training_steps if request.settings.steps is None else request.settings.steps
    done = _completed_at(out, bp.meta.name) == total if ranks.is_main else False
    if not ranks.agree(done):
        return None
    summary = json.loads((out / "train.json").read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(StepRecord)}  # train.json of older releases
    records = [StepRecord(**{k: v for k, v in r.items() if k in known}) for r in summary["records"]]
    history = RunHistory(records, message=summary.get("message", ""))
    return TrainResult(out, bp, summary["device"], summary["precision"], summary["seed"],
                       data if data is not None else out / "data", history, total,
                       tuple(summary.get("kernels", ())))  # fmt: skip


def _completed_at(out: Path, name: str) -> int | None:
    """The step of the newest checkpoint of a completed, exported run of ``name`` in ``out``."""
    try:
        summary = json.loads((out / "train.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    model = out / "model"
    exported = (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    if summary.get("end") != "completed" or summary.get("blueprint") != name or not exported:
        return None
    newest = complete_checkpoints(out / "checkpoints")[-1:]
    return newest[0][0] if newest else None


def _recipes(compiled: Compiled) -> dict[str, int]:
    """Linears per precision format, as installed (empty with the policy off)."""
    return dict(compiled.precision.recipes()) if compiled.precision else {}


@contextlib.contextmanager
def _holding(out: Path, ranks: Ranks) -> Iterator[None]:
    """Hold the run folder for the run, unless the launcher does: rank 0 takes the lock and
    every rank refuses alike when another training has it."""
    if held_by_launcher(out):
        yield
        return
    fd, holder, failure = None, "", None
    if ranks.is_main:
        try:
            fd, holder = lock_run_folder(out)
        except OSError as exc:  # the other ranks wait for the answer, not for a timeout
            failure = exc
    holder, why = ranks.agree((holder, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if why is not None:
        raise TrainRefused(f"rank 0 could not lock the run folder: {why}")
    if holder:
        raise RunFolderBusy(out, holder)
    try:
        yield
    finally:
        if fd is not None:
            release(fd)


def _curated(request: TrainRequest, ranks: Ranks) -> Path:
    """The shards the run trains on: the settings' ``data``, or the recipe's, built whole by
    rank 0 into ``out/data`` (a rerun finds them and keeps them) while the other ranks wait."""
    bp, out, settings = request.blueprint, request.out, request.settings
    out.mkdir(parents=True, exist_ok=True)
    if settings.data is not None:
        return settings.data
    folder = out / "data"
    failure: Exception | None = None
    if ranks.is_main and not (folder / "manifest.json").is_file():
        try:
            build_data(
                bp.data.recipe,
                folder,
                workers=settings.workers,
                seq_len=bp.data.seq_len,
                progress=settings.progress,
            )
        except Exception as exc:  # the other ranks wait for the answer, not for a timeout
            failure = exc
    refused = isinstance(failure, ValueError)  # the recipe's fault (exit 2), else the machine's
    why, refused = ranks.agree((None if failure is None else str(failure), refused))
    if failure is not None:
        raise failure
    if why is not None:  # every rank ends with rank 0's status
        raise (TrainRefused if refused else RankLost)(f"rank 0 could not build the data: {why}")
    return folder


class RunReport(Callback):
    """``report/report.html`` (``factory report``) when the run ends, on rank 0."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def post_train(self, trainer: TrainerView, history: RunHistory) -> None:
        if trainer.ranks.is_main and history.end != "interrupted":  # leave while we may
            with contextlib.suppress(ReportError):  # a run stopped before its first step
                write_report(self.run_dir)


def _fit(compiled: Compiled, shards: Path, request: TrainRequest, ranks: Ranks) -> RunHistory:
    """Train ``compiled`` on this rank's data-parallel share of ``shards``."""
    bp, out, seed, settings = compiled.blueprint, request.out, request.seed, request.settings
    policy, show_steps = settings.checkpoints, settings.show_steps
    options = RunOptions(
        run_dir=out,
        checkpoint_every=policy.every,
        keep_checkpoints=policy.keep,
        async_checkpoint=policy.async_save,
        resume=policy.resume or bool(complete_checkpoints(out / "checkpoints")),
        seed=seed,
        progress=show_steps == "rich",
        log_every=PLAIN_EVERY_STEPS if show_steps == "plain" else 0,
        log_every_s=PLAIN_EVERY_S if show_steps == "plain" else 0.0,
        ranks=ranks,
        stop_on_signals=True,
        notice=settings.notice,
        heldout=evaluated_sets(bp, shards),
    )
    stage = request.stage
    if stage is not None:
        options.stage = stage.name
        options.description = f"train {stage.name}"
        options.schedule_offset, options.schedule_steps = (
            stage.schedule_offset,
            stage.schedule_steps,
        )
        if stage.previous is not None and not options.resume:
            options.start_from = StageStart(
                stage.previous, stage.carry_optimizer, stage.carry_data_position
            )
    extra: list[Callback] = [] if show_steps else [StepProgress(settings.progress)]
    extra.append(RunReport(out))
    extra.append(RunFile(request, shards))
    share = {"rank": ranks.data_rank, "world_size": ranks.data_size}
    micro = bp.parallelism.micro_batch_size
    try:
        with ShardLoader(shards, micro, seed=seed, verify=True, **share) as batches:
            return fit(compiled, batches, settings.steps, options, extra)
    except DataError as exc:
        raise BadData(str(exc)) from exc
    except CheckpointError as exc:
        raise CannotResume(str(exc)) from exc


class RunFile(Callback):
    """``run.json``: what the run trains (``RUN_FILE``), written by rank 0 once the run has
    started or resumed (a refused resume changes nothing) and before its first step, so that
    ``factory eval`` can read any of its checkpoints, also of a run cut short."""

    def __init__(self, request: TrainRequest, shards: Path) -> None:
        self.request, self.shards = request, shards

    def pre_train(self, trainer: TrainerView) -> None:
        if not trainer.ranks.is_main:
            return
        request = self.request
        run = {
            "blueprint": request.blueprint.model_dump(mode="json"),
            "precision": request.precision,
            "seed": request.seed,
            "data": str(self.shards.resolve()),
        }
        atomic_write_text(request.out / RUN_FILE, json.dumps(run, indent=2) + "\n")


def _write_summary(result: TrainResult, data: Path | None, stage: StageRun | None) -> None:
    """``train.json``: what ran, and one record per step."""
    history = result.history
    summary = {
        "blueprint": result.blueprint.meta.name,
        **({"stage": stage.name} if stage is not None else {}),
        "device": result.device,
        "precision": result.precision,
        "seed": result.seed,
        "data": str(data if data is not None else "data/"),
        "end": history.end,
        "message": history.message,
        "diverged": history.diverged,
        "kernels": list(result.kernels),
        "records": [dataclasses.asdict(r) for r in history.records],
    }
    atomic_write_text(result.out / "train.json", json.dumps(summary, indent=2) + "\n")
