"""MTP self-speculative decoding: the model's MTP depths draft, its main stack verifies.

After the main stack has decoded positions ..q and chosen token q+1, MTP depth 1 reads the
main stack's hidden state at q and token q+1 and predicts token q+2; depth k reads depth k-1's
output and its draft and predicts token q+k+1 (up to the blueprint's depth). The main stack
then decodes [token q+1, drafts] in one forward, keeps the longest prefix of drafts equal to
its own choices, plus its own next token, and its caches keep those positions
(``DecodingCache.keep``). Greedy output is the same as without speculation; sampled drafts are
accepted with probability min(1, p/q) and a rejection resamples from max(0, p - q), which
keeps the main model's distribution (Leviathan et al., 2023, "Fast inference from transformers
via speculative decoding").

Each MTP depth reads a sequence of its own (depth k at position i reads token i+k+1 and depth
k-1's output at i), so each has its own caches, even where one block is repeated. A depth
caches only positions whose inputs are real tokens; the positions that still need a draft
are decoded each round and taken back (``keep``), so the drafts are exactly what the MTP
heads compute over the text so far and the drafts before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from factory.generation.sampling import TokenChooser
from factory.graph.hybrid_lm import HybridLM
from factory.nn.decoding import DecodingCache

__all__ = ["Drafts", "MTPDrafter", "Verdict", "verify"]


@dataclass
class Drafts:
    """One round's drafts and, when sampling, the distribution each was drawn from."""

    tokens: list[int] = field(default_factory=list)
    probabilities: list[torch.Tensor] = field(default_factory=list)


class MTPDrafter:
    """The MTP depths' caches and the hidden states each still has to read."""

    def __init__(self, model: HybridLM, capacity: int) -> None:
        mtp = model.mtp
        assert mtp is not None
        self.model, self.mtp = model, mtp
        weight = model.backbone.embeddings.weight
        self.caches: list[list[DecodingCache]] = [
            mtp.init_caches(depth, 1, capacity, weight.device, weight.dtype)
            for depth in range(mtp.depth)
        ]
        self.done = [0] * mtp.depth
        """Positions each depth has cached (all read real tokens)."""
        empty = weight.new_zeros(1, 0, weight.shape[1])
        self.pending = [empty] * mtp.depth
        """The hidden states each depth reads at its next cached positions: the previous
        depth's output (the main stack's at depth 1) from ``done[depth]`` on."""

    @property
    def depth(self) -> int:
        return self.mtp.depth

    def main_decoded(self, hidden: torch.Tensor) -> None:
        """The main stack's hidden states [1, T, d] at the positions it has just kept."""
        self.pending[0] = torch.cat([self.pending[0], hidden], dim=1)

    def draft(self, tokens: list[int], count: int, chooser: TokenChooser) -> Drafts:
        """``count`` drafts after ``tokens``, whose last one the main stack has not decoded."""
        last = len(tokens) - 2  # the last position the main stack decoded
        sequence = list(tokens)
        drafts = Drafts()
        previous = self.pending[0][:, :0]  # the previous depth's outputs it did not cache
        for depth in range(count):
            start = self.done[depth]
            hidden = torch.cat([self.pending[depth], previous], dim=1)
            ahead = [sequence[i + depth + 1] for i in range(start, last + 1)]
            ids = torch.tensor([ahead], device=hidden.device)
            out, normed = self.mtp.decode(
                depth, hidden, ids, self.model.backbone.embeddings, self.caches[depth]
            )
            logits = self.model.lm_head(normed[0, -1])
            if chooser.greedy:
                token = int(logits.argmax())
            else:
                probabilities = chooser.probabilities(logits)
                token = chooser.sample(probabilities)
                drafts.probabilities.append(probabilities)
            drafts.tokens.append(token)
            sequence.append(token)
            # Positions up to last - depth read real tokens: cache them; the rest read drafts.
            real = max(last - depth + 1 - start, 0)
            for cache in self.caches[depth]:
                cache.keep(real)
            self.done[depth] += real
            if depth + 1 < self.depth:
                self.pending[depth + 1] = torch.cat([self.pending[depth + 1], out[:, :real]], 1)
            self.pending[depth] = self.pending[depth][:, real:]
            previous = out[:, real:]
        return drafts


@dataclass(frozen=True)
class Verdict:
    """What the main stack made of one round's drafts."""

    accepted: int
    """How many drafts it kept (a prefix)."""
    tokens: list[int]
    """The tokens the round adds: the accepted drafts and the main stack's own next token."""


def verify(logits: torch.Tensor, drafts: Drafts, chooser: TokenChooser) -> Verdict:
    """The main stack's ``logits`` [k+1, V] over [its last token, k drafts] against the
    drafts: greedy keeps drafts equal to its argmax; sampling accepts draft x with probability
    min(1, p(x)/q(x)) and replaces the first rejected one by a draw from max(0, p - q)."""
    kept: list[int] = []
    for i, token in enumerate(drafts.tokens):
        if chooser.greedy:
            choice = int(logits[i].argmax())
            if choice != token:
                return Verdict(i, [*kept, choice])
        else:
            p, q = chooser.probabilities(logits[i]), drafts.probabilities[i]
            if chooser.uniform() >= min(1.0, float(p[token] / q[token])):
                residual = (p - q).clamp(min=0)
                return Verdict(i, [*kept, chooser.sample(residual / residual.sum())])
        kept.append(token)
    return Verdict(len(kept), [*kept, chooser.choose(logits[len(kept)])])
