"""``factory.generate_text``: text after prompts from a trained model, through
``factory.generation``.

MODEL is a Hugging Face folder (``config.json`` and safetensors: ``factory export hf``'s, or
a run's ``model/``) or a run folder, whose final model is that ``model/`` folder (written when
its training ends; ``factory.exports.hf_stage``). The model is rebuilt from the folder's
config (``factory import hf``'s blueprint, MTP heads included) and its weights. The tokenizer
is ``--tokenizer``, else the folder's ``tokenizer.json``, else the one factory ships (the
CPU proxies'), which must fit the model's vocabulary; nothing is downloaded.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from factory.errors import BlueprintError
from factory.exports.hf_config import ExportError
from factory.exports.hf_import import blueprint_yaml_from_hf, has_weights
from factory.exports.hf_stage import HF_FILES, PROGRAM_FILE, is_run_folder
from factory.loading.recipe import DEFAULT_TOKENIZER
from factory.schemas.blueprint import Blueprint

if typing.TYPE_CHECKING:
    from factory.generation import GenerationResult

__all__ = ["GenerateRefused", "TextGeneration", "generate_text", "model_folder"]

END_OF_TEXT = "<|endoftext|>"
"""The tokenizer's end-of-document token: generation stops after it."""


class GenerateRefused(ValueError):
    """A generation that cannot run as asked; ``option`` names the argument at fault
    (``model``, ``prompt``, ``tokenizer``, or one of ``generate``'s)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class TextGeneration:
    """One prompt's generation."""

    prompt: str
    text: str
    """The new tokens, decoded."""
    result: GenerationResult


def model_folder(model: Path) -> Path:
    """The Hugging Face folder ``model`` names: itself, or a run folder's final ``model/``."""
    if not model.is_dir():
        raise GenerateRefused("model", f"{model}: no such folder")
    if is_run_folder(model):
        folder = model / "model"
        if (model / PROGRAM_FILE).is_file():  # a program's run: its last stage's model
            stages = sorted(p.parent for p in model.glob(f"*/model/{HF_FILES[0]}"))
            folder = stages[-1] if stages else folder
        return _checked(folder)
    return _checked(model)


def _checked(folder: Path) -> Path:
    if not (folder / HF_FILES[0]).is_file():
        raise GenerateRefused(
            "model", f"{folder}: no config.json (a run writes model/ when its training ends)"
        )
    if not has_weights(folder):
        raise GenerateRefused("model", f"{folder}: no *.safetensors weights")
    return folder


def _blueprint(folder: Path) -> Blueprint:
    try:
        return Blueprint.model_validate(yaml.safe_load(blueprint_yaml_from_hf(folder)))
    except (BlueprintError, ExportError, ValueError) as exc:
        raise GenerateRefused(
            "model", f"{folder}: not a NemotronH checkpoint factory reads ({exc})"
        ) from None


def _tokenizer_file(folder: Path, tokenizer: Path | None) -> Path:
    if tokenizer is not None:
        if not tokenizer.is_file():
            raise GenerateRefused("tokenizer", f"{tokenizer}: no such file")
        return tokenizer
    beside = folder / "tokenizer.json"
    return beside if beside.is_file() else DEFAULT_TOKENIZER


def generate_text(
    model: Path,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    speculative: str | None = None,
    tokenizer: Path | None = None,
) -> list[TextGeneration]:
    """Generate after each of ``prompts`` with the model in ``model`` (see the module's
    docstring); raises :class:`GenerateRefused` naming the argument at fault."""
    from tokenizers import Tokenizer

    import factory.compilation
    from factory.generation import GenerationRefused, generate

    if not prompts:
        raise GenerateRefused("prompt", "no prompt given")
    folder = model_folder(model)
    bp = _blueprint(folder)
    path = _tokenizer_file(folder, tokenizer)
    try:
        encoder = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception on a bad file
        raise GenerateRefused("tokenizer", f"{path}: not a tokenizer.json ({exc})") from None
    if encoder.get_vocab_size() > bp.model.vocab_size:
        raise GenerateRefused(
            "tokenizer",
            f"{path} has {encoder.get_vocab_size()} tokens, more than the model's vocabulary "
            f"({bp.model.vocab_size}): pass the model's own tokenizer",
        )
    compiled = factory.compilation.compile(bp, precision="off")  # as transformers runs it
    eos = encoder.token_to_id(END_OF_TEXT)
    out = []
    for prompt in prompts:
        ids = encoder.encode(prompt).ids
        try:
            result = generate(
                compiled.model, ids, max_new_tokens, temperature, seed, speculative, eos
            )
        except GenerationRefused as exc:
            raise GenerateRefused(exc.option, str(exc)) from None
        out.append(TextGeneration(prompt, encoder.decode(result.tokens), result))
    return out
