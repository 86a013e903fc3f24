"""The global gradient norm's inputs and clipping, for one process or many.

The norm itself is the ranks' question (``factory.runtime.ranks.Ranks.grad_norm``): each
shard counted once whatever holds it. Which gradients a rank contributes, and how they are
scaled once the norm is known, is here.
"""

from __future__ import annotations

from torch import nn

from factory.runtime.optimizer import MasterOptimizer

__all__ = ["clip_to_norm", "norm_masters"]


def norm_masters(model: nn.Module, optimizer: MasterOptimizer) -> list[nn.Parameter]:
    """The masters whose gradients make up this rank's part of the global norm: all of them,
    except what the model says another rank counts (a pipeline's last stage leaves out its
    copy of the embedding, which the first stage counts)."""
    excluded_from = getattr(model, "excluded_from_norm", None)
    if excluded_from is None:
        return optimizer.masters
    excluded = excluded_from()
    pairs = zip(optimizer.names, optimizer.masters, strict=True)
    return [master for name, master in pairs if name not in excluded]


def clip_to_norm(params: list[nn.Parameter], cap: float, norm: float) -> None:
    """Scale the gradients to norm ``cap`` when ``norm`` is above it (torch's rule, with a norm
    that may come from several ranks)."""
    coef = min(1.0, cap / (norm + 1e-6))
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
