"""Data parallelism with FSDP2: ``fully_shard`` per block, or ``replicate`` (DDP) per block.

With ``parallelism.distributed_optimizer`` (the default) every block, the
embedding and head are sharded over the data-parallel ranks with FSDP2
(``fully_shard``): parameters, gradients and Adam states each live on one DP
rank (ZeRO-3), gathered block by block for compute. Without it the blocks are
replicated (FSDP2's ``replicate``, i.e. DDP: gradients all-reduced, every rank
holding everything).

Routed experts shard over the expert-data-parallel group (EDP), not DP: under
MoE parallel folding their replicas are the ranks of the expert grid that hold
the same experts. Each MoE's experts get their own ``fully_shard`` on the EDP
mesh before their block is wrapped, so the block's DP sharding leaves them
alone.

Gradients are *summed* over replicas, never averaged (divide factor 1): the
loss on each rank is already weighted by its share of the global batch's
target tokens (``factory.runtime.step``), so the sum is the gradient of the
whole batch's loss, as on one process. The aux-loss-free expert bias moves by
a rule, not a gradient; it stays a plain tensor on every rank, updated from the
all-reduced loads, and FSDP ignores it.

Mixed precision: on CUDA the blocks compute in BF16 with FP32 gradient
reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), the
precision policy's compute type outside the quantized GEMMs; the sharded
parameters stay FP32 (they are the optimizer's masters). On CPU everything
stays FP32, as the single-process CPU run does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from factory.graph.hybrid_lm import held_submodule
from factory.layers.model_spec import model_spec

__all__ = [
    "apply_data_parallel",
    "mixed_precision_policy",
    "routed_expert_modules",
    "unsharded_params",
]


def mixed_precision_policy(device_type: str) -> MixedPrecisionPolicy:
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def unsharded_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters no data-parallel wrapper may touch: the spec's untrained ones (the expert
    biases, moved by a rule)."""
    return {
        module._parameters[tensor.name.rpartition(".")[2]]
        for tensor in model_spec(model.cfg).tensors()
        if not tensor.trainable and (module := held_submodule(model, tensor.module)) is not None
    }


def routed_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding routed experts' stacked weights (the spec's expert tensors), which
    the expert-data-parallel group shards apart from the rest."""
    paths = dict.fromkeys(
        t.module for t in model_spec(model.cfg).tensors() if t.expert_dim is not None
    )
    return [module for path in paths if (module := held_submodule(model, path)) is not None]


def _wrap(
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh,
    shard: bool,
    policy: MixedPrecisionPolicy,
    ignored: set[nn.Parameter],
) -> None:
    if shard:
        fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    else:
        replicate(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def _units(model: nn.Module) -> Iterable[nn.Module]:
    """What is gathered block by block: each main-stack block on this rank (a pipeline stage
    keeps only its own). MTP stays with the root unit (gathered with the embedding and head it
    uses): its forward takes the caller's routing accumulators, which a wrapper would copy."""
    with contextlib.suppress(AttributeError):
        yield from model.get_submodule("backbone.layers").children()


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    edp_mesh: DeviceMesh,
    shard: bool = True,
    device_type: str = "cpu",
) -> None:
    """Wrap ``model`` (after tensor and expert parallelism are applied) for data parallelism:
    experts over ``edp_mesh``, then each block and the root over ``dp_mesh``."""
    policy = mixed_precision_policy(device_type)
    ignored = unsharded_params(model)
    experts = routed_expert_modules(model)
    if edp_mesh.size() > 1:
        for module in experts:
            _wrap(module, edp_mesh, shard, policy, ignored)
    experts_alone = {p for module in experts for p in module.parameters()}
    if edp_mesh.size() == 1:
        ignored = ignored | experts_alone  # one replica: nothing to reduce
    for unit in _units(model):
        _wrap(unit, dp_mesh, shard, policy, ignored)
    _wrap(model, dp_mesh, shard, policy, ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling.
            module.set_force_sum_reduction_for_comms(True)
