"""``generate``: decode new tokens after a prompt, one forward per token or, with MTP
self-speculation, several.

The prompt is one forward of the main stack through the layers' decoding caches
(``factory.nn.decoding``); each further token is a forward of one position (plain) or of
1 + drafts positions (``speculative="mtp"``, :mod:`factory.generation.speculative`). One
prompt at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from factory.generation.sampling import TokenChooser
from factory.generation.speculative import Drafts, MTPDrafter, verify
from factory.graph.hybrid_lm import HybridLM

__all__ = ["SPECULATIVE", "GenerationRefused", "GenerationResult", "generate"]

SPECULATIVE = ("mtp",)
"""The kinds of speculative decoding ``generate`` runs."""


class GenerationRefused(ValueError):
    """A generation that cannot run as asked; ``option`` names the argument at fault."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    """The new tokens (the prompt not included)."""
    forwards: int
    """Forwards of the main stack, the prompt's included."""
    drafted: tuple[int, ...] = ()
    """Per draft position (MTP depth), how many drafts the main stack verified."""
    accepted: tuple[int, ...] = ()
    """Per draft position, how many of them it accepted."""
    stopped: Literal["length", "eos"] = "length"
    """Why generation ended: ``max_new_tokens`` reached, or the end-of-sequence token."""

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per main-stack forward: 1 without speculation."""
        return len(self.tokens) / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> tuple[float, ...]:
        """Per draft position, the share of its drafts accepted (0 where none was verified)."""
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=True))


def generate(
    model: HybridLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    speculative: str | None = None,
    eos_token_id: int | None = None,
) -> GenerationResult:
    """Up to ``max_new_tokens`` tokens after ``prompt_ids`` (one prompt), greedy at
    ``temperature`` 0, else sampled from a generator seeded by ``seed``; stops after
    ``eos_token_id``. ``speculative="mtp"`` drafts with the model's MTP heads: the same text
    when greedy, the same distribution when sampled. Raises :class:`GenerationRefused`."""
    prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    _check(model, prompt, max_new_tokens, temperature, speculative)
    chooser = TokenChooser(temperature, seed)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if speculative is None:
                return _plain(model, prompt, max_new_tokens, chooser, eos_token_id)
            return _speculative(model, prompt, max_new_tokens, chooser, eos_token_id)
    finally:
        model.train(training)


def _check(
    model: HybridLM,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    speculative: str | None,
) -> None:
    vocab = model.cfg.vocab_size
    if not prompt:
        raise GenerationRefused("prompt", "the prompt has no tokens")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise GenerationRefused(
            "prompt", f"a prompt token is outside the vocabulary (0..{vocab - 1})"
        )
    if max_new_tokens < 1:
        raise GenerationRefused("max_new_tokens", f"must be at least 1, not {max_new_tokens}")
    if not temperature >= 0.0:
        raise GenerationRefused("temperature", f"must be 0 (greedy) or more, not {temperature}")
    if speculative is not None and speculative not in SPECULATIVE:
        raise GenerationRefused(
            "speculative", f"{speculative!r} is not one of {', '.join(SPECULATIVE)}"
        )
    if speculative == "mtp" and model.mtp is None:
        raise GenerationRefused(
            "speculative", "the model has no MTP heads to draft with (model.mtp.depth is 0)"
        )
    problems = model.decoding_problems(with_mtp=speculative is not None)
    if problems:
        raise GenerationRefused(
            "model", "the model cannot decode incrementally: " + "; ".join(problems)
        )


def _stop(tokens: list[int], eos_token_id: int | None) -> int | None:
    """The length ``tokens`` keeps when it holds the end-of-sequence token (None: it does not)."""
    if eos_token_id is None or eos_token_id not in tokens:
        return None
    return tokens.index(eos_token_id) + 1


def _plain(
    model: HybridLM,
    prompt: list[int],
    max_new_tokens: int,
    chooser: TokenChooser,
    eos_token_id: int | None,
) -> GenerationResult:
    device = model.lm_head.weight.device
    caches = model.init_caches(1, len(prompt) + max_new_tokens)
    logits = model.decode(torch.tensor([prompt], device=device), caches).logits
    tokens = [chooser.choose(logits[0, -1])]
    forwards = 1
    while len(tokens) < max_new_tokens and _stop(tokens, eos_token_id) is None:
        logits = model.decode(torch.tensor([[tokens[-1]]], device=device), caches).logits
        forwards += 1
        tokens.append(chooser.choose(logits[0, -1]))
    return GenerationResult(tokens, forwards, stopped=_reason(tokens, eos_token_id))


def _reason(tokens: list[int], eos_token_id: int | None) -> Literal["length", "eos"]:
    return "eos" if _stop(tokens, eos_token_id) is not None else "length"


def _speculative(
    model: HybridLM,
    prompt: list[int],
    max_new_tokens: int,
    chooser: TokenChooser,
    eos_token_id: int | None,
) -> GenerationResult:
    device = model.lm_head.weight.device
    drafter = MTPDrafter(model, len(prompt) + max_new_tokens + 1)
    caches = model.init_caches(1, len(prompt) + max_new_tokens + drafter.depth + 1)
    step = model.decode(torch.tensor([prompt], device=device), caches)
    drafter.main_decoded(step.hidden)
    tokens = [chooser.choose(step.logits[0, -1])]
    forwards = 1
    drafted, accepted = [0] * drafter.depth, [0] * drafter.depth
    while len(tokens) < max_new_tokens and _stop(tokens, eos_token_id) is None:
        # A round adds its accepted drafts and one token of the main stack's own.
        count = min(drafter.depth, max_new_tokens - len(tokens) - 1)
        drafts = drafter.draft(prompt + tokens, count, chooser) if count else Drafts()
        ids = torch.tensor([[tokens[-1], *drafts.tokens]], device=device)
        step = model.decode(ids, caches)
        forwards += 1
        verdict = verify(step.logits[0], drafts, chooser)
        for position in range(count):
            drafted[position] += 1
            accepted[position] += position < verdict.accepted
        kept = verdict.accepted + 1  # the last token and the accepted drafts
        for cache in caches:
            cache.keep(kept)
        drafter.main_decoded(step.hidden[:, :kept])
        tokens.extend(verdict.tokens)
    end = _stop(tokens, eos_token_id)
    tokens = tokens if end is None else tokens[:end]
    return GenerationResult(
        tokens, forwards, tuple(drafted), tuple(accepted), _reason(tokens, eos_token_id)
    )
