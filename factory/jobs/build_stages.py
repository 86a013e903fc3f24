"""The stages of ``factory build``, one function each: do the work, write its files, and
return the one-line result the build prints.

A stage returns an :class:`Outcome`: its line and, for a program, what it did per program
stage (``build.json``'s ``program``). Each stage writes only its own files (the build
folder's layout, :data:`factory.report.build_folder.OUTPUTS`), each whole: through a
temporary name and a rename, a staged folder, or a job that resumes itself (the data
build, training). A stage that finds its work wrong raises
:class:`StageFailed` with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from factory.data.build_job import build as build_data
from factory.data.build_lock import LOCK_NAME
from factory.data.loaded_recipe import load_recipe
from factory.exports.hf_config import hf_config
from factory.exports.megatron import export_megatron
from factory.exports.megatron_refusals import program_refusals
from factory.io import atomic_write_text, staged_directory
from factory.jobs.build_checks import compare_losses, loss_falls, run_losses
from factory.jobs.build_distributed import run_layout_check
from factory.jobs.build_evaluation import evaluate_smoke, evaluated_folder, with_evaluation
from factory.jobs.build_program import curations, program_plan, stage_fall, stage_proxies
from factory.jobs.train import train
from factory.jobs.train_request import CheckpointPolicy
from factory.layout_search import search_layouts
from factory.planner.plan import plan
from factory.precision.policy import flops_share, resolve_policy
from factory.progress import Progress
from factory.report.build_folder import PROGRAM_PLAN
from factory.report.build_page import write_build_report
from factory.report.plan_text import markdown_report
from factory.report.search_text import search_records
from factory.report.units import human_count
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import Program

__all__ = ["BuildContext", "Outcome", "StageFailed", "run_stage"]

SMOKE_CHECKPOINT_EVERY = 8
"""A smoke run killed midway resumes from its last checkpoint (at most this many steps lost)."""

SMOKE_CHECKPOINTS_KEPT = 3
"""The evaluate stage averages the smoke run's kept checkpoints: a third of its steps apart."""


