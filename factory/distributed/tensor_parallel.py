"""Tensor and sequence parallelism of a HybridLM, planned from the model spec's split rules.

Each parameter is placed by its spec :class:`~factory.spec.tensors.Split`: split,
a ``Shard(dim)`` DTensor over the TP mesh; else a ``Replicate()`` one. Routed
experts are left to the expert grid (``parallelize.apply_expert_parallel``: EP and
ETP; with ETP = 1 each TP rank routes its own tokens to whole experts, so their
gradients are partial sums for the expert-data-parallel group ``edp``, which holds
the TP ranks, to reduce: FSDP over edp), and the untrained expert bias stays a
plain tensor (``update_expert_biases`` adds to it in place).

- A dense mixer (attention, Mamba, MLP) gets the block's normed input gathered on
  every rank; its column (and Mamba's head-split) linears compute this rank's heads
  or features, its row linear sums the ranks' parts into the residual stream
  (Megatron's f and g: all-reduce, or reduce-scatter along the sequence with SP).
- Mamba's in_proj packs [z, x, B, C, dt] and conv1d [x, B, C], each segment split on
  its own: a rank's local tensor is its chunk of every segment, so the DTensor's
  global view is rank-major. State-dict hooks show the canonical (Hugging Face)
  order, so checkpoints load at any TP size; they gather the tensor, which makes
  ``state_dict()`` and ``load_state_dict()`` collective over TP (as DCP calls them).
- With fewer KV heads than ranks every rank holds them all and keeps the one its
  query heads read (Megatron replicates KV heads when TP exceeds the groups).
- The embedding is vocab-parallel; the head column-parallel, logits gathered.
- Sequence parallelism shards the residual stream between blocks ``Shard(1)``
  (``ModelOutput.hidden`` and ``residual_rms`` are this rank's share). MoE needs it:
  it routes the rank's own tokens (aux loss and capacity per rank); the shared
  expert gathers the tokens and runs TP-split; routing counts are summed over TP so
  the expert bias moves alike on every TP rank.
- Modules that run on plain tensors (norms, Mamba's conv, SSM vectors and gated
  norm, the router, LatentMoE's projections) read local views of their parameters
  during their forward. A replicated one that sees only this rank's tokens gets a
  ``Partial`` gradient, summed by FSDP2 or :func:`reduce_partial_gradients`.

- A quantized linear (the emulated precision policy) gets a plain linear's style, run on
  local tensors with its quantizer told which GEMM dimension is split, so that it
  quantizes as one process does (``factory.distributed.quantized_tp``).

Call :func:`apply_tensor_parallel` on every TP rank holding the same full weights
(``factory.compile``, one seed), before expert and data parallelism
(``factory.distributed.parallelize``).
"""

from __future__ import annotations

import itertools
import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from factory.checks.runtime_rules import sequence_parallel_problem
from factory.distributed.quantized_tp import (
    local_quantized_gemm,
    quantized_split_problems,
    track_token_positions,
)
from factory.graph.hybrid_lm import held_submodule
from factory.layers.model_spec import model_spec
from factory.nn.outputs import RoutedOutput
from factory.precision.qlinear import QuantizedLinear
from factory.spec.tensors import Role, TensorSpec

__all__ = [
    "apply_tensor_parallel",
    "canonical_order",
    "canonical_orders",
    "check_tensor_parallel",
    "reduce_partial_gradients",
    "reordered",
]


