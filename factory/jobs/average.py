"""``factory.average``: average a run's checkpoints into one, and export it for Hugging Face.

The checkpoints are a run's kept ones (``RUN/checkpoints/step_N/``; a program's stage's
``RUN/<stage>/checkpoints/``): the newest ``last`` of them, or those of ``steps``. They are
averaged uniformly or, with ``ema``, with exponential weights (``factory.runtime.averaging``
says how, and how the fp32 sums round). The result goes to the stage's
``averaged/<name>/``, written whole or not at all:

* ``checkpoint/``: the averaged checkpoint in a training checkpoint's DCP layout (the
  model and its fp32 masters, no optimizer moments), with ``meta.json``;
* ``average.json``: the source steps, their normalised weights, the weighting and the
  stage;
* ``model/``: its Hugging Face export (``config.json`` + ``model.safetensors``, as the run's
  own ``model/``), unless ``export=False``; ``factory export hf RUN --averaged <name>``
  copies it.

Averaging stays within one stage of a program: each stage keeps its own checkpoints, whose
steps count from that stage's start, and a stage may train another objective on other data
(an SFT stage after pretraining), so a mean across a boundary is a merge of two models'
trainings rather than the smoothing of one's. Every source must hold the same model (the
fingerprint in its ``meta.json`` and the names, shapes and dtypes of its tensors).

Refusals name the argument at fault (:class:`AverageRefused`): a folder that is not a
run's, ``last`` beyond the checkpoints kept, a step not kept, a decay outside (0, 1], a
name that is not a folder name, sources of different models, and an export asked of a run
whose ``model/`` (which gives the Hugging Face config) is not written yet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from factory.exports.hf import write_hf_checkpoint, write_hf_folder
from factory.exports.hf_config import ExportError, blueprint_fields_from_hf
from factory.exports.hf_stage import (
    AVERAGED_DIR,
    HF_FILES,
    PROGRAM_FILE,
    UnknownStage,
    stage_folder,
)
from factory.io import staged_directory
from factory.layers.model_spec import model_spec
from factory.runtime.averaging import (
    MODEL,
    StoredTensor,
    average_checkpoints,
    checkpoint_weights,
    running_average,
    stored_tensors,
    write_average,
)
from factory.runtime.checkpoint import (
    CheckpointDamaged,
    complete_checkpoints,
    describe_failure,
    read_meta,
)
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig
from factory.schemas.program import DEFAULT_STAGE

__all__ = ["RUNNING", "AverageRefused", "AverageResult", "average", "write_running_average"]

RUNNING = "ema"
"""The name under ``averaged/`` of ``training.average``'s moving average, written at the end
of a training by :func:`write_running_average`."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class AverageRefused(ValueError):
    """``factory average`` cannot run as asked; ``argument`` names the flag at fault."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


@dataclass(frozen=True)
class AverageResult:
    """What :func:`average` wrote."""

    folder: Path
    """``averaged/<name>/`` of the run (or of its stage)."""
    steps: tuple[int, ...]
    """The source checkpoints' steps, oldest first."""
    weights: tuple[float, ...]
    """Their normalised weights, in the same order."""
    model: Path | None
    """The Hugging Face export, or None without one."""


def average(
    run: Path,
    *,
    last: int | None = None,
    steps: Sequence[int] | None = None,
    ema: float | None = None,
    name: str | None = None,
    stage: str | None = None,
    export: bool = True,
) -> AverageResult:
    """Average checkpoints of the run folder ``run`` (of its ``stage``, the final one when
    None): the newest ``last`` or those of ``steps`` (exactly one of the two), uniformly or
    with decay ``ema``; write ``averaged/<name>/`` (the module docstring lists it). Raises
    :class:`AverageRefused` before reading any tensor when it cannot run."""
    stage_name, folder = _stage(run, stage)
    kept = complete_checkpoints(folder / "checkpoints")
    if not kept:
        raise AverageRefused("RUN", f"{folder / 'checkpoints'}: no complete checkpoint")
    chosen = _chosen(kept, last, steps)
    decay = 1.0 if ema is None else ema
    if not 0.0 < decay <= 1.0:
        raise AverageRefused("--ema", f"the decay must be in (0, 1], got {decay}")
    name = name or _default_name(last, [step for step, _ in chosen], ema)
    if not _NAME.match(name):
        raise AverageRefused("--name", f"{name!r} is not a folder name (letters, digits, . _ -)")
    if name == RUNNING:
        raise AverageRefused("--name", f"{name!r} is where training.average's average goes")
    fingerprint = _one_model(chosen, "--last" if last is not None else "--steps")
    model_config = _export_config(folder, chosen[-1][1]) if export else None

    weights = checkpoint_weights(len(chosen), decay)
    record = {
        "stage": stage_name,
        "steps": [step for step, _ in chosen],
        "weights": weights,
        "weighting": "uniform" if ema is None else {"ema": decay},
    }
    newest = read_meta(chosen[-1][1])
    meta = {"blueprint": newest.get("blueprint"), "fingerprint": fingerprint, "averaged": record}
    averaged = average_checkpoints([path for _, path in chosen], decay)
    target = folder / AVERAGED_DIR / name
    with staged_directory(target) as staging:
        write_average(staging / "checkpoint", averaged, meta)
        text = json.dumps(record, indent=1) + "\n"
        (staging / "average.json").write_text(text, encoding="utf-8")
        if model_config is not None:
            config, cfg = model_config
            weights_by_name = {
                key.removeprefix(MODEL): value
                for key, value in averaged.items()
                if key.startswith(MODEL)
            }
            write_hf_folder(weights_by_name, cfg, config, staging / "model")
    model = target / "model" if model_config is not None else None
    return AverageResult(target, tuple(record["steps"]), tuple(weights), model)


