"""``factory generate``: text from an exported model or a run folder, and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from blueprint_factory import DELETE
from generation_models import tiny_blueprint
from tokenizers import Tokenizer

import factory
from factory.exports.hf import write_hf_checkpoint
from factory.generation import generate
from factory.loading.recipe import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, factory.Compiled]:
    """A tiny model with MTP and the shipped tokenizer's vocabulary, exported."""
    compiled = factory.compile(tiny_blueprint(**{"model.vocab_size": 4096}), seed=7)
    folder = tmp_path_factory.mktemp("hf")
    write_hf_checkpoint(compiled.model, compiled.blueprint, folder)
    return folder, compiled


def _export(bp: factory.schemas.Blueprint, folder: Path) -> Path:
    write_hf_checkpoint(factory.compile(bp, seed=1).model, bp, folder)
    return folder


def test_generates_what_the_library_does(cli, exported, tmp_path: Path) -> None:
    folder, compiled = exported
    prompt = "The quick brown fox"
    status, out, err = cli(
        "generate", str(folder), "--prompt", prompt, "--max-new-tokens", "6", "--json"
    )
    assert status == 0, err
    [record] = json.loads(out)
    ids = Tokenizer.from_file(str(DEFAULT_TOKENIZER)).encode(prompt).ids
    expected = generate(compiled.model, ids, 6, eos_token_id=1)
    assert record["tokens"] == expected.tokens and record["forwards"] == expected.forwards
    assert record["prompt"] == prompt and record["acceptance"] == []
    # A run folder's model/ is what its run generates with; speculation keeps greedy text.
    run = tmp_path / "run"
    shutil.copytree(folder, run / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n\nA second one\n", encoding="utf-8")
    status, out, err = cli(
        "generate", str(run), "--prompts", str(prompts), "--max-new-tokens", "6",
        "--speculative", "mtp", "--json",
    )  # fmt: skip
    assert status == 0, err
    first, second = json.loads(out)
    assert first["tokens"] == expected.tokens and second["prompt"] == "A second one"
    assert len(first["acceptance"]) == 2 and first["tokens_per_forward"] >= 1.0
    status, out, err = cli("generate", str(folder), "--prompt", prompt, "--max-new-tokens", "3")
    assert status == 0 and out.startswith(prompt) and "3 tokens in 3 forwards" in err


def test_bad_input_exits_2_naming_the_flag(cli, exported, tmp_path: Path) -> None:
    folder, _ = exported
    no_mtp = _export(
        tiny_blueprint(**{"model.vocab_size": 4096, "model.mtp": DELETE}), tmp_path / "plain"
    )
    small_vocab = _export(tiny_blueprint(), tmp_path / "small")
    cases = [
        ([str(no_mtp), "--prompt", "hi", "--speculative", "mtp"], "--speculative:", "no MTP"),
        ([str(folder), "--prompt", "hi", "--speculative", "eagle"], "--speculative:", "eagle"),
        ([str(folder)], "--prompt:", "--prompts"),
        ([str(folder), "--prompt", "a", "--prompts", str(tmp_path)], "--prompt:", "one prompt"),
        ([str(tmp_path / "absent"), "--prompt", "hi"], "MODEL:", "no such folder"),
        ([str(tmp_path), "--prompt", "hi"], "MODEL:", "no config.json"),
        ([str(folder), "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens:", "at least"),
        ([str(folder), "--prompt", "hi", "--temperature", "-1"], "--temperature:", "or more"),
        ([str(small_vocab), "--prompt", "hi"], "--tokenizer:", "4096 tokens"),
        ([str(folder), "--prompt", "hi", "--tokenizer", str(tmp_path / "t.json")], "--tokenizer:", "no such file"),
        ([str(folder), "--prompts", str(tmp_path / "none.txt")], "--prompts:", "cannot be read"),
    ]  # fmt: skip
    for args, flag, words in cases:
        status, _, err = cli("generate", *args)
        assert status == 2, (args, err)
        assert err.startswith(flag) and words in err, (args, err)
