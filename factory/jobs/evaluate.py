"""``factory eval``: the held-out loss of a run's checkpoint or of an exported HF folder.

:func:`prepare_eval` resolves what is evaluated and on what, refusing bad input with
:class:`EvalRefused` (naming the argument or flag) before anything loads;
:func:`run_eval` builds the model, loads its weights and runs
:func:`factory.runtime.evaluation.evaluate` (``factory.jobs.evaluate_model``, the torch
side) on one process.

* A run folder (``run.json``, written when its training starts): the checkpoint of
  ``step`` (default its newest) under the run's own blueprint and precision backend, so
  the number is the one its training's ``training.eval`` recorded at that step; a
  program's run folder evaluates its final stage, or ``stage``.
* An HF folder (``config.json`` of ``model_type: nemotron_h`` and safetensors, what
  ``factory export hf`` and a run's ``model/`` hold): the model ``factory import hf``
  makes of it, unquantized, as transformers runs it.

``data`` is a data build's output whose held-out sets are evaluated
(``factory.data.shards.heldout``), or one built folder, evaluated as one set named after
the folder. A run folder defaults to the data it trained on. Torch-free; the CLI's
``factory eval`` prints the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from factory.data.shards.heldout import heldout_sets
from factory.data.shards.manifest import ManifestError
from factory.exports.hf_import import has_weights
from factory.exports.hf_stage import PROGRAM_FILE
from factory.jobs.eval_request import EvalRefused, EvalRequest, EvalResult
from factory.jobs.train_request import RUN_FILE
from factory.schemas.blueprint import Blueprint
from factory.schemas.training import EvalConfig

__all__ = ["EvalRefused", "EvalRequest", "EvalResult", "evaluate_model", "prepare_eval", "run_eval"]


def _read_json(path: Path, where: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EvalRefused(where, f"{path} cannot be read ({exc})") from None
    if not isinstance(value, dict):
        raise EvalRefused(where, f"{path} is not a JSON object")
    return value


def _run_folder(model: Path, stage: str | None) -> Path:
    """The folder of the run (the stage's, for a program) that holds ``run.json``."""
    if not (model / PROGRAM_FILE).is_file():
        if stage is not None:
            raise EvalRefused("--stage", f"{model} is the run of a blueprint without stages")
        return model
    program = _read_json(model / PROGRAM_FILE, "MODEL_OR_RUN")
    names = [entry.get("name") for entry in program.get("stages", [])]
    name = stage if stage is not None else (names[-1] if names else None)
    if name not in names:
        raise EvalRefused("--stage", f"no stage {name!r}; the program has {', '.join(names)}")
    return model / name


def _checkpoint(run: Path, step: int | None) -> tuple[int, Path]:
    # The checkpoint folder's naming is the runtime's (step_NNNNNNNN, complete with meta.json).
    found = sorted(
        (int(path.name[5:]), path)
        for path in (run / "checkpoints").glob("step_*")
        if path.name[5:].isdigit() and (path / "meta.json").is_file()
    )
    if not found:
        raise EvalRefused("MODEL_OR_RUN", f"{run} has no complete checkpoint")
    if step is None:
        return found[-1]
    for saved, path in found:
        if saved == step:
            return saved, path
    steps = ", ".join(str(saved) for saved, _ in found)
    raise EvalRefused("--step", f"{run} has no checkpoint of step {step}; it has {steps}")


def _sets(data: Path) -> dict[str, Path]:
    """A build's held-out sets, or ``data`` itself as one set when it is one built folder."""
    if not data.is_dir():
        raise EvalRefused("--data", f"{data} is not a folder")
    if not (data / "manifest.json").is_file():
        raise EvalRefused("--data", f"{data} is not a data build (no manifest.json)")
    try:
        found = heldout_sets(data)
    except ManifestError as exc:
        raise EvalRefused("--data", str(exc)) from None
    if found:
        return {category: s.folder for category, s in found.items()}
    manifest = _read_json(data / "manifest.json", "--data")
    if not manifest.get("shards"):
        raise EvalRefused("--data", f"{data} has no held-out sets and no shards")
    return {data.resolve().name: data}


def _chosen(sets: dict[str, Path], wanted: tuple[str, ...] | None, data: Path) -> dict[str, Path]:
    if not wanted:
        return sets
    missing = [name for name in wanted if name not in sets]
    if missing:
        have = ", ".join(sets)
        raise EvalRefused(
            "--set", f"{data} has no held-out set {', '.join(missing)}; it has {have}"
        )
    return {name: sets[name] for name in wanted}


def prepare_eval(
    model: Path,
    data: Path | None = None,
    *,
    tokens: int | None = None,
    step: int | None = None,
    stage: str | None = None,
    sets: tuple[str, ...] | None = None,
) -> EvalRequest:
    """Check what ``factory eval MODEL_OR_RUN`` is asked; raise :class:`EvalRefused` naming
    the argument or flag at fault. ``tokens`` defaults to the run's ``training.eval.tokens``
    (or :class:`~factory.schemas.training.EvalConfig`'s default); ``sets`` to every set."""
    model = Path(model)
    if tokens is not None and tokens < 1:
        raise EvalRefused("--tokens", f"must be at least 1, got {tokens}")
    if not model.is_dir():
        raise EvalRefused("MODEL_OR_RUN", f"{model} is not a folder")
    if (model / PROGRAM_FILE).is_file() or (model / RUN_FILE).is_file():
        run = _run_folder(model, stage)
        if not (run / RUN_FILE).is_file():
            raise EvalRefused("MODEL_OR_RUN", f"{run} has no {RUN_FILE}: it never started training")
        described = _read_json(run / RUN_FILE, "MODEL_OR_RUN")
        try:
            bp = Blueprint.model_validate(described["blueprint"])
        except (KeyError, ValueError) as exc:
            raise EvalRefused("MODEL_OR_RUN", f"{run / RUN_FILE}: no blueprint ({exc})") from None
        saved, path = _checkpoint(run, step)
        if data is None:
            data = Path(described.get("data", run / "data"))
        chosen = _chosen(_sets(Path(data)), sets, Path(data))
        evaluation = bp.training.eval or EvalConfig(interval=1)
        return EvalRequest(
            "run", run, chosen, tokens or evaluation.tokens, bp,
            str(described.get("precision", "auto")), path, saved,
        )  # fmt: skip
    if (model / "config.json").is_file():
        if step is not None or stage is not None:
            flag = "--step" if step is not None else "--stage"
            raise EvalRefused(flag, f"{model} is an HF folder: it holds one model")
        if not has_weights(model):
            raise EvalRefused("MODEL_OR_RUN", f"{model} holds no *.safetensors weights")
        if data is None:
            raise EvalRefused("--data", "an HF folder needs --data, a data build to evaluate on")
        chosen = _chosen(_sets(Path(data)), sets, Path(data))
        return EvalRequest("hf", model, chosen, tokens or EvalConfig(interval=1).tokens)
    raise EvalRefused(
        "MODEL_OR_RUN",
        f"{model} is neither a run folder ({RUN_FILE}) nor an HF folder (config.json)",
    )


def run_eval(request: EvalRequest) -> EvalResult:
    """Load the model and evaluate it on one process (imports torch)."""
    from factory.jobs.evaluate_model import evaluated_records

    return EvalResult(request, tuple(evaluated_records(request)))


def evaluate_model(
    model: Path,
    data: Path | None = None,
    *,
    tokens: int | None = None,
    step: int | None = None,
    stage: str | None = None,
    sets: tuple[str, ...] | None = None,
) -> EvalResult:
    """:func:`prepare_eval` then :func:`run_eval`: ``factory eval`` as a library call."""
    request = prepare_eval(model, data, tokens=tokens, step=step, stage=stage, sets=sets)
    return run_eval(request)