def check_tensor_parallel(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError, naming the numbers, unless ``tp`` splits ``model`` evenly.

    ``model`` is a HybridLM or a pipeline stage of one (anything with its ``cfg``
    holding blocks under the full model's names). The sequence length is checked
    on each forward pass under SP.
    """
    spec = model_spec(model.cfg)
    problems, whole = [], set()
    for layer in spec.layers:
        problems += layer.type.tp_rules(model.cfg, tp)
        names = layer.type.tp_whole_linears(model.cfg, tp)
        whole |= {f"{layer.prefix}.mixer.{name}" for name in names}
    sp_problem = sequence_parallel_problem(model.cfg, tp, sequence_parallel)
    if sp_problem is not None:
        problems.append(sp_problem)
    split = [
        t for t in spec.tensors()
        if t.tp is not None and t.expert_dim is None and t.module not in whole
    ]  # fmt: skip
    for t in split:
        assert t.tp is not None
        problems += [
            f"{t.name}: its {t.tp.kind} split of width {width} (dim {t.tp.dim}) is not "
            f"divisible by tp={tp}"
            for width in t.tp.segments or (t.shape[t.tp.dim],)
            if width % tp
        ]
    problems += quantized_split_problems(model, split, tp)
    if problems:
        raise ValueError(
            f"cannot split the model over tp={tp}: " + "; ".join(dict.fromkeys(problems))
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split ``model`` (a HybridLM or a pipeline stage of one) over the 1-D ``tp_mesh`` in place.

    Parameters become DTensors (module docstring); each mixer's heads become this rank's
    share, as its layer type's ``localize_for_tp`` says.
    With one rank nothing changes.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return
    check_tensor_parallel(model, tp, sequence_parallel)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model already has DTensor parameters: apply tensor parallelism once")
    kv_columns = _split_heads(model, tp, tp_mesh.get_local_rank())
    tensors = [
        (t, m)
        for t in model_spec(model.cfg).tensors()
        if (m := held_submodule(model, t.module)) is not None
    ]
    ties = _distribute(tensors, tp_mesh, kv_columns)
    _plan(model, tensors, tp_mesh, sequence_parallel, kv_columns)
    for (module, name), (source, source_name) in ties.items():
        # The styles re-wrap parameters, so tied ones (a tied head) are re-tied last.
        module.register_parameter(name, source._parameters[source_name])
    if (
        sequence_parallel
        and (embeddings := held_submodule(model, "backbone.embeddings")) is not None
    ):

        def check_length(module: nn.Module, args: tuple[Any, ...]) -> None:
            if (length := args[0].shape[1]) % tp:
                raise ValueError(f"sequence parallel splits the sequence over tp={tp}: its "
                                 f"length {length} is not divisible")  # fmt: skip

        embeddings.register_forward_pre_hook(check_length)


@torch.no_grad()
def reduce_partial_gradients(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placement: sums the ``Partial`` gradients
    over TP. FSDP2 does this itself; without it, call it before clipping or stepping."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def _split_heads(model: nn.Module, tp: int, rank: int) -> dict[int, tuple[int, int]]:
    """Give every mixer this rank's share of its heads (its layer type knows how); return, for
    the column linears every rank holds whole, the (start, width) of the columns it keeps."""
    kept_columns = {}
    for layer in model_spec(model.cfg).layers:
        if (block := held_submodule(model, layer.prefix)) is not None:
            kept = layer.type.localize_for_tp(block.mixer, tp, rank)
            kept_columns |= {id(block.mixer.get_submodule(n)): cols for n, cols in kept.items()}
    return kept_columns


def _distribute(
    tensors: list[tuple[TensorSpec, nn.Module]],
    mesh: DeviceMesh,
    kv_columns: dict[int, tuple[int, int]],
) -> dict[tuple[nn.Module, str], tuple[nn.Module, str]]:
    """Turn each parameter into its DTensor (local data only: every rank holds the same full
    weights); return the tied parameters as (module, name) -> the (module, name) they share."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    seen: dict[int, tuple[nn.Module, str]] = {}
    ties = {}
    for tensor, module in tensors:
        name = tensor.name.rpartition(".")[2]
        param = module._parameters[name]
        if id(param) in seen:
            ties[(module, name)] = seen[id(param)]
            continue
        seen[id(param)] = (module, name)
        if tensor.expert_dim is not None or not tensor.trainable:
            continue
        local, placement, split = param.detach(), Replicate(), tensor.tp
        if split is not None and id(module) not in kv_columns:
            order = _rank_major(tensor, tp)
            local = local.index_select(split.dim, order.chunk(tp)[rank])
            placement = Shard(split.dim)
            if split.segments:
                _canonical_state_dict(module, name, split.dim, order)
        shared = DTensor.from_local(local, mesh, (placement,), run_check=False)
        module.register_parameter(name, nn.Parameter(shared, requires_grad=param.requires_grad))
    return ties


def _rank_major(tensor: TensorSpec, tp: int) -> torch.Tensor:
    """The one-process index of each element of a split tensor's global (DTensor) order along
    its split dim: rank 0's chunk of every segment, then rank 1's, ..."""
    assert tensor.tp is not None
    widths = tensor.tp.segments or (tensor.shape[tensor.tp.dim],)
    starts = list(itertools.accumulate(widths, initial=0))
    return torch.cat([
        torch.arange(start + r * width // tp, start + (r + 1) * width // tp)
        for r in range(tp) for start, width in zip(starts, widths, strict=False)
    ])  # fmt: skip


def _plan(
    model: nn.Module,
    tensors: list[tuple[TensorSpec, nn.Module]],
    mesh: DeviceMesh,
    sequence_parallel: bool,
    kv_columns: dict[int, tuple[int, int]],
) -> None:
    """Attach each module's runtime style, from its weight's split and where it sits."""
    stream = Shard(1) if sequence_parallel else Replicate()
    mixer_of: dict[int, nn.Module] = {}  # id(module) -> the block mixer that holds it
    dense, routing = [], []
    for layer in model_spec(model.cfg).layers:
        if (block := held_submodule(model, layer.prefix)) is not None:
            experts = any(t.expert_dim is not None for t in layer.tensors)
            (routing if experts else dense).append(block.mixer)
            mixer_of |= {id(m): block.mixer for m in block.mixer.modules()}
    routing_ids = {id(m) for m in routing}
    by_module: dict[int, tuple[nn.Module, list[TensorSpec]]] = {}
    for tensor, module in tensors:
        by_module.setdefault(id(module), (module, []))[1].append(tensor)
    views: dict[int, tuple[nn.Module, list[tuple[nn.Module, str]]]] = {}
    token_mlps: dict[int, nn.Module] = {}
    for module, specs in by_module.values():
        weight, mixer = specs[0], mixer_of.get(id(module))  # weight first: spec.tensors.linear
        in_routing = mixer is not None and id(mixer) in routing_ids
        style = _style(module, weight, mixer, in_routing, stream, kv_columns)
        if style is not None:
            if isinstance(module, QuantizedLinear):
                positions = _rank_major(weight, mesh.size()).chunk(mesh.size())
                style = local_quantized_gemm(style, module, mesh, positions[mesh.get_local_rank()])
            parallelize_module(module, mesh, style)
            if in_routing:
                # A routing mixer runs on this rank's tokens: its split linears form a
                # token-wise MLP that gathers every rank's tokens and returns each its own.
                parent = model.get_submodule(weight.module.rpartition(".")[0])
                if parent is mixer:
                    raise ValueError(f"{weight.name}: no TP rule for a split linear directly "
                                     "in a routing mixer")  # fmt: skip
                token_mlps[id(parent)] = parent
            continue
        owner = mixer if mixer is not None else module
        names = [t.name.rpartition(".")[2] for t in specs]
        params = [(module, n) for n in names if isinstance(module._parameters[n], DTensor)]
        if params:
            views.setdefault(id(owner), (owner, []))[1].extend(params)
    gather = PrepareModuleInput(
        input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)
    )
    for mixer in dense:
        parallelize_module(mixer, mesh, gather)
    tokens = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    for parent in token_mlps.values():
        parallelize_module(parent, mesh, tokens)
    for owner, params in views.values():
        # Norms under SP and everything in a routing mixer see only this rank's tokens.
        local_tokens = id(owner) in routing_ids or (sequence_parallel and id(owner) not in mixer_of)
        parallelize_module(owner, mesh, _LocalViews(params, partial_grads=local_tokens))
        if mixer_of.get(id(owner)) is owner:  # a norm's own views trace; a mixer's do not
            _LOCAL_VIEW_OWNERS.add(owner)
    for mixer in routing:
        mixer.register_forward_hook(partial(_sum_routed_tokens, mesh.get_group()))
        gathered = [p for p in token_mlps.values() if mixer_of.get(id(p)) is mixer]
        track_token_positions(mixer, gathered, mesh)


def _style(
    module: nn.Module,
    weight: TensorSpec,
    mixer: nn.Module | None,
    in_routing: bool,
    stream: Placement,
    kv_columns: dict[int, tuple[int, int]],
) -> ParallelStyle | None:
    """The DTensor style of an embedding or a split linear; None for a module that runs on
    local views of its parameters."""
    split, embedding = weight.tp, weight.role is Role.EMBEDDING
    if not embedding and (split is None or not isinstance(module, nn.Linear)):
        return None
    kinds = (nn.Embedding,) if embedding else (nn.Linear, QuantizedLinear)
    if type(module) not in kinds:
        raise ValueError(f"{weight.module} is a {type(module).__name__}: tensor parallelism "
                         f"splits {' and '.join(k.__name__ for k in kinds)} modules")  # fmt: skip
    column = split is not None and split.kind in ("column", "heads", "vocab")
    if id(module) in kv_columns:
        return _ReplicatedColumns(*kv_columns[id(module)])
    if embedding:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if weight.role is Role.HEAD:
        return ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    if mixer is None and column:  # in the residual stream, e.g. MTP's eh_proj
        return ColwiseParallel(input_layouts=stream, output_layouts=stream)
    if mixer is None or not (column or split.kind == "row"):
        raise ValueError(f"{weight.name}: no tensor-parallel rule for its {split.kind} split here")
    if column:
        return ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(0) if in_routing else stream)


_LOCAL_VIEW_OWNERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()

LOCAL_VIEWS_STAY_EAGER = (
    "its mixer's local parameter views under TP (to_local, read through the module's "
    "__dict__) do not trace: the compiled backward hands a plain gradient to a DTensor"
)


def runs_local_views(block: nn.Module) -> str | None:
    """Why ``block`` stays eager under ``training.compile``: its mixer runs on local views of
    its DTensor parameters (:class:`_LocalViews`: Mamba's conv and SSM vectors), whose traced
    backward hands a plain gradient to a DTensor (torch 2.13 with ``aot_eager``); None when
    it does not. A norm's views of its own weight trace correctly."""
    held = any(module in _LOCAL_VIEW_OWNERS for module in block.modules())
    return LOCAL_VIEWS_STAY_EAGER if held else None


class _LocalViews(ParallelStyle):
    """Run a module on plain tensors: during its forward each listed DTensor parameter (its own
    or a submodule's) is shadowed by its local tensor.

    A Replicate parameter of a module that sees only this rank's tokens gets a ``Partial``
    gradient (the ranks' shares, summed later); any other keeps its parameter's placement.
    """

    def __init__(self, params: list[tuple[nn.Module, str]], partial_grads: bool) -> None:
        super().__init__()
        self.params, self.partial_grads = params, partial_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._shadow)
        module.register_forward_hook(self._unshadow, always_call=True)
        return module

    def _shadow(self, module: nn.Module, args: Any) -> None:
        for owner, name in self.params:
            # Read at call time: FSDP2 swaps its unsharded parameter in before the forward.
            param = owner._parameters[name]
            grads = [Partial() if self.partial_grads and p.is_replicate() else p
                     for p in param.placements]  # fmt: skip
            # An instance attribute wins over nn.Module.__getattr__'s parameter lookup: the
            # module's code reads the local tensor while the DTensor stays registered.
            owner.__dict__[name] = param.to_local(grad_placements=grads)

    def _unshadow(self, module: nn.Module, args: Any, output: Any) -> None:
        for owner, name in self.params:
            owner.__dict__.pop(name, None)


