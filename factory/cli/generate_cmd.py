"""``factory generate``: text after prompts from an exported model or a run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from factory.cli.output import EXIT_INVALID
from factory.cli.root import app
from factory.jobs.generate import GenerateRefused, TextGeneration, generate_text

FLAGS = {
    "model": "MODEL",
    "prompt": "--prompt",
    "prompts": "--prompts",
    "tokenizer": "--tokenizer",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "speculative": "--speculative",
}
"""The flag each argument of the job is given by, for its refusals."""


def _refuse(flag: str, message: str) -> typer.Exit:
    typer.echo(f"{flag}: {message}", err=True)
    return typer.Exit(EXIT_INVALID)


def _prompts(prompt: str | None, prompts: Path | None) -> list[str]:
    if (prompt is None) == (prompts is None):
        raise _refuse("--prompt", "give one prompt with --prompt or a file of them with --prompts")
    if prompt is not None:
        return [prompt]
    assert prompts is not None
    try:
        lines = prompts.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise _refuse("--prompts", f"{prompts}: cannot be read ({exc})") from None
    found = [line for line in lines if line.strip()]
    if not found:
        raise _refuse("--prompts", f"{prompts}: no prompt (one per non-empty line)")
    return found


def _record(generation: TextGeneration) -> dict[str, object]:
    result = generation.result
    return {
        "prompt": generation.prompt,
        "text": generation.text,
        "tokens": result.tokens,
        "forwards": result.forwards,
        "tokens_per_forward": result.tokens_per_forward,
        "acceptance": list(result.acceptance),
        "drafted": list(result.drafted),
        "accepted": list(result.accepted),
        "stopped": result.stopped,
    }


@app.command("generate")
def generate_cmd(
    model: Annotated[
        Path, typer.Argument(help="A Hugging Face folder (factory export hf) or a run folder.")
    ],
    prompt: Annotated[str | None, typer.Option("--prompt", help="The prompt text.")] = None,
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help="A file of prompts, one per line.")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")
    ] = 64,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0: greedy; above 0: sampled.")
    ] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="The sampling seed.")] = 0,
    speculative: Annotated[
        str | None,
        typer.Option("--speculative", help="mtp: the model's MTP heads draft, it verifies."),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="A tokenizer.json (default: the model folder's, else factory's)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
) -> None:
    """Generate text after each prompt, greedy or sampled.

    Incremental decoding (KV cache, Mamba states); --speculative mtp drafts with the MTP
    heads and reports the acceptance rate per draft position and the tokens per forward."""
    texts = _prompts(prompt, prompts)
    try:
        generations = generate_text(
            model, texts, max_new_tokens, temperature, seed, speculative, tokenizer
        )
    except GenerateRefused as exc:
        flag = "--prompts" if exc.option == "prompt" and prompts is not None else None
        raise _refuse(flag or FLAGS.get(exc.option, exc.option), str(exc)) from None
    if as_json:
        print(json.dumps([_record(g) for g in generations], indent=2))
        return
    for generation in generations:
        result = generation.result
        typer.echo(f"{generation.prompt}{generation.text}")
        line = f"  {len(result.tokens)} tokens in {result.forwards} forwards"
        if result.drafted:
            rates = ", ".join(f"{rate:.0%}" for rate in result.acceptance)
            line += f" ({result.tokens_per_forward:.2f} per forward; accepted by draft position: {rates})"
        typer.echo(line, err=True)
