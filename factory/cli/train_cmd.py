"""``factory train``: train a blueprint's model (or its CPU proxy) on its data recipe.

One process, the blueprint's optimizer, schedule, batch and precision policy
(``factory.runtime``). The output folder appears whole or not at all:

* ``train.json``: what ran (blueprint, device, precision) and one record per
  step (loss, learning rate, gradient norm, tokens, seconds);
* ``model/``: the trained weights as a Hugging Face checkpoint
  (``config.json`` + ``model.safetensors``, loadable by transformers and by
  ``factory import hf``);
* ``data/``: the curated shards it trained on (skipped with ``--data DIR``).

Full-size Nemotron 3 models need a cluster: exported Megatron arguments are the
way to scale out. This command refuses a model whose fp32 weights, gradients
and Adam states would not fit this machine's memory, and points at ``--proxy``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from factory.cli.app import app
from factory.cli.output import print_diagnostics
from factory.cli.validate_cmd import SetOption

if TYPE_CHECKING:
    from rich.console import Console

    from factory.schemas.blueprint import Blueprint

_BYTES_PER_PARAM = 16  # fp32 weight + gradient + two Adam moments


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


@app.command()
def train(
    target: Annotated[str, typer.Argument(help="Preset name or blueprint path.")],
    proxy: Annotated[bool, typer.Option("--proxy", help="Train the CPU proxy.")] = False,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Optimizer steps (default: blueprint's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default: runs/NAME).")
    ] = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="Train on shards already built here.")
    ] = None,
    precision: Annotated[
        str, typer.Option("--precision", help="auto | emulate | te | off")
    ] = "auto",
    seed: Annotated[int | None, typer.Option("--seed", help="Default: training.seed.")] = None,
    overrides: SetOption = None,
) -> None:
    """Train on the blueprint's data recipe; write train.json, model/ and data/."""
    from rich.console import Console

    from factory.loading.load import load

    console = Console(stderr=True)
    if precision not in ("auto", "emulate", "te", "off"):
        console.print(
            f"factory train: --precision must be auto, emulate, te or off, not {precision!r}"
        )
        raise typer.Exit(2)
    if precision == "te":
        from factory.precision.te_backend import require_te

        try:
            require_te()
        except ImportError as exc:
            console.print(f"factory train: {exc}", markup=False)
            raise typer.Exit(2) from None
    loaded = load(target, overrides or [])
    print_diagnostics(loaded.warnings)
    bp = loaded.blueprint
    if proxy:
        from factory.proxy import derive_proxy

        bp = derive_proxy(bp)
    _refuse_if_too_big(bp, proxy, console)
    destination = out or Path("runs") / bp.meta.name
    result = _run(bp, destination, data, steps, precision, seed, console)  # type: ignore[arg-type]
    last = result["records"][-1] if result["records"] else None
    if result["diverged"]:
        console.print(f"[red]diverged[/red] at step {len(result['records'])}: see {destination}")
        raise typer.Exit(1)
    if last is not None:
        console.print(
            f"[green]trained[/green] {bp.meta.name}: {len(result['records'])} steps, "
            f"loss {last['lm_loss']:.4f} -> {destination}"
        )


def _refuse_if_too_big(bp: Blueprint, proxy: bool, console: Console) -> None:
    from factory.planner.params import count_params

    params = count_params(bp.model).total
    need, have = params * _BYTES_PER_PARAM, _memory_bytes()
    if have and need > have:
        hint = "" if proxy else "; train its CPU proxy with --proxy"
        console.print(
            f"factory train: {bp.meta.name} has {params:,} parameters, whose fp32 weights, "
            f"gradients and Adam states need {need / 2**30:,.0f} GiB, more than this "
            f"machine's {have / 2**30:,.0f} GiB{hint}"
        )
        raise typer.Exit(2)


def _run(
    bp: Blueprint,
    destination: Path,
    data: Path | None,
    steps: int | None,
    precision: Literal["auto", "emulate", "te", "off"],
    seed: int | None,
    console: Console,
) -> dict[str, Any]:
    import dataclasses
    import shutil

    import torch

    import factory
    from factory.exports.hf import export_hf
    from factory.io import staged_directory
    from factory.runtime.batches import MicroBatches, build_shards
    from factory.runtime.loop import train as train_loop

    device = "cuda" if torch.cuda.is_available() else "cpu"
    run_seed = bp.training.seed if seed is None else seed
    with staged_directory(destination) as staging:
        shards = data
        if shards is None:
            with console.status("curating data"):
                shards = build_shards(bp, staging / "data")
            shutil.rmtree(shards / ".work", ignore_errors=True)  # intermediates only
        compiled = factory.compile(bp, device=device, seed=run_seed, precision=precision)
        batches = MicroBatches.from_directory(
            shards, bp.parallelism.micro_batch_size, seed=run_seed
        )
        result = train_loop(compiled, batches, steps, progress=sys.stderr.isatty(), seed=run_seed)
        summary = {
            "blueprint": bp.meta.name,
            "device": device,
            "precision": dict(compiled.precision.recipes()) if compiled.precision else {},
            "seed": run_seed,
            "data": str(shards if data is not None else "data/"),
            "diverged": result.diverged,
            "records": [dataclasses.asdict(r) for r in result.records],
        }
        text = json.dumps(summary, indent=2) + "\n"
        (staging / "train.json").write_text(text, encoding="utf-8")
        export_hf(compiled.model, compiled.blueprint, staging / "model")
    return summary