class _ReplicatedColumns(ParallelStyle):
    """A column linear held whole on every rank, each keeping its own ``width`` output columns
    from ``start``: KV projections with fewer heads than ranks. Their gradients are Partial."""

    def __init__(self, start: int, width: int) -> None:
        super().__init__()
        self.start, self.width = start, width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            if isinstance(x := inputs[0], DTensor):
                return inputs
            return (DTensor.from_local(x, mesh, (Replicate(),), run_check=False), *inputs[1:])

        def keep(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            # Each rank's gradient covers only its own columns: together they sum to the whole.
            local = output.to_local(grad_placements=(Partial(),))
            return local.narrow(-1, self.start, self.width)

        return distribute_module(module, device_mesh, None, prepare, keep)


def canonical_order(module: nn.Module, name: str) -> tuple[int, torch.Tensor] | None:
    """(dim, order) of a parameter whose DTensor view is rank-major: view position ``p`` along
    ``dim`` holds canonical index ``order[p]``; None for a parameter in canonical order."""
    return _CANONICAL_ORDERS.get(module, {}).get(name)


def canonical_orders(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """:func:`canonical_order` of each of ``model``'s rank-major parameters, by full name."""
    return {
        f"{prefix}.{name}" if prefix else name: order
        for prefix, module in model.named_modules()
        for name, order in _CANONICAL_ORDERS.get(module, {}).items()
    }


@torch.no_grad()
def reordered(value: torch.Tensor, like: DTensor, dim: int, index: torch.Tensor) -> DTensor:
    """``value`` (a DTensor of any placement, or a full tensor) with its entries along ``dim``
    taken at ``index``, placed as ``like``. Gathers the tensor over its mesh."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    placed = full.index_select(dim, index.to(full.device))
    return distribute_tensor(placed, like.device_mesh, like.placements, src_data_rank=None)


_CANONICAL_ORDERS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, torch.Tensor]]]
_CANONICAL_ORDERS = weakref.WeakKeyDictionary()


def _canonical_state_dict(module: nn.Module, name: str, dim: int, order: torch.Tensor) -> None:
    """Show the rank-major parameter ``name`` of ``module`` in canonical order in state dicts,
    and take the canonical order (a DTensor of any placement, or a full tensor) when loading.
    Both gather the tensor over its mesh. (The optimizer's state of the parameter is
    reordered alike: ``factory.runtime.optimizer``.)"""
    _CANONICAL_ORDERS.setdefault(module, {})[name] = (dim, order)

    def reorder(index: torch.Tensor, mod: nn.Module, state_dict: dict, prefix: str) -> None:
        if (key := prefix + name) in state_dict:
            state_dict[key] = reordered(state_dict[key], mod._parameters[name], dim, index)

    module.register_state_dict_post_hook(
        lambda mod, sd, prefix, *_: reorder(order.argsort(), mod, sd, prefix)
    )
    module.register_load_state_dict_pre_hook(
        lambda mod, sd, prefix, *_: reorder(order, mod, sd, prefix)
    )


def _sum_routed_tokens(group: dist.ProcessGroup, module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a routing mixer: tokens-per-expert summed over TP, so every TP rank sees
    the whole sequence's load (and moves its expert bias alike)."""
    if not isinstance(out, RoutedOutput):
        return out
    counts = out.tokens_per_expert.clone()
    dist.all_reduce(counts, group=group)
    return out._replace(tokens_per_expert=counts)