def _smoke_checkpoints(steps: int) -> CheckpointPolicy:
    """Every third of the run's (or a program stage's) steps, at most
    :data:`SMOKE_CHECKPOINT_EVERY` apart, the last :data:`SMOKE_CHECKPOINTS_KEPT` kept."""
    every = min(SMOKE_CHECKPOINT_EVERY, max(1, steps // SMOKE_CHECKPOINTS_KEPT))
    return CheckpointPolicy(every=every, keep=SMOKE_CHECKPOINTS_KEPT)


@dataclass(frozen=True)
class Outcome:
    """A stage's one-line result and, for a program, its record per program stage."""

    result: str
    program: dict[str, Any] | None = None


class StageFailed(RuntimeError):
    """A stage ran and its result is wrong (the loss did not fall, the ranks disagree...)."""

    def __init__(self, message: str, program: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.outcome = Outcome(message, program)


@dataclass(frozen=True)
class BuildContext:
    """What every stage may read: the blueprint, where it came from, the folder, the knobs."""

    blueprint: Blueprint
    program: Program
    """The blueprint's stages (one implicit stage without ``stages``)."""
    source: str | Path | None
    out: Path
    steps: int
    check_steps: int
    workers: int
    progress: Progress


def run_stage(name: str, ctx: BuildContext) -> Outcome:
    """Run stage ``name``; return its one-line result (and its record per program stage)."""
    done = _RUNNERS[name](ctx)
    return done if isinstance(done, Outcome) else Outcome(done)


def _validate(ctx: BuildContext) -> str:

    bp = ctx.blueprint
    names = dict.fromkeys(stage.blueprint.data.recipe for stage in ctx.program)
    # BlueprintError: every problem, file:line
    recipes = [load_recipe(name).recipe for name in names]
    resolved = yaml.safe_dump(bp.model_dump(mode="json"), sort_keys=False)
    origin = f" from {ctx.source}" if ctx.source is not None else ""
    header = f"# Resolved{origin}; every fragment and override applied.\n"
    atomic_write_text(ctx.out / "resolved.yaml", header + resolved)
    listed = ", ".join(f"{r.name} ({len(r.sources)} sources)" for r in recipes)
    if not ctx.program.declared:
        return f"blueprint {bp.meta.name} and recipe {listed} valid"
    stages = ", ".join(ctx.program.names)
    return f"blueprint {bp.meta.name} (program: {stages}) and recipes {listed} valid"


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
    line = (
        f"{result.params.total / 1e9:.2f}B parameters ({result.params.active / 1e9:.2f}B active), "
        f"{result.flops_per_token.exact / 1e9:.1f} GFLOPs/token, peak rank {peak:.1f} GiB; "
        f"predicted {speed:,.0f} tokens/s per GPU{best}"
    )
    if not ctx.program.declared:
        return line
    planned = program_plan(bp, ctx.program)
    atomic_write_text(ctx.out / PROGRAM_PLAN, json.dumps(planned, indent=2) + "\n")
    return (
        f"{line}; program of {len(ctx.program)} stages, {human_count(planned['tokens'])} tokens "
        f"in {planned['steps']:,} steps"
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
    unexpressed = program_refusals(ctx.program)
    note = f"; {len(unexpressed)} fields Megatron cannot express" if unexpressed else ""
    return f"exports/hf/config.json (NemotronH) and exports/megatron/ (Megatron-Bridge){note}"


def _data(ctx: BuildContext) -> str | Outcome:

    if ctx.program.declared:
        return _program_data(ctx)
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


def _program_data(ctx: BuildContext) -> Outcome:
    """Each program stage's recipe at its proxy's sequence length, in ``data/<stage>/``; the
    stages of one curation (same recipe, same length) get hard-linked copies of the folder
    built for the first of them, so the smoke run reads ``DATA/<stage>/`` for every stage
    and the bytes are on disk once."""
    records: dict[str, Any] = {}
    built = 0
    for curation in curations(ctx.program):
        first, *others = curation.stages
        manifest = build_data(
            curation.recipe,
            ctx.out / "data" / first,
            workers=ctx.workers,
            seq_len=curation.seq_len,
            progress=ctx.progress,
        )
        built += 1
        for name in others:
            _linked_copy(ctx.out / "data" / first, ctx.out / "data" / name)
        summary = _data_summary(manifest, curation.recipe, curation.seq_len)
        records[first] = {**summary, "shared_with": None}
        records.update({name: {**summary, "shared_with": first} for name in others})
    ordered = {name: records[name] for name in ctx.program.names}
    samples = sum(r["samples"] for r in ordered.values())
    return Outcome(
        f"{len(ordered)} stages from {built} curations ({samples:,} samples in all); "
        + "; ".join(f"{name}: {r['samples']:,} x {r['seq_len']}" for name, r in ordered.items()),
        ordered,
    )


def _data_summary(manifest: dict[str, Any], recipe: str, seq_len: int) -> dict[str, Any]:
    sources = manifest["sources"].values()
    return {
        "recipe": recipe,
        "seq_len": seq_len,
        "shards": len(manifest["shards"]),
        "samples": manifest["packing"]["samples"],
        "tokens": sum(s["after"]["tokens"] for s in sources),
        "dropped": sum(sum(s["dropped"].values()) for s in sources),
    }


def _linked_copy(source: Path, target: Path) -> None:
    """``target`` as a copy of the finished folder ``source`` whose files are hard links (a
    plain copy where the file system has none), without its build lock (the copy is no data
    build's folder); a finished copy is kept."""
    if (target / "manifest.json").is_file():
        return
    with staged_directory(target) as staging:
        shutil.copytree(source, staging, copy_function=_link_or_copy, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(LOCK_NAME))  # fmt: skip


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _smoke(ctx: BuildContext) -> str | Outcome:

    if ctx.program.declared:
        return _program_smoke(ctx)
    run = ctx.out / "smoke"
    train(
        with_evaluation(ctx.blueprint, ctx.program, ctx.steps),
        out=run,
        proxy=True,
        steps=ctx.steps,
        workers=ctx.workers,
        progress=ctx.progress,
        checkpoints=_smoke_checkpoints(ctx.steps),
    )
    losses = run_losses(run)
    verdict = loss_falls(losses)
    if not verdict.fell:  # its checkpoints stay, to look into
        raise StageFailed(f"the proxy's loss did not fall: {verdict.describe()}")
    return f"proxy, {len(losses)} steps: {verdict.describe()}"


def _curated(ctx: BuildContext) -> Path | None:
    """The data stage's ``data/`` when it holds every program stage's shards; None (after
    ``--skip data``): the smoke run curates each stage's into ``smoke/<stage>/data``, as a
    single-stage smoke run curates its own."""
    folder = ctx.out / "data"
    whole = all((folder / name / "manifest.json").is_file() for name in ctx.program.names)
    return folder if whole else None


def _program_smoke(ctx: BuildContext) -> Outcome:
    """The proxy trained ``ctx.steps`` steps per program stage, through every stage, on
    ``data/<stage>/``; each stage's loss judged by :func:`stage_fall`."""
    run = ctx.out / "smoke"
    train(
        with_evaluation(ctx.blueprint, ctx.program, ctx.steps),
        out=run,
        proxy=True,
        steps=ctx.steps,
        data=_curated(ctx),
        workers=ctx.workers,
        progress=ctx.progress,
        checkpoints=_smoke_checkpoints(ctx.steps),
    )
    records: dict[str, Any] = {}
    start: float | None = None
    failed = []
    for name in ctx.program.names:
        losses = run_losses(run / name)
        verdict = stage_fall(name, losses, start)
        start = verdict.first if start is None else start
        records[name] = {"steps": len(losses), **verdict.to_dict()}
        if not verdict.passed:
            failed.append(f"{name}: {verdict.describe()}")
    if failed:  # its checkpoints stay, to look into
        raise StageFailed("the proxy's loss fails in " + "; ".join(failed), records)
    for name in ctx.program.names[:-1]:  # the last stage's: the evaluate stage's to average
        _drop_checkpoints(run / name)
    _drop_checkpoints(run)
    line = "; ".join(f"{n} {r['first']:.2f} -> {r['last']:.2f}" for n, r in records.items())
    return Outcome(f"proxy, {ctx.steps} steps per stage, every stage passed: {line}", records)


def _evaluate(ctx: BuildContext) -> str:
    """The smoke run's kept checkpoints and their average on the held-out sets, and samples
    of its model (``factory.jobs.build_evaluation``), in ``evaluation.json``."""
    run = ctx.out / "smoke"
    if not (evaluated_folder(run, ctx.program) / "train.json").is_file():
        raise StageFailed("the evaluate stage evaluates the smoke run: run it first")
    record = evaluate_smoke(run, ctx.program)
    atomic_write_text(ctx.out / "evaluation.json", json.dumps(record, indent=2) + "\n")
    best = min(record["checkpoints"], key=lambda c: c["loss"])
    averaged = record["averaged"]
    line = (
        f"held-out loss {record['checkpoints'][-1]['loss']:.3f} at the last step, best "
        f"{best['loss']:.3f} at step {best['step']}, {averaged['loss']:.3f} averaged over "
        f"steps {', '.join(map(str, averaged['steps']))}"
    )
    if (acceptance := record["acceptance"]) is not None:
        pairs = zip(acceptance["accepted"], acceptance["drafted"], strict=True)
        rates = ", ".join(f"{a / d:.0%}" if d else "none drafted" for a, d in pairs)
        line += f"; MTP drafts accepted per position: {rates}"
    return line


def _distributed(ctx: BuildContext) -> str:

    if ctx.program.declared:
        return _program_distributed(ctx)
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


def _program_distributed(ctx: BuildContext) -> str:
    """The check on the program's first stage: its pretraining layout is the one the later
    stages start from, and the check's own layout (DP, EP under MoE) is the same for every
    stage. Its one-process reference is a run of the same stage blueprint, not the smoke
    run, whose first stage may belong to a schedule spanning later stages."""
    first, proxy = ctx.program.stages[0], stage_proxies(ctx.program)[0]
    curated = _curated(ctx)
    data = curated / first.name if curated else ctx.out / "smoke" / first.name / "data"
    if not (data / "manifest.json").is_file():
        raise StageFailed("the distributed check trains on the smoke run's data: run it first")
    reference = ctx.out / "distributed" / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    train(proxy, out=reference, steps=ctx.check_steps, data=data)
    expected = run_losses(reference)
    shutil.rmtree(reference)
    check = run_layout_check(first.blueprint, ctx.out, len(expected), data=data, proxy=proxy)
    comparison = compare_losses(check["losses"], expected)
    _drop_checkpoints(ctx.out / "distributed")
    shutil.rmtree(ctx.out / "distributed" / "model", ignore_errors=True)
    document = {**check, "stage": first.name, "reference": "one process",
                "smoke_losses": expected, **comparison.to_dict()}  # fmt: skip
    atomic_write_text(ctx.out / "distributed.json", json.dumps(document, indent=2) + "\n")
    line = (
        f"stage {first.name}, {_describe_layout(check)}; {len(expected)} steps against one "
        f"process: {comparison.describe()}"
    )
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
    "evaluate": _evaluate,
    "distributed": _distributed,
    "report": _report,
}
