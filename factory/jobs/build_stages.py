"""The stages of ``factory build``, one function each: do the work, write its files, and
return the one-line result the build prints.

Each stage writes only its own files (the build folder's layout,
:data:`factory.report.build_folder.OUTPUTS`), each whole: through a temporary
name and a rename, a staged folder, or a job that resumes itself (the data
build, training). A stage that finds its work wrong raises
:class:`StageFailed` with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from factory.data.build_job import build as build_data
from factory.data.loaded_recipe import load_recipe
from factory.exports.hf_config import hf_config
from factory.exports.megatron import export_megatron
from factory.exports.megatron_refusals import refusals
from factory.io import atomic_write_text, staged_directory
from factory.jobs.build_checks import compare_losses, loss_falls, run_losses
from factory.jobs.build_distributed import run_layout_check
from factory.jobs.train import train
from factory.jobs.train_request import CheckpointPolicy
from factory.layout_search import search_layouts
from factory.planner.plan import plan
from factory.precision.policy import flops_share, resolve_policy
from factory.progress import Progress
from factory.report.build_page import write_build_report
from factory.report.plan_text import markdown_report
from factory.report.search_text import search_records

if TYPE_CHECKING:
    from factory.schemas.blueprint import Blueprint

__all__ = ["BuildContext", "StageFailed", "run_stage"]

SMOKE_CHECKPOINT_EVERY = 8
"""A smoke run killed midway resumes from its last checkpoint (at most this many steps lost)."""


class StageFailed(RuntimeError):
    """A stage ran and its result is wrong (the loss did not fall, the ranks disagree...)."""


@dataclass(frozen=True)
class BuildContext:
    """What every stage may read: the blueprint, where it came from, the folder, the knobs."""

    blueprint: Blueprint
    source: str | Path | None
    out: Path
    steps: int
    check_steps: int
    workers: int
    progress: Progress


def run_stage(name: str, ctx: BuildContext) -> str:
    """Run stage ``name``; return its one-line result."""
    return _RUNNERS[name](ctx)


def _validate(ctx: BuildContext) -> str:

    bp = ctx.blueprint
    recipe = load_recipe(bp.data.recipe)  # BlueprintError: every problem, file:line
    resolved = yaml.safe_dump(bp.model_dump(mode="json"), sort_keys=False)
    origin = f" from {ctx.source}" if ctx.source is not None else ""
    header = f"# Resolved{origin}; every fragment and override applied.\n"
    atomic_write_text(ctx.out / "resolved.yaml", header + resolved)
    sources = len(recipe.recipe.sources)
    return f"blueprint {bp.meta.name} and recipe {recipe.recipe.name} ({sources} sources) valid"


def _plan(ctx: BuildContext) -> str:

    bp, result = ctx.blueprint, plan(ctx.blueprint)
    summary = result.to_dict()
    atomic_write_text(ctx.out / "plan.json", json.dumps(summary, indent=2) + "\n")
    title = f"{bp.meta.name}: {bp.meta.description}".rstrip(": ")
    atomic_write_text(ctx.out / "report.md", markdown_report(summary, title))
    gpus = bp.parallelism.world_size
    found = search_layouts(bp, gpus)
    search = {"gpus": gpus, "gpu": bp.parallelism.gpu, "layouts": search_records(found)}
    atomic_write_text(ctx.out / "search.json", json.dumps(search, indent=2) + "\n")
    peak = result.memory.total / 2**30
    speed = result.performance.tokens_per_s_per_gpu
    best = (
        f" (best layout found: {found[0].performance.tokens_per_s_per_gpu:,.0f})" if found else ""
    )
    return (
        f"{result.params.total / 1e9:.2f}B parameters ({result.params.active / 1e9:.2f}B active), "
        f"{result.flops_per_token.exact / 1e9:.1f} GFLOPs/token, peak rank {peak:.1f} GiB; "
        f"predicted {speed:,.0f} tokens/s per GPU{best}"
    )


def _model(ctx: BuildContext) -> str:
    """The full model on the meta device: the graph checks every tensor against the model
    spec as it is built; here its parameter count must equal the plan's."""
    # The graph is torch's; the build's torch-free stages run without it.
    from factory.compilation import compile

    compiled = compile(ctx.blueprint, device="meta", precision="off")
    model = compiled.model
    tensors = len(model.state_dict(keep_vars=True))
    parameters = sum(p.numel() for p in model.parameters())  # shared (tied) counted once
    planned = plan(compiled.blueprint).params.total
    check = {"device": "meta", "tensors": tensors, "parameters": parameters}
    atomic_write_text(
        ctx.out / "model_check.json",
        json.dumps({**check, "plan_parameters": planned}, indent=2) + "\n",
    )
    if parameters != planned:
        raise StageFailed(f"the graph has {parameters:,} parameters, the plan {planned:,}")
    return f"{tensors:,} tensors match the model spec; {parameters:,} parameters = the plan"


