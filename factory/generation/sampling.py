"""How the next token is chosen from logits: greedy (argmax) or sampled at a temperature from a
seeded generator, so a seed always gives the same text."""

from __future__ import annotations

import torch

__all__ = ["TokenChooser"]


class TokenChooser:
    """Greedy at ``temperature`` 0, else sampling from softmax(logits / temperature) with a
    ``torch.Generator`` seeded by ``seed`` (on the CPU: the same draws on every device)."""

    def __init__(self, temperature: float, seed: int) -> None:
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits / temperature) in fp32 on the CPU, over the last dimension."""
        return torch.softmax(logits.detach().float().cpu() / self.temperature, dim=-1)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one position's logits [V]."""
        if self.greedy:
            return int(logits.argmax())
        return self.sample(self.probabilities(logits))

    def sample(self, probabilities: torch.Tensor) -> int:
        """One draw from ``probabilities`` [V]."""
        return int(torch.multinomial(probabilities, 1, generator=self.generator))

    def uniform(self) -> float:
        """One draw from U[0, 1) (speculative sampling's acceptance test)."""
        return float(torch.rand((), generator=self.generator))
