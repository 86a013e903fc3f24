"""``factory build``'s evaluate stage: which of the smoke run's checkpoints is good.

The smoke run trains with ``training.eval`` on its data's held-out sets (:func:`with_evaluation`),
so its loss plot carries the held-out curves. This stage then takes the run's final stage
(the whole run for a single-stage blueprint) and writes ``evaluation.json``:

* the held-out loss of every kept checkpoint and of their uniform average (``factory average
  --last K``), each per set and over all sets, evaluated as ``factory eval`` does under the
  run's own blueprint and precision backend, so the rows compare;
* a few greedy samples of the final model (``factory generate``), with MTP self-speculation
  where the model has MTP heads: the acceptance rate per draft position and the tokens per
  forward.

Then it drops the checkpoints, which served only this and resuming. Everything is
deterministic: the same build writes the same numbers and texts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Any

from factory.data.loaded_recipe import load_recipe
from factory.jobs.eval_request import EvalResult
from factory.jobs.evaluate import prepare_eval, run_eval
from factory.jobs.generate import generate_text
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program
from factory.schemas.training import EvalConfig

__all__ = [
    "AVERAGED_NAME",
    "PROMPTS",
    "SAMPLE_TOKENS",
    "SMOKE_EVAL_TOKENS",
    "evaluate_smoke",
    "evaluated_folder",
    "with_evaluation",
]

SMOKE_EVAL_TOKENS = 2048
"""Positions the smoke run reads of each held-out set per evaluation: the presets' recipes
hold out 2K tokens per source, so this is about a whole set, at a few seconds per
evaluation on the CPU proxy."""

AVERAGED_NAME = "kept"
"""``averaged/<name>/`` of the smoke run's average of its kept checkpoints."""

PROMPTS = ("The", "def main(", "Question: What is 2 + 2?\nAnswer:")
"""The samples' prompts: prose, code and a question, as the presets' mixtures hold."""

SAMPLE_TOKENS = 24
"""New tokens per sample."""


def holds_out(program: Program) -> bool:
    """Whether every stage's recipe sets documents aside (``heldout`` on its sources), so
    the smoke run's data has held-out sets to evaluate on."""
    for stage in program.stages:
        recipe = load_recipe(stage.blueprint.data.recipe).recipe
        if not any(recipe.heldout_of(source) for source in recipe.sources):
            return False
    return True


def with_evaluation(blueprint: Blueprint, program: Program, steps: int) -> Blueprint:
    """``blueprint`` evaluating its held-out sets 4 times over ``steps`` steps per stage (and
    after the last), when every stage's recipe holds documents out; else unchanged."""
    if not holds_out(program):
        return blueprint
    evaluation = EvalConfig(interval=max(1, steps // 4), tokens=SMOKE_EVAL_TOKENS)
    training = blueprint.training.model_copy(update={"eval": evaluation})
    return blueprint.model_copy(update={"training": training})


def _losses(result: EvalResult) -> dict[str, Any]:
    """The overall held-out loss and each set's, with the MTP losses of the overall."""
    overall = next(r for r in result.records if r.category is None)
    return {
        "loss": overall.loss,
        "perplexity": overall.perplexity,
        "tokens": overall.tokens,
        "mtp_losses": overall.mtp_losses,
        "sets": {r.category: r.loss for r in result.records if r.category is not None},
    }


def _samples(run: Path, speculative: bool) -> list[dict[str, Any]]:
    generated = generate_text(
        run, list(PROMPTS), SAMPLE_TOKENS, speculative="mtp" if speculative else None
    )
    return [
        {
            "prompt": g.prompt,
            "text": g.text,
            "forwards": g.result.forwards,
            "new_tokens": len(g.result.tokens),
            "drafted": list(g.result.drafted),
            "accepted": list(g.result.accepted),
        }
        for g in generated
    ]


def _acceptance(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Over all samples: the drafts verified and accepted per draft position, and the new
    tokens per main-model forward."""
    forwards = sum(s["forwards"] for s in samples)
    return {
        "drafted": [sum(n) for n in zip(*(s["drafted"] for s in samples), strict=True)],
        "accepted": [sum(n) for n in zip(*(s["accepted"] for s in samples), strict=True)],
        "tokens_per_forward": sum(s["new_tokens"] for s in samples) / forwards,
    }


def evaluated_folder(run: Path, program: Program) -> Path:
    """The run folder this stage evaluates: the smoke run's, or its last program stage's."""
    return run / program.stages[-1].name if program.declared else run


def evaluate_smoke(run: Path, program: Program, average_last: int = 3) -> dict[str, Any]:
    """The record ``evaluation.json`` holds for the smoke run in ``run`` (the module's
    docstring); drops the checkpoints after."""
    from factory.jobs.average import average  # torch: the build's other stages load none
    from factory.runtime.checkpoint import complete_checkpoints

    folder = evaluated_folder(run, program)
    stage_name = program.stages[-1].name if program.declared else None
    kept = complete_checkpoints(folder / "checkpoints")
    if not kept:
        raise FileNotFoundError(f"{folder / 'checkpoints'}: no complete checkpoint to evaluate")
    requests = [prepare_eval(run, step=step, stage=stage_name) for step, _ in kept]
    record: dict[str, Any] = {
        "stage": stage_name,
        "sets": sorted(requests[-1].sets),
        "checkpoints": [
            {"step": request.step, **_losses(run_eval(request))} for request in requests
        ],
    }
    averaged = average(run, last=min(average_last, len(kept)), name=AVERAGED_NAME,
                       stage=stage_name, export=False)  # fmt: skip
    of_average = dataclasses.replace(requests[-1], checkpoint=averaged.folder / "checkpoint")
    record["averaged"] = {
        "steps": list(averaged.steps),
        "weights": list(averaged.weights),
        **_losses(run_eval(of_average)),
    }
    trained = requests[-1].blueprint
    mtp = trained is not None and trained.model.mtp_depth > 0
    record["speculative"] = "mtp" if mtp else None
    record["samples"] = _samples(run, mtp)
    record["acceptance"] = _acceptance(record["samples"]) if mtp else None
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    shutil.rmtree(averaged.folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # averaged/ stays where training.average wrote there
        averaged.folder.parent.rmdir()
    return record