def _stage(run: Path, stage: str | None) -> tuple[str, Path]:
    if not run.is_dir() or not ((run / PROGRAM_FILE).is_file() or (run / "checkpoints").is_dir()):
        raise AverageRefused(
            "RUN", f"{run}: not a run folder (no checkpoints/ and no {PROGRAM_FILE})"
        )
    try:
        return stage_folder(run, stage)
    except UnknownStage as exc:
        raise AverageRefused("--stage", str(exc)) from None
    except ExportError as exc:
        raise AverageRefused("RUN", str(exc)) from None


def _listing(kept: Sequence[tuple[int, Path]]) -> str:
    steps = ", ".join(str(step) for step, _ in kept)
    return f"{len(kept)} checkpoint{'s' if len(kept) != 1 else ''} kept (steps {steps})"


def _chosen(
    kept: list[tuple[int, Path]], last: int | None, steps: Sequence[int] | None
) -> list[tuple[int, Path]]:
    if (last is None) == (steps is None):
        raise AverageRefused("--last", "give either --last K or --steps A,B,... (one of them)")
    if last is not None:
        if not 1 <= last <= len(kept):
            raise AverageRefused(
                "--last", f"{last} checkpoints asked for, but the run has {_listing(kept)}"
            )
        return kept[-last:]
    assert steps is not None
    by_step = dict(kept)
    unknown = [step for step in steps if step not in by_step]
    if unknown or not steps:
        what = ", ".join(str(s) for s in unknown) or "none given"
        raise AverageRefused(
            "--steps", f"no checkpoint of step {what}; the run has {_listing(kept)}"
        )
    if len(set(steps)) != len(steps):
        raise AverageRefused("--steps", f"a step is named twice: {', '.join(map(str, steps))}")
    return [(step, by_step[step]) for step in sorted(steps)]


def _default_name(last: int | None, steps: Sequence[int], ema: float | None) -> str:
    base = f"last{last}" if last is not None else "steps" + "_".join(map(str, steps))
    return base if ema is None else f"{base}-ema{ema:g}"


def _one_model(chosen: Sequence[tuple[int, Path]], argument: str) -> str:
    """The fingerprint every checkpoint of ``chosen`` holds, after checking that their tensors
    agree by name, shape and dtype."""
    newest_step, newest = chosen[-1]
    fingerprint = read_meta(newest).get("fingerprint")
    tensors = _tensors(newest)
    for step, path in chosen[:-1]:
        other = read_meta(path).get("fingerprint")
        if other != fingerprint or _tensors(path) != tensors:
            raise AverageRefused(
                argument,
                f"step {step} holds another model than step {newest_step} (fingerprint "
                f"{str(other)[:12]} vs {str(fingerprint)[:12]}): only checkpoints of one "
                "model average",
            )
    return str(fingerprint)


def _tensors(path: Path) -> dict[str, StoredTensor]:
    try:
        return stored_tensors(path, running=False)
    except Exception as exc:  # an unreadable .metadata, whatever the unpickler raised
        raise CheckpointDamaged(f"{path}: cannot be read ({describe_failure(exc)})") from exc


def _export_config(folder: Path, newest: Path) -> tuple[dict, ModelConfig]:
    """The run's Hugging Face config and the model config it describes, checked against the
    checkpoint's tensors (names and shapes)."""
    config_file = folder / "model" / HF_FILES[0]
    if not config_file.is_file():
        raise AverageRefused(
            "--no-export",
            f"{config_file} is not written yet (the run has not finished), and the export "
            "takes its config from it: --no-export writes the averaged checkpoint alone",
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    cfg = ModelConfig.model_validate(blueprint_fields_from_hf(config))
    stored = {
        key.removeprefix(MODEL): value.shape
        for key, value in stored_tensors(newest).items()
        if key.startswith(MODEL)
    }
    wrong = [
        name for name, shape in model_spec(cfg).shapes().items()
        if stored.get(name) != tuple(shape)
    ]  # fmt: skip
    if wrong:
        raise AverageRefused(
            "--no-export",
            f"{config_file} does not describe the checkpoints ({', '.join(wrong[:3])} differ): "
            "--no-export writes the averaged checkpoint alone",
        )
    return config, cfg


def write_running_average(run: Path, bp: Blueprint, stage: str | None = None) -> Path:
    """Write ``training.average``'s moving average, as the newest checkpoint of the run folder
    ``run`` holds it, to ``run/averaged/ema/`` (the layout :func:`average` writes; the export
    with ``bp``'s config); returns that folder. Rank 0's job at the end of a training."""
    config = bp.training.average
    assert config is not None
    step, newest = complete_checkpoints(run / "checkpoints")[-1]
    record = {
        "stage": stage or DEFAULT_STAGE,
        "steps": [step],
        "weights": [1.0],
        "weighting": {"ema": config.decay, "start": config.start, "during": "training"},
    }
    meta = {"blueprint": bp.meta.name, "fingerprint": read_meta(newest)["fingerprint"],
            "averaged": record}  # fmt: skip
    averaged = running_average(newest)
    target = run / AVERAGED_DIR / RUNNING
    with staged_directory(target) as staging:
        write_average(staging / "checkpoint", averaged, meta)
        (staging / "average.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        weights = {
            key.removeprefix(MODEL): value
            for key, value in averaged.items()
            if key.startswith(MODEL)
        }
        write_hf_checkpoint(weights, bp, staging / "model")
    return target