def _precision(ctx: BuildContext) -> str:

    table = resolve_policy(ctx.blueprint)
    share = flops_share(table)
    document = {"modules": [dataclasses.asdict(row) for row in table], "flops_share": share}
    atomic_write_text(ctx.out / "precision.json", json.dumps(document, indent=2) + "\n")
    shares = ", ".join(f"{recipe} {fraction:.0%}" for recipe, fraction in share.items())
    return f"{len(table)} GEMMs; linear FLOPs: {shares}"


def _export(ctx: BuildContext) -> str:

    bp = ctx.blueprint
    with staged_directory(ctx.out / "exports") as staging:
        (staging / "hf").mkdir()
        config = hf_config(bp, dtype="bfloat16")
        (staging / "hf" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        export_megatron(bp, staging / "megatron", allow_unexpressed=True)
    unexpressed = refusals(bp)
    note = f"; {len(unexpressed)} fields Megatron cannot express" if unexpressed else ""
    return f"exports/hf/config.json (NemotronH) and exports/megatron/ (Megatron-Bridge){note}"


def _data(ctx: BuildContext) -> str:

    bp = ctx.blueprint
    manifest = build_data(
        bp.data.recipe,
        ctx.out / "data",
        workers=ctx.workers,
        seq_len=bp.data.seq_len,
        progress=ctx.progress,
    )
    tokens = sum(s["after"]["tokens"] for s in manifest["sources"].values())
    dropped = sum(sum(s["dropped"].values()) for s in manifest["sources"].values())
    return (
        f"{len(manifest['shards'])} shards, {manifest['packing']['samples']:,} samples of "
        f"{bp.data.seq_len}, {tokens:,} tokens; {dropped:,} documents dropped"
    )


def _smoke(ctx: BuildContext) -> str:

    run = ctx.out / "smoke"
    train(
        ctx.blueprint,
        out=run,
        proxy=True,
        steps=ctx.steps,
        workers=ctx.workers,
        progress=ctx.progress,
        checkpoints=CheckpointPolicy(every=SMOKE_CHECKPOINT_EVERY, keep=1),
    )
    losses = run_losses(run)
    verdict = loss_falls(losses)
    if not verdict.fell:  # its checkpoints stay, to look into
        raise StageFailed(f"the proxy's loss did not fall: {verdict.describe()}")
    _drop_checkpoints(run)
    return f"proxy, {len(losses)} steps: {verdict.describe()}"


def _distributed(ctx: BuildContext) -> str:

    if not (ctx.out / "smoke" / "train.json").is_file():
        raise StageFailed("the distributed check compares with the smoke run: run it first")
    smoke = run_losses(ctx.out / "smoke")[: ctx.check_steps]
    check = run_layout_check(ctx.blueprint, ctx.out, len(smoke))
    comparison = compare_losses(check["losses"], smoke)
    _drop_checkpoints(ctx.out / "distributed")  # a rerun of the check starts over anyway
    shutil.rmtree(ctx.out / "distributed" / "model", ignore_errors=True)  # the smoke run's has it
    document = {**check, "smoke_losses": smoke, **comparison.to_dict()}
    atomic_write_text(ctx.out / "distributed.json", json.dumps(document, indent=2) + "\n")
    line = f"{_describe_layout(check)}; {len(smoke)} steps: {comparison.describe()}"
    if not comparison.passed:
        raise StageFailed(f"the layout's losses differ from one process's: {line}")
    return line


def _describe_layout(check: dict[str, Any]) -> str:
    """``2 ranks: dp 2, the experts split over them (ep 2)``: expert parallelism is folded
    onto the other ranks, so its degree does not multiply the world size."""
    layout = check["layout"]
    grid = " x ".join(f"{k} {layout[k]}" for k in ("dp", "tp", "pp") if layout[k] > 1)
    experts = f", the experts split over them (ep {layout['ep']})" if layout["ep"] > 1 else ""
    return f"{check['world_size']} ranks: {grid}{experts}"


def _drop_checkpoints(run: Path) -> None:
    """A finished training stage's checkpoints (the proxy's weights and optimizer state, most
    of a build's bytes) serve only to resume it; the build reuses the stage without them."""
    shutil.rmtree(run / "checkpoints", ignore_errors=True)


def _report(ctx: BuildContext) -> str:

    page = write_build_report(ctx.out)
    return f"{page.name} ({page.stat().st_size / 1024:.0f} KiB, self-contained)"


_RUNNERS: dict[str, Any] = {
    "validate": _validate,
    "plan": _plan,
    "model": _model,
    "precision": _precision,
    "export": _export,
    "data": _data,
    "smoke": _smoke,
    "distributed": _distributed,
    "report": _report,
}
