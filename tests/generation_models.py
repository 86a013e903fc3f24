"""A tiny hybrid model with MTP heads, trained briefly on a deterministic toy language, for the
generation tests: its next token is a fixed permutation of the last one, so greedy choices
have wide margins (no argmax ties between decoding paths) and the MTP heads learn to draft."""

from __future__ import annotations

import copy

import torch
from blueprint_factory import make

import factory
from factory.compilation import Compiled
from factory.schemas import Blueprint

__all__ = ["TINY", "tiny_blueprint", "toy_sequences", "train_tiny"]

TINY = {
    "model.pattern": "M*M-E",
    "model.hidden_size": 64,
    "model.vocab_size": 128,
    "model.attention": {"heads": 4, "kv_heads": 2, "head_dim": 16},
    # transformers clamps dt at time_step_min where we clamp at dt_limit_min: equal clamps.
    "model.mamba": {
        "heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "groups": 2,
        "chunk_size": 16,
        "dt_limit_min": 0.001,
    },
    "model.mlp": {"intermediate_size": 128},
    "model.moe": {
        "num_experts": 4,
        "top_k": 2,
        "expert_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "model.mtp": {"depth": 2, "pattern": "*-"},
}


def tiny_blueprint(**overrides: object) -> Blueprint:
    """TINY with ``overrides`` (dotted paths, as ``make`` takes them)."""
    # A copy: make() places TINY's section dicts in the blueprint and sets dotted keys in them.
    merged = {**TINY, **overrides}
    return make(**{k: copy.deepcopy(v) if isinstance(v, dict) else v for k, v in merged.items()})


def toy_sequences(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] token rows where each token is ``permutation[previous]``."""
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    start = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(seed))
    rows = [start]
    for _ in range(length - 1):
        rows.append(permutation[rows[-1]])
    return torch.stack(rows, dim=1)


def train_tiny(bp: Blueprint, steps: int = 60, seed: int = 3) -> Compiled:
    """``bp``'s model trained ``steps`` AdamW steps on the toy language, main and MTP losses."""
    torch.manual_seed(seed)
    compiled = factory.compile(bp, seed=seed)
    model = compiled.model
    vocab = bp.model.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        ids = toy_sequences(vocab, 4, 40, seed=step)
        out = model(ids)
        loss = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
        for depth, logits in enumerate(out.mtp_logits, start=2):
            loss = loss + torch.nn.functional.cross_entropy(
                logits[:, :-depth].flatten(0, 1), ids[:, depth:].flatten()
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return compiled
