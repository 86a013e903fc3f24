"""The torch side of ``factory eval`` (``factory.jobs.evaluate``): build the model, load its
weights, evaluate it on one process."""

from __future__ import annotations

import torch
import yaml

from factory import compilation
from factory.compilation import Compiled
from factory.exports.hf_import import blueprint_yaml_from_hf
from factory.jobs.eval_request import HF_MICRO_BATCH, EvalRequest
from factory.runtime import checkpoint
from factory.runtime.callbacks import HeldoutMetrics
from factory.runtime.evaluation import evaluate
from factory.runtime.run_state import fingerprint
from factory.runtime.validation import heldout_records
from factory.schemas.blueprint import Blueprint

__all__ = ["evaluated_records", "loaded_model"]


def loaded_model(request: EvalRequest) -> tuple[Compiled, int]:
    """The model ``request`` names, with its weights, on the CPU (or the GPU where there is
    one): a run's checkpoint under its blueprint and precision backend, or an HF folder
    unquantized; and its optimizer updates (the checkpoint's, 0 for an HF folder)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if request.kind == "hf":
        document = yaml.safe_load(blueprint_yaml_from_hf(request.model))
        bp = Blueprint.model_validate(document)  # init.checkpoint: the folder's weights
        return compilation.compile(bp, device=device, precision="off"), 0
    assert request.blueprint is not None and request.checkpoint is not None
    compiled = compilation.compile(
        request.blueprint,
        device=device,
        precision=request.precision,  # type: ignore[arg-type]
    )
    state = {"model": compiled.model.state_dict()}
    meta, _ = checkpoint.read_checkpoint(request.checkpoint, state, fingerprint(compiled))
    compiled.model.load_state_dict(state["model"])
    if compiled.precision is not None:
        compiled.precision.weights_updated()
    # An averaged checkpoint (factory average) stands at no one update: it reports the step
    # it was asked for, the newest of its sources'.
    position = meta.get("position") or {"update": request.step}
    return compiled, int(position["update"])


def evaluated_records(request: EvalRequest) -> list[HeldoutMetrics]:
    """Each set's and all sets' held-out loss of the model ``request`` names."""
    compiled, update = loaded_model(request)
    bp = compiled.blueprint
    micro = bp.parallelism.micro_batch_size if request.kind == "run" else HF_MICRO_BATCH
    evaluation = evaluate(
        compiled.model, dict(request.sets), request.tokens, micro, bp.model.mtp_depth
    )
    return heldout_records(evaluation, update, request.step)
