"""The blueprint's AdamW over fp32 master weights, with its state keyed by parameter name.

* AdamW with ``training.optimizer``'s lr, betas, eps and weight decay; weight
  decay on matrices and embeddings only (not on norms, biases or Mamba's
  A/D/dt vectors), as Megatron does. Frozen tensors (the expert bias) are not
  the optimizer's: ``update_expert_biases`` moves them.
* fp32 master weights: parameters in fp32 (the CPU default) are their own
  masters; otherwise an fp32 copy is stepped and copied back after each step.

* ``training.average``: an exponential moving average of the fp32 masters, one
  fp32 tensor per master of its shape and placement (so sharded as the optimizer
  state is), updated after each step by :meth:`MasterOptimizer.update_average`;
  it only reads the masters, so training runs bit for bit as without it.

Checkpoints store the optimizer state under parameter names (``state_dict``),
not under PyTorch's positional indices, so that a checkpoint stays readable
when the set of ranks holding the parameters changes. A parameter that tensor
parallelism holds in rank-major order (Mamba's packed projections) has its
moments and master stored in canonical order, as its weights are, so that a
checkpoint resumes at any TP size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from factory.distributed.tensor_parallel import canonical_orders, reordered
from factory.schemas.training import AverageConfig, OptimizerConfig

__all__ = ["MasterOptimizer"]


class MasterOptimizer:
    """AdamW over fp32 masters of a model's trainable parameters."""

    def __init__(
        self, model: nn.Module, config: OptimizerConfig, average: AverageConfig | None = None
    ) -> None:
        named = {}
        for name, param in model.named_parameters():  # tied parameters appear once
            if param.requires_grad:
                named[name] = param
        self.names = list(named)
        self.params = list(named.values())
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
            for p in self.params
        ]
        # One group per (decay, DTensor or not): on CUDA AdamW's foreach kernels take a group
        # at once and refuse DTensors mixed with plain tensors, which FSDP leaves where it
        # ignores parameters (the experts of a single expert-data-parallel replica).
        groups: dict[tuple[bool, bool], list[torch.Tensor]] = {}
        for master in self.masters:
            key = (master.ndim >= 2, hasattr(master, "device_mesh"))
            groups.setdefault(key, []).append(master)
        self.optimizer = torch.optim.AdamW(
            [{"params": params, "weight_decay": config.weight_decay if decay else 0.0}
             for (decay, _), params in sorted(groups.items(), reverse=True)],
            lr=config.lr, betas=config.betas, eps=config.eps,
        )  # fmt: skip
        self.average = average
        self.averages = [torch.zeros_like(m) for m in self.masters] if average else []
        """``training.average``'s moving average of each master (none without it)."""
        self._name_of = {id(m): n for n, m in zip(self.names, self.masters, strict=True)}
        self._rank_major = {n: o for n, o in canonical_orders(model).items() if n in named}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def grads_to_masters(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                param.copy_(master)

    @torch.no_grad()
    def update_average(self, step: int) -> None:
        """Fold the masters after schedule step ``step`` into the moving average: taken as
        they are at ``average.start``, then ``avg = avg * decay + master * (1 - decay)`` (fp32,
        element by element)."""
        config = self.average
        if config is None or step < config.start:
            return
        for average, master in zip(self.averages, self.masters, strict=True):
            if step == config.start:
                average.copy_(master)
            else:
                average.mul_(config.decay).add_(master, alpha=1 - config.decay)

    @torch.no_grad()
    def restart_average(self) -> None:
        """Start the moving average afresh from the masters (a checkpoint written without it)."""
        for average, master in zip(self.averages, self.masters, strict=True):
            average.copy_(master)

    def _own_averages(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.averages, strict=True)) if self.average else {}

    def state_dict(self) -> dict[str, Any]:
        """Adam moments and step per parameter name, plus the fp32 masters of non-fp32
        parameters (the fp32 ones are the model's own tensors), in canonical order."""
        state = {self._name_of[id(m)]: dict(s) for m, s in self.optimizer.state.items() if s}
        own = {"state": state, "masters": self._own_masters()}
        if self.average is not None:
            own["average"] = self._own_averages()
        return self._reorder(own, inverse=True)

    def empty_state_dict(self) -> dict[str, Any]:
        """A state dict of the right shapes to load a checkpoint into (DCP loads in place)."""
        state = {
            name: {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(master),
                "exp_avg_sq": torch.zeros_like(master),
            }
            for name, master in zip(self.names, self.masters, strict=True)
        }
        empty = {"state": state, "masters": self._own_masters()}
        if self.average is not None:
            empty["average"] = {n: torch.zeros_like(a) for n, a in self._own_averages().items()}
        return empty

    @torch.no_grad()
    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        """Install a state dict from :meth:`empty_state_dict` after DCP filled it."""
        loaded = self._reorder(loaded, inverse=False)
        by_name = dict(zip(self.names, self.masters, strict=True))
        for name, master in loaded["masters"].items():
            by_name[name].copy_(master)
        averages = self._own_averages()
        for name, average in loaded.get("average", {}).items():
            averages[name].copy_(average)
        for name, entry in loaded["state"].items():
            self.optimizer.state[by_name[name]] = {k: v.clone() for k, v in entry.items()}
        for param, master in zip(self.params, self.masters, strict=True):
            if master is not param:
                param.copy_(master)

    def _own_masters(self) -> dict[str, torch.Tensor]:
        return {
            n: m
            for n, m, p in zip(self.names, self.masters, self.params, strict=True)
            if m is not p
        }

    def _reorder(self, state_dict: dict[str, Any], inverse: bool) -> dict[str, Any]:
        """``state_dict`` with each rank-major parameter's tensors reordered: to canonical order
        (``inverse``) or back to the parameter's. Collective over tensor parallelism."""
        if not self._rank_major:
            return state_dict
        state = {name: dict(entry) for name, entry in state_dict["state"].items()}
        by_name = {
            part: dict(state_dict[part]) for part in ("masters", "average") if part in state_dict
        }
        for name, (dim, order) in self._rank_major.items():
            index = order.argsort() if inverse else order
            entries = [(state[name], key) for key in state.get(name, {})]
            for holder, key in [*entries, *((tensors, name) for tensors in by_name.values())]:
                value = holder.get(key)
                if value is not None and value.ndim > dim:  # not Adam's step count
                    holder[key] = reordered(value, value, dim, index)
        return {"state": state, **by_name}
