"""Parameter initialisation, read from the model spec's per-tensor rules.

Linear, embedding, router and expert weights draw from N(0, std). Weights that
write into the residual stream (the layer types mark them ``scaled_normal``)
use std / sqrt(2 * layers), Megatron's scaled init, so the residual variance
does not grow with depth. Norm weights are 1, biases 0, the expert bias 0, and
the Mamba SSM parameters follow Mamba-2's own rule.

Each tensor draws from its own generator, seeded by the run's seed and the
tensor's name, and each routed expert of a stacked expert tensor from its own,
seeded by the name and the expert's index: a tensor's initial value does not
depend on the order modules were built in, on which other tensors exist, or on
how the model will be sharded, and a rank that holds some experts draws only
those (``factory.distributed.materialize``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from factory.layers.model_spec import ModelSpec
from factory.spec.tensors import TensorSpec

__all__ = ["expert_initial_value", "initial_value", "initialize"]

Shape = tuple[int, ...]
Rule = Callable[[TensorSpec, Shape, torch.Generator, float], torch.Tensor]


def _normal(spec: TensorSpec, shape: Shape, gen: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen).mul_(std)


def _conv_uniform(spec: TensorSpec, shape: Shape, gen: torch.Generator, std: float) -> torch.Tensor:
    """PyTorch's default conv init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = 1 x kernel for
    a depthwise conv (the bias rule carries the kernel width)."""
    fan_in = int(spec.init.args[0]) if spec.init.args else shape[1] * shape[2]
    bound = 1 / math.sqrt(fan_in)
    return torch.rand(shape, generator=gen) * 2 * bound - bound


def _dt_bias(spec: TensorSpec, shape: Shape, gen: torch.Generator, std: float) -> torch.Tensor:
    """dt log-uniform in [dt_min, dt_max] (floored), stored through the inverse softplus so
    that softplus(dt_bias) = dt."""
    dt_min, dt_max, floor = spec.init.args
    u = torch.rand(shape, generator=gen)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


_RULES: dict[str, Rule] = {
    "normal": _normal,
    "scaled_normal": _normal,  # std already scaled by the caller
    "zeros": lambda spec, shape, gen, std: torch.zeros(shape),
    "ones": lambda spec, shape, gen, std: torch.ones(shape),
    "conv_uniform": _conv_uniform,
    "a_log": lambda spec, shape, gen, std: torch.log(torch.arange(1, shape[0] + 1).float()),
    "dt_bias": _dt_bias,
}


def _seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


def _draw(
    spec: TensorSpec, shape: Shape, key: str, seed: int, std: float, layers: int
) -> torch.Tensor:
    rule = _RULES.get(spec.init.kind)
    if rule is None:
        raise ValueError(f"{spec.name}: unknown init rule {spec.init.kind!r}")
    if spec.init.kind == "scaled_normal":
        std = std / math.sqrt(2 * max(layers, 1))
    return rule(spec, shape, torch.Generator().manual_seed(_seed(seed, key)), std)


def initial_value(spec: TensorSpec, seed: int, std: float, layers: int) -> torch.Tensor:
    """The fp32 initial value of one tensor (drawn on the CPU: the same on any device); a
    stacked expert tensor is its experts' :func:`expert_initial_value`, stacked."""
    if spec.expert_dim is None:
        return _draw(spec, spec.shape, spec.name, seed, std, layers)
    count = spec.shape[spec.expert_dim]
    experts = [expert_initial_value(spec, seed, std, layers, e) for e in range(count)]
    return torch.stack(experts, spec.expert_dim)


def expert_initial_value(
    spec: TensorSpec, seed: int, std: float, layers: int, expert: int
) -> torch.Tensor:
    """One routed expert's matrix of the stacked expert tensor ``spec``, from its own generator
    (seeded by the tensor's name and ``expert``)."""
    assert spec.expert_dim is not None
    shape = spec.shape[: spec.expert_dim] + spec.shape[spec.expert_dim + 1 :]
    return _draw(spec, shape, f"{spec.name}.{expert}", seed, std, layers)


@torch.no_grad()
def initialize(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Set every tensor of ``model`` to its spec's initial value."""
    std, layers = spec.model.init.std, spec.layer_count()
    state = model.state_dict(keep_vars=True)
    for tensor in spec.tensors():
        if tensor.tied_to is None:
            target = state[tensor.name]
            target.copy_(initial_value(tensor, seed, std, layers).to(target.dtype))
