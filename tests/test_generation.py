"""Incremental decoding and ``factory.generation.generate``: every layer type's cached step
equals its full forward, greedy decoding equals transformers' on the HF export, MTP
self-speculation keeps greedy text unchanged, sampling is a function of its seed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from blueprint_factory import DELETE
from generation_models import tiny_blueprint, toy_sequences, train_tiny

import factory
from factory.exports.hf import write_hf_checkpoint
from factory.generation import GenerationRefused, generate
from factory.nn.outputs import RoutedOutput

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def trained() -> factory.Compiled:
    return train_tiny(tiny_blueprint(), steps=30)


@pytest.fixture(scope="module")
def untrained() -> factory.Compiled:
    """Random weights: the MTP heads draft badly, so verification rejects drafts."""
    return factory.compile(tiny_blueprint(), seed=5)


def _mixed(out: torch.Tensor | RoutedOutput) -> torch.Tensor:
    return out.y if isinstance(out, RoutedOutput) else out


def _prompt(length: int = 12, seed: int = 999) -> list[int]:
    return toy_sequences(128, 1, length, seed)[0].tolist()


def test_every_layer_types_cached_step_equals_its_forward(trained: factory.Compiled) -> None:
    """Each block's mixer over 24 positions decoded as 10, then 3 taken back to 1, then one at
    a time, against one forward over all 24."""
    model = trained.model
    blocks = [*model.backbone.layers, *model.mtp.layers]
    assert {b.symbol for b in blocks} == set(trained.blueprint.model.pattern) | {"*", "-"}
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(0))
    for block in blocks:
        with torch.no_grad():
            full = _mixed(block.mixer(x))
            cache = block.mixer.init_cache(2, 32, x.device, x.dtype)
            pieces = [_mixed(block.mixer.decode(x[:, :10], cache))]
            _mixed(block.mixer.decode(x[:, 10:13], cache))
            cache.keep(1)
            for i in range(11, 24):
                pieces.append(_mixed(block.mixer.decode(x[:, i : i + 1], cache)))
            pieces.insert(1, full[:, 10:11])  # the one position the 3-step kept
            stepped = torch.cat(pieces, dim=1)
        scale = full.abs().max().item()
        assert (stepped - full).abs().max().item() <= TOLERANCE * max(scale, 1.0), block.path


def test_model_decoded_token_by_token_equals_one_forward(trained: factory.Compiled) -> None:
    model = trained.model
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        caches = model.init_caches(2, 40)
        steps = [model.decode(ids[:, :1], caches).logits]
        steps += [model.decode(ids[:, i : i + 1], caches).logits for i in range(1, 40)]
        assert (torch.cat(steps, 1) - full).abs().max().item() < TOLERANCE * 10
        # A prompt longer than a Mamba step keeps states for, taken back to 17 positions.
        caches = model.init_caches(2, 40)
        model.decode(ids[:, :30], caches)
        for cache in caches:
            cache.keep(17)
        rest = model.decode(ids[:, 17:], caches).logits
        assert (rest - full[:, 17:]).abs().max().item() < TOLERANCE * 10


def test_greedy_equals_transformers_greedy(trained: factory.Compiled, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_hf_checkpoint(trained.model, trained.blueprint, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    eos = hf.generation_config.eos_token_id
    prompt = _prompt(seed=7)
    ours = generate(trained.model, prompt, 32, eos_token_id=eos)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert theirs[0, len(prompt) : len(prompt) + len(ours.tokens)].tolist() == ours.tokens
    assert len(ours.tokens) > 8  # the comparison is not cut short by the end token
    # The toy language is learnt: what both decode is its continuation.
    assert generate(trained.model, _prompt(), 32).tokens == _prompt(44)[12:]


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_speculative_greedy_equals_plain_greedy(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which).model
    for length in (3, 17, 30):  # short and long prompts (the Mamba step's two paths)
        prompt = _prompt(length, seed=length)
        plain = generate(model, prompt, 25)
        speculative = generate(model, prompt, 25, speculative="mtp")
        assert speculative.tokens == plain.tokens
        assert plain.forwards == 25 and plain.tokens_per_forward == 1.0
        assert speculative.forwards < 25 or which == "untrained"


def test_acceptance_statistics_add_up(
    trained: factory.Compiled, untrained: factory.Compiled
) -> None:
    good = generate(trained.model, _prompt(), 40, speculative="mtp")
    bad = generate(untrained.model, _prompt(), 40, speculative="mtp")
    for result in (good, bad):
        assert len(result.drafted) == len(result.accepted) == 2
        # Every round after the prompt adds its accepted drafts and one token of its own.
        assert len(result.tokens) == result.forwards + sum(result.accepted)
        assert all(a <= d for a, d in zip(result.accepted, result.drafted, strict=True))
        # A draft at position 2 is verified only after one at position 1 was.
        assert result.drafted[1] <= result.drafted[0]
    assert good.acceptance[0] > 0.9 and good.tokens_per_forward > 2
    assert bad.acceptance[0] < 0.5 and bad.tokens_per_forward < good.tokens_per_forward


def test_sampling_is_a_function_of_the_seed(trained: factory.Compiled) -> None:
    model = trained.model
    first = generate(model, _prompt(), 24, temperature=1.5, seed=1)
    assert generate(model, _prompt(), 24, temperature=1.5, seed=1).tokens == first.tokens
    assert generate(model, _prompt(), 24, temperature=1.5, seed=2).tokens != first.tokens
    drafted = generate(model, _prompt(), 24, temperature=1.5, seed=1, speculative="mtp")
    again = generate(model, _prompt(), 24, temperature=1.5, seed=1, speculative="mtp")
    assert drafted.tokens == again.tokens and drafted.accepted == again.accepted
    # Near zero temperature speculative sampling accepts exactly what greedy would choose.
    cold = generate(model, _prompt(), 24, temperature=1e-4, seed=3, speculative="mtp")
    assert cold.tokens == generate(model, _prompt(), 24).tokens


def test_end_of_sequence_stops_both_paths(trained: factory.Compiled) -> None:
    continuation = _prompt(44)[12:]
    eos = continuation[9]
    expected = continuation[: continuation.index(eos) + 1]
    for speculative in (None, "mtp"):
        result = generate(trained.model, _prompt(), 30, eos_token_id=eos, speculative=speculative)
        assert result.tokens == expected and result.stopped == "eos"


def test_bad_requests_name_their_argument(untrained: factory.Compiled) -> None:
    no_mtp = factory.compile(tiny_blueprint(**{"model.mtp": DELETE}), seed=1).model
    capacity = tiny_blueprint(**{"model.moe.capacity_factor": 1.0})
    dropping = factory.compile(capacity, seed=1).model
    cases = [
        (no_mtp, {"speculative": "mtp"}, "speculative", "no MTP heads"),
        (untrained.model, {"speculative": "medusa"}, "speculative", "not one of"),
        (untrained.model, {"max_new_tokens": 0}, "max_new_tokens", "at least 1"),
        (untrained.model, {"temperature": -1.0}, "temperature", "0 (greedy) or more"),
        (untrained.model, {"prompt_ids": []}, "prompt", "no tokens"),
        (untrained.model, {"prompt_ids": [500]}, "prompt", "outside the vocabulary"),
        (dropping, {}, "model", "capacity factor"),
    ]
    # A layer type whose mixer has no decoding step (here: a stand-in module) is named.
    stepless = factory.compile(tiny_blueprint(), seed=1).model
    stepless.backbone.layers[3].mixer = torch.nn.Identity()
    cases.append((stepless, {}, "model", "backbone.layers.3: its mixer (Identity) has no"))
    for model, change, option, words in cases:
        arguments = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, **change}
        with pytest.raises(GenerationRefused, match=re.escape(words)) as refused:
            generate(model, **arguments)
        assert refused.value.option == option
