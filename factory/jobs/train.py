"""``factory.train``: train a blueprint's model (or its CPU proxy) on its data recipe.

One process, the blueprint's optimizer, schedule, batch and precision policy
(``factory.runtime``). The output folder appears whole or not at all:

* ``train.json``: what ran (blueprint, device, precision) and one record per
  step (loss, learning rate, gradient norm, tokens, seconds);
* ``model/``: the trained weights as a Hugging Face checkpoint
  (``config.json`` + ``model.safetensors``, loadable by transformers and by
  ``factory import hf``);
* ``data/``: the curated shards it trained on (not when ``data`` is given).

Full-size Nemotron 3 models need a cluster: exported Megatron arguments are the
way to scale out. A model whose fp32 weights, gradients and Adam states would
not fit this machine's memory is refused (:class:`ModelTooBig`) before any work.

Importing this module does not import torch; calling :func:`train` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from factory.jobs.progress import Progress, silent

if TYPE_CHECKING:
    from factory.graph.compile import Compiled, PrecisionBackend
    from factory.runtime.batches import MicroBatch
    from factory.runtime.loop import StepRecord
    from factory.runtime.loop import TrainResult as LoopResult
    from factory.schemas.blueprint import Blueprint

__all__ = ["BackendUnavailable", "ModelTooBig", "TrainRefused", "TrainResult", "train"]

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
) -> TrainResult:
    """Train ``blueprint`` (its CPU proxy with ``proxy=True``) and write ``out``.

    ``out`` defaults to ``runs/NAME`` (the proxy's name with ``proxy=True``).
    ``steps`` defaults to the blueprint's; ``seed`` to ``training.seed``.
    ``data`` trains on shards built already instead of building the recipe
    (with ``workers`` processes) at the blueprint's ``data.seq_len``.
    ``precision`` picks the backend of :func:`factory.compile`. ``progress``
    gets the data build's stages, ``compile``, ``train`` (optimizer steps) and
    ``export``; ``show_steps`` lets the training loop draw its own rich bar
    with the loss per step instead of reporting ``train``.

    Raises :class:`ModelTooBig` or :class:`BackendUnavailable` before any work,
    and ``ValueError`` for a precision backend that does not exist.
    """
    bp = _trained_blueprint(blueprint, proxy)
    _check_request(bp, proxy, precision)
    destination = (out or Path("runs") / bp.meta.name).resolve()
    run_seed = bp.training.seed if seed is None else seed
    job = _Job(
        bp, destination, data, steps, precision, run_seed, workers, progress or silent, show_steps
    )
    return job.run()


def _trained_blueprint(blueprint: Blueprint, proxy: bool) -> Blueprint:
    if not proxy:
        return blueprint
    from factory.proxy import derive_proxy

    return derive_proxy(blueprint)


def _check_request(bp: Blueprint, proxy: bool, precision: str) -> None:
    """Refuse what cannot run here, before any data is curated."""
    from factory.graph.compile import PrecisionBackend

    backends = typing.get_args(PrecisionBackend)
    if precision not in backends:
        raise ValueError(f"precision must be one of {', '.join(backends)}, not {precision!r}")
    if precision == "te":
        from factory.precision.te_backend import require_te

        try:
            require_te()
        except ImportError as exc:
            raise BackendUnavailable(str(exc)) from exc
    from factory.planner.params import count_params

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
    """One validated training request; :meth:`run` does it inside a staging folder."""

    bp: Blueprint
    out: Path
    data: Path | None
    steps: int | None
    precision: PrecisionBackend
    seed: int
    workers: int
    report: Progress
    show_steps: bool

    def run(self) -> TrainResult:
        import torch

        from factory.io import staged_directory

        device = "cuda" if torch.cuda.is_available() else "cpu"
        with staged_directory(self.out) as staging:
            shards = self.data if self.data is not None else self._build_data(staging / "data")
            compiled, history = self._train(shards, device)
            table = dict(compiled.precision.recipes()) if compiled.precision else {}
            self._write(staging, compiled, history, device, table)
        trained_on = self.data if self.data is not None else self.out / "data"
        return TrainResult(self.out, self.bp, device, table, self.seed, trained_on, history)

    def _build_data(self, folder: Path) -> Path:
        from factory.data.pipeline import build as build_data

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
        import factory
        from factory.runtime.batches import MicroBatches
        from factory.runtime.loop import train as train_loop

        bp, seed = self.bp, self.seed
        self.report("compile", 0, 1)
        compiled = factory.compile(bp, device=device, seed=seed, precision=self.precision)
        self.report("compile", 1, 1)
        batches = MicroBatches.from_directory(shards, bp.parallelism.micro_batch_size, seed=seed)
        if self.show_steps:  # the loop draws its own bar, with the loss
            return compiled, train_loop(compiled, batches, self.steps, progress=True, seed=seed)
        total = self.steps if self.steps is not None else bp.training_steps
        stream = _reporting(batches, bp, total, self.report)
        history = train_loop(compiled, stream, self.steps, seed=seed)
        self.report("train", len(history.records), len(history.records))
        return compiled, history

    def _write(
        self,
        staging: Path,
        compiled: Compiled,
        history: LoopResult,
        device: str,
        table: dict[str, str],
    ) -> None:
        """train.json and the Hugging Face checkpoint in model/."""
        from factory.exports.hf import export_hf

        summary = {
            "blueprint": self.bp.meta.name,
            "device": device,
            "precision": table,
            "seed": self.seed,
            "data": str(self.data if self.data is not None else "data/"),
            "diverged": history.diverged,
            "records": [dataclasses.asdict(r) for r in history.records],
        }
        text = json.dumps(summary, indent=2) + "\n"
        (staging / "train.json").write_text(text, encoding="utf-8")
        self.report("export", 0, 1)
        export_hf(compiled.model, compiled.blueprint, staging / "model")
        self.report("export", 1, 1)


def _reporting(
    batches: Iterable[MicroBatch], bp: Blueprint, steps: int, report: Progress
) -> Iterator[MicroBatch]:
    """``batches``, reporting ``("train", done, steps)`` as each step draws its first micro-batch.

    The loop takes exactly global_batch_size / micro_batch_size micro-batches
    per step (its documented contract), so when step ``k`` draws its first,
    ``k`` steps are done.
    """
    per_step = bp.parallelism.global_batch_size // bp.parallelism.micro_batch_size
    for index, batch in enumerate(batches):
        if index % per_step == 0:
            report("train", index // per_step, steps)
        yield batch
