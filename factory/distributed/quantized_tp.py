"""Quantized linears under tensor parallelism, quantizing as one process does.

``factory.distributed.tensor_parallel`` gives a split ``QuantizedLinear`` the same
DTensor style as a plain linear (column, row, or held whole with its own KV
columns), wrapped by :class:`LocalQuantizedGemm`: inside the style's layouts the
module runs on this rank's local tensors, with a
:class:`~factory.precision.splits.GemmSplit` saying which GEMM dimension the rank
holds a part of (column: the output features, row: the input features, at the
rank-major positions of the spec's segments). Its quantizer then reduces each
split operand's amax over the group and draws stochastic-rounding numbers in one
process's order (``factory.precision.splits``), so a rank's codes and scales are
one process's for the same elements, provided each share is whole blocks
(:func:`quantized_split_problems`; ``docs/distributed.md``).

Inside a routing mixer the tokens are split too: the shared expert gathers every
rank's tokens rank-major, and the modules that run on local views (LatentMoE's
projections) see this rank's tokens. :func:`track_token_positions` records their
one-process positions on every forward. Routed experts are not covered: each TP
rank routes its own tokens to whole experts, so their GEMMs quantize per rank, as
under data parallelism.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from factory.graph.hybrid_lm import held_submodule
from factory.precision.qlinear import QuantizedLinear
from factory.precision.splits import Axis, GemmSplit
from factory.spec.tensors import TensorSpec

__all__ = [
    "LocalQuantizedGemm",
    "local_quantized_gemm",
    "quantized_split_problems",
    "track_token_positions",
]


def quantized_split_problems(model: nn.Module, split: list[TensorSpec], tp: int) -> list[str]:
    """Why ``tp`` cannot split ``model``'s quantized linears among the ``split`` tensors as one
    process quantizes them: a rank's share of each split segment must be whole blocks of its
    recipe; and a split linear must be an emulated ``QuantizedLinear`` or a plain one
    (Transformer Engine's are not DTensor-aware). The rule ``precision.tp_blocks`` says the
    same before launch."""
    problems = []
    for t in split:
        module = held_submodule(model, t.module)
        if module is None or t.gemm is None or t.tp is None:
            continue
        if not isinstance(module, nn.Linear):
            problems.append(f"{t.module} is a {type(module).__name__}: tensor parallelism splits "
                            "nn.Linear and the emulated QuantizedLinear (precision 'emulate'), "
                            "not Transformer Engine's linears")  # fmt: skip
            continue
        if not isinstance(module, QuantizedLinear):
            continue
        block, recipe = module.quantizer.split_block, module.quantizer.recipe
        for width in t.tp.segments or (t.shape[t.tp.dim],):
            if width % tp == 0 and (width // tp) % block:
                problems.append(
                    f"{t.name}: its {t.tp.kind} split gives each of tp={tp} ranks {width // tp} "
                    f"of {width}, not a multiple of {recipe}'s {block}-element blocks"
                )
    return problems


def local_quantized_gemm(
    outer: ParallelStyle, module: QuantizedLinear, mesh: DeviceMesh, positions: torch.Tensor
) -> LocalQuantizedGemm:
    """``outer`` (the style a plain linear would get) run on local tensors. The weight is
    already a DTensor: its placement says which dimension this rank holds a part of, at
    ``positions`` (the one-process index of each of its rows or columns along it)."""
    weight = module._parameters["weight"]
    placement, group = weight.placements[0], mesh.get_group()
    if not isinstance(placement, Shard):  # KV heads fewer than ranks: every rank computes it all
        return LocalQuantizedGemm(outer, GemmSplit(), Replicate(), Replicate())
    axis = Axis(weight.shape[placement.dim], positions)
    if placement.dim == 0:  # column: this rank's output features of the whole input
        return LocalQuantizedGemm(outer, GemmSplit(group, out_features=axis), Shard(-1), Partial())
    # row: this rank's input features; the outputs are partial sums
    return LocalQuantizedGemm(outer, GemmSplit(group, in_features=axis), Partial(), Shard(-1))


class LocalQuantizedGemm(ParallelStyle):
    """``outer``'s input and output layouts around a ``QuantizedLinear`` that runs on plain
    tensors: its DTensor input becomes the local tensor (whose gradient has ``input_grad``
    placement), its parameters are shadowed by their local tensors for the forward, and
    its local output becomes a DTensor of ``output`` placement for ``outer`` to lay out.
    A row linear's bias is added to the summed output, once."""

    def __init__(
        self, outer: ParallelStyle, split: GemmSplit, output: Placement, input_grad: Placement
    ) -> None:
        super().__init__()
        self.outer, self.split, self.output, self.input_grad = outer, split, output, input_grad

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, QuantizedLinear)
        module = self.outer._apply(module, device_mesh)
        module.split = self.split
        # After outer's input hook and before its output hook: they see DTensors.
        module.register_forward_pre_hook(self._localize)
        distribute = partial(self._distribute, device_mesh)
        module.register_forward_hook(distribute, prepend=True, always_call=True)
        return module

    def _localize(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        # Read at call time: FSDP2 swaps its unsharded parameters in before the forward. An
        # instance attribute wins over nn.Module's parameter lookup (as in _LocalViews).
        for name, param in module._parameters.items():
            if param is not None:
                local = None if name == "bias" and self._bias_after else param.to_local()
                module.__dict__[name] = local
        return (x.to_local(grad_placements=(_normalized(self.input_grad, x.ndim),)), *rest)

    def _distribute(
        self, mesh: DeviceMesh, module: nn.Module, args: Any, output: torch.Tensor
    ) -> DTensor:
        for name in list(module._parameters):
            module.__dict__.pop(name, None)
        placement = _normalized(self.output, output.ndim)
        out = DTensor.from_local(output, mesh, (placement,), run_check=False)
        bias = module._parameters.get("bias")
        return out + bias if self._bias_after and bias is not None else out

    @property
    def _bias_after(self) -> bool:
        return self.output.is_partial()


def _normalized(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` as DTensor takes it: counted from the front."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def track_token_positions(mixer: nn.Module, gathered: list[nn.Module], mesh: DeviceMesh) -> None:
    """Give the quantized linears in a routing ``mixer`` the one-process positions of the
    tokens they see, on every forward: the mixer's input is this rank's ``[B, S/tp, d]`` share
    of the sequence, flattened; a linear inside one of the ``gathered`` token MLPs sees every
    rank's share, rank-major. Raises ValueError where a share is not whole blocks."""
    inside = {id(m) for parent in gathered for m in parent.modules()}
    linears = [(m, id(m) in inside) for m in mixer.modules() if isinstance(m, QuantizedLinear)]
    if linears:
        group = mesh.get_group()
        hook = partial(_observe_tokens, linears, group, mesh.size(), mesh.get_local_rank())
        mixer.register_forward_pre_hook(hook)


def _observe_tokens(
    linears: list[tuple[QuantizedLinear, bool]],
    group: dist.ProcessGroup,
    tp: int,
    rank: int,
    mixer: nn.Module,
    args: tuple[Any, ...],
) -> None:
    """The routing mixer's forward pre-hook: ``args[0]`` is this rank's ``[B, S/tp, d]``."""
    batch, local = args[0].shape[:2]
    sequence = local * tp
    starts = torch.arange(batch)[:, None] * sequence + torch.arange(local)[None, :]
    shares = [(starts + r * local).reshape(-1) for r in range(tp)]  # rank r's tokens, in order
    every = torch.cat(shares)
    for linear, gathered in linears:
        block = linear.quantizer.split_block
        if local % block:
            raise ValueError(
                f"sequence parallel gives each of tp={tp} ranks {local} tokens of each sequence; "
                f"{linear.quantizer.recipe} quantizes tokens in blocks of {block}: make seq_len a "
                f"multiple of {tp * block}"
            )
        axis = Axis(batch * sequence, every if gathered else shares[rank])
        linear.split = dataclasses.replace(linear.split, group=group, tokens=axis)
