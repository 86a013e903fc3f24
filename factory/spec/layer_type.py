"""The layer-type registry: one registered description per pattern symbol.

A :class:`LayerType` is everything factory knows about one kind of residual
block (``M``, ``*``, ``-``, ``E``, or one you add): the tensors of its mixer,
the FLOPs that are not matrix products, the activations it saves for
backward, its Hugging Face mapping, how the CPU proxy shrinks its config
section, and how to build its ``nn.Module``. The planner, the graph, the
precision table, the proxy and the exports all read it; none of them
re-derives a layer from its name. A new layer type is a registered subclass in
its own folder, ``factory/layers/NAME/`` (``spec.py`` and ``module.py``), plus a
few lines outside it (the folder's import, its config section if it has one):
``CONTRIBUTING.md``, "Adding a layer type", lists them.

This module imports neither torch nor, at run time, anything from factory (the
imports below are for type checking); a layer type reaches its torch side
through :meth:`LayerType.torch_side`. The pattern parser
(``factory.schemas.pattern``) does not ask the registry: it knows Megatron's
symbols, and the ``model.pattern_symbols`` rule asks the registry which of them
factory builds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from factory.kernels.choice import KernelChoice
    from factory.nn.sequence_split import SequenceSplit
    from factory.schemas.blueprint import Blueprint
    from factory.schemas.model import ModelConfig
    from factory.spec.activations import TokenShards
    from factory.spec.tensors import TensorSpec

__all__ = [
    "LAYER_TYPES",
    "MEGATRON_DEFAULT",
    "LayerFinding",
    "LayerType",
    "MegatronField",
    "ProxyScale",
    "Ref",
    "UpcycleError",
    "layer_check",
    "layer_type",
    "layer_type_named",
    "register_layer_type",
    "registry_revision",
    "unregister_layer_type",
]

LAYER_TYPES: dict[str, LayerType] = {}
"""Registered layer types by pattern symbol, in registration order. Change it through
:func:`register_layer_type` and :func:`unregister_layer_type`, which keep
:func:`registry_revision` current for caches of what the registry implies."""

_revision = 0


def registry_revision() -> int:
    """A number that changes whenever a layer type is registered or unregistered."""
    return _revision


@dataclass(frozen=True)
class ProxyScale:
    """What a layer type needs to shrink its section for the CPU proxy."""

    width: int
    """The proxy's hidden size."""
    source_width: int
    """The source blueprint's hidden size."""
    scale: float
    """width / the source's hidden size."""
    quantized: bool
    """The precision policy quantizes some GEMM (widths must then stay 16-aligned)."""


LayerFinding = tuple[str, str] | tuple[str, str, str]
"""What a layer type's check yields: (blueprint path, message), or with a third item
``"warning"`` for a finding that does not fail validation."""

CheckFn = TypeVar("CheckFn", bound=Callable[..., Iterator[LayerFinding]])


def layer_check(name: str) -> Callable[[CheckFn], CheckFn]:
    """Mark a method ``(self, bp: Blueprint) -> Iterator[LayerFinding]`` of a layer type as the
    ``factory validate`` rule ``name`` (``factory.checks`` registers it, for every registered
    layer type); its docstring's first line is the rule's summary."""

    def mark(fn: CheckFn) -> CheckFn:
        fn.check_name = name  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass(frozen=True)
class Ref:
    """A Python object named by import path (a callable or a torch dtype), not a literal: what a
    generated Megatron-Bridge recipe imports."""

    path: str


MEGATRON_DEFAULT: Any = object()
"""``MegatronField.absent`` of a field Megatron-Core gives a default of its own."""


@dataclass(frozen=True)
class MegatronField:
    """One field of Megatron-Core's ``TransformerConfig`` that a layer type's section sets."""

    name: str
    """The ``TransformerConfig`` field."""
    blueprint: str
    """The blueprint value it comes from, as ``docs/megatron.md``'s mapping table shows it."""
    get: Callable[[Any], Any]
    """The layer's config section (or the blueprint's ``parallelism``, see ``reads``) -> the
    field's value."""
    when: Callable[[Any], bool] | None = None
    """Whether the field applies, given the section (None: whenever the layer is used)."""
    share: Literal["own", "agree", "fallback"] = "own"
    """``own``: no other layer type sets the field. ``agree``: Megatron has one field for
    several layer types (``add_bias_linear`` for attention, MLP and experts): where the
    pattern uses more than one, their values must be equal, or the export refuses.
    ``fallback``: set only where no layer type in the pattern sets it otherwise (a model
    without dense MLPs gives ``ffn_hidden_size`` its experts' width)."""
    reads: Literal["section", "parallelism"] = "section"
    """What ``get`` and ``when`` receive: the layer's section, or ``parallelism`` (a layout
    field only this layer type needs, such as the MoE's token dispatcher)."""
    absent: Any = MEGATRON_DEFAULT
    """The value a recipe gives a field Megatron-Core requires whatever the pattern, where no
    layer type in the pattern sets it (``num_attention_heads`` is 1 without attention layers);
    layer types sharing the field declare the same value. ``MEGATRON_DEFAULT``: Megatron-Core
    has a default, and nothing is written."""


class UpcycleError(ValueError):
    """The source checkpoint cannot seed this model (``model.init.upcycle_from``)."""


class LayerType:
    """Base class of a layer-type description. Subclasses set the class attributes and
    override what applies; the defaults describe a layer that adds nothing beyond its
    tensors' GEMMs."""

    symbol: ClassVar[str]
    """The pattern character."""
    name: ClassVar[str]
    """The layer-type name used in plans and reports ('mamba', 'attention', ...)."""
    section: ClassVar[str | None] = None
    """The ``model`` section this layer needs (``model.mamba`` ...), or None."""
    hf_block_type: ClassVar[str | None] = None
    """Its ``layers_block_type`` in Hugging Face NemotronH; None when NemotronH has none."""
    megatron_modules: ClassVar[dict[str, str]] = {}
    """Each GEMM's module in Megatron-Core's hybrid layer, by its path inside our block
    (``mixer.q_proj`` -> ``self_attention.linear_qkv``): several of ours may share one fused
    Megatron module. Read by the Megatron export's per-module quantization recipe."""
    static_shapes: ClassVar[bool] = True
    """Every tensor's shape in the block follows from the batch's shape alone on every path,
    so ``torch.compile`` traces the block once (``factory.graph.block_compile``). False where
    the data decides shapes on some path, as routing decides each expert's rows on the
    padded one; :meth:`compiles` then asks the block."""

    title: ClassVar[str | None] = None
    """How pages and pictures name the layer type ('Mamba-2', 'MoE'); None: its ``name``."""
    routes_experts: ClassVar[bool] = False
    """The layer routes tokens to experts, which expert parallelism splits over EP ranks."""

    ends_period: ClassVar[bool] = False
    """The layer ends a period of the pattern's rhythm (attention, which hybrid patterns place
    every few layers): the CPU proxy keeps the first two periods of the main stack."""

    context_parallel: ClassVar[str | None] = None
    """How the layer splits across a context-parallel group: ``"token_wise"`` (no token sees
    another: nothing to exchange), ``"kv_exchange"`` (attention: every rank's queries need
    the keys and values of the whole sequence), ``"heads_all_to_all"`` (Mamba: an
    all-to-all turns sequence shards into head shards for the conv and the scan, as
    Megatron-Core's ``MambaContextParallel`` does). None: the layer has no CP style."""

    def checks(self) -> list[tuple[str, Callable[[Blueprint], Iterator[LayerFinding]]]]:
        """(rule name, bound method) of each method marked with :func:`layer_check`."""
        found: dict[str, Callable[..., Iterator[LayerFinding]]] = {}
        for klass in reversed(type(self).__mro__):
            for attr in vars(klass).values():
                if name := getattr(attr, "check_name", None):
                    found[name] = attr
        return [(name, fn.__get__(self)) for name, fn in sorted(found.items())]

    def used_by(self, model: ModelConfig) -> bool:
        """The model builds this layer type: in its main stack or its MTP blocks."""
        return self.symbol in model.parsed_pattern.main or self.symbol in model.mtp_pattern

    def config(self, model: ModelConfig) -> Any:
        """This layer's config section (raises when the blueprint lacks it)."""
        if self.section is None:
            return None
        section = getattr(model, self.section)
        if section is None:  # the model rules reject this before anything is built
            raise ValueError(f"pattern symbol {self.symbol!r} needs model.{self.section}")
        return section

    def mixer_tensors(self, model: ModelConfig, prefix: str) -> list[TensorSpec]:
        """Every parameter of the mixer under ``prefix`` (``backbone.layers.3.mixer``)."""
        raise NotImplementedError

    def extra_flops(self, model: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token that are not a tensor's GEMM (attention scores, the scan)."""
        return 0

    def megatron_flops(self, model: ModelConfig, seq_len: int) -> int | None:
        """Forward FLOPs of one layer over one sequence by Megatron-LM's formula; None where
        Megatron-LM has none for this layer (the plan then has no Megatron count)."""
        return None

    # Terms of the performance model (factory.planner.performance, docs/performance.md).

    core_coefficient: ClassVar[str] = "core"
    """The fitted coefficient (``factory.planner.perf_constants``) that turns this layer's
    ideal :meth:`core_work` time into a predicted one: kernels of one kind share one."""

    def core_work(self, model: ModelConfig, seq_len: int) -> tuple[int, float]:
        """(FLOPs, HBM bytes) per token of one forward pass through the layer's fused work
        that is not a weight GEMM (attention's QK^T and PV, the SSD scan): the performance
        model takes the longer of the two at the BF16 peak and the HBM bandwidth. Default:
        :meth:`extra_flops` with no memory traffic."""
        return self.extra_flops(model, seq_len), 0.0

    def elementwise_values(self, model: ModelConfig) -> int:
        """Values per token one forward pass reads and writes in memory-bound kernels (norms,
        the residual add, activations, gates), whose time is bytes / HBM bandwidth. Default:
        the pre-norm (read, write) and the residual add (read two, write one) on the hidden
        size."""
        return 5 * model.hidden_size

    def dispatch_values(self, model: ModelConfig) -> int:
        """Values one token sends in each expert-parallel all-to-all (the combine returns as
        many); only asked of a layer that ``routes_experts``."""
        return 0

    def cp_exchange_values(self, model: ModelConfig, cp: int) -> float:
        """Values per local token a rank receives from the other ``cp - 1`` context-parallel
        ranks in one forward pass, in its ``context_parallel`` style (token-wise: none)."""
        return 0.0

    def core_exponentials(self, model: ModelConfig, seq_len: int) -> float:
        """Exponentials per token of one forward pass through :meth:`core_work` (softmax's):
        they run on the special-function units, which can be slower than the tensor cores
        at the core's FLOPs (``GPUSpec.exp_per_s``); none by default."""
        return 0.0

    def selective_recompute(self, model: ModelConfig, seq_len: int) -> tuple[int, int]:
        """(core FLOPs, elementwise values) per token that selective recompute runs again in
        backward (Megatron's ``core_attn`` and ``moe_act`` modules); none by default."""
        return 0, 0

    def activation_bytes(self, model: ModelConfig, tokens: TokenShards, recompute: str) -> float:
        """Bytes one layer saves for backward per micro-batch on one rank, without recompute
        'full' (the planner handles that: only the layer input is kept)."""
        raise NotImplementedError

    def tp_rules(self, model: ModelConfig, tp: int) -> list[str]:
        """Why ``tp`` tensor-parallel ranks cannot split this layer evenly (empty when they
        can). ``factory validate`` reports them as ``parallelism.tp_<name>`` and the runtime
        refuses a layout with them; the spec's split widths are checked separately."""
        return []

    def cp_rules(self, model: ModelConfig, tp: int, cp: int) -> list[str]:
        """Why ``cp`` context-parallel ranks (with ``tp`` tensor-parallel ones) cannot split
        this layer (empty when they can), in its ``context_parallel`` style. ``factory
        validate`` reports them as ``parallelism.cp_<name>``."""
        return []

    def ep_rules(self, model: ModelConfig, ep: int) -> list[str]:
        """Why ``ep`` expert-parallel ranks cannot split this layer's routed experts (empty
        when they can; only asked of a layer that ``routes_experts``). ``factory validate``
        reports them as ``parallelism.ep_experts``."""
        return []

    def etp_rules(self, model: ModelConfig, etp: int) -> list[str]:
        """Why ``etp`` expert-tensor-parallel ranks cannot split each of this layer's routed
        experts (empty when they can; only asked of a layer that ``routes_experts``).
        ``factory validate`` reports them as ``parallelism.etp_experts``."""
        return []

    def apply_context_parallel(self, mixer: nn.Module, split: SequenceSplit) -> None:
        """Make the built ``mixer`` compute its rank's chunks of every sequence over ``split``'s
        group, in its ``context_parallel`` style: a token-wise mixer needs nothing; one that
        mixes positions holds the split as ``mixer.sequence_split`` and exchanges through it
        (attention gathers keys and values, Mamba trades sequence for head shards)."""
        if self.context_parallel is None:
            raise ValueError(f"{self.name!r} layers have no context-parallel style")
        if self.context_parallel != "token_wise":
            mixer.sequence_split = split

    def tp_whole_linears(self, model: ModelConfig, tp: int) -> tuple[str, ...]:
        """The mixer's column linears (names under the mixer) that every rank holds whole at
        ``tp``, each keeping its own columns (attention's KV heads when TP exceeds them)."""
        return ()

    def localize_for_tp(self, mixer: nn.Module, tp: int, rank: int) -> dict[str, tuple[int, int]]:
        """Make the built ``mixer`` compute this rank's share of its heads, in place; return,
        for each of :meth:`tp_whole_linears`, the (start, width) of the columns it keeps."""
        return {}

    def expert_parallel_problems(self, mixer: nn.Module, ep: int, etp: int) -> list[str]:
        """Why the built ``mixer`` cannot split its experts over ``ep`` expert-parallel ranks,
        each expert over ``etp`` expert-tensor-parallel ones (none: a layer without experts
        is left alone by expert parallelism)."""
        return []

    def apply_expert_parallel(
        self, mixer: nn.Module, expert_mesh: DeviceMesh, tensors: Mapping[str, TensorSpec]
    ) -> None:
        """Keep this rank's block of ``mixer``'s routed experts and exchange tokens over
        ``expert_mesh`` (the expert grid's 2-D ``(ep, etp)`` mesh). ``tensors`` are the
        mixer's routed-expert tensors by their names under it: their ``expert_dim`` splits
        over ``ep``, their ``tp`` split over ``etp``."""

    def torch_side(self, module: str = "module") -> ModuleType:
        """A module of this layer type's folder that needs torch (``module.py``: the
        ``nn.Module`` and ``build(model)``), imported on first use. The one place a layer type
        crosses into torch: its spec, and ``factory validate`` and ``plan`` with it, stay
        torch-free."""
        package = type(self).__module__.rpartition(".")[0]
        return importlib.import_module(f"{package}.{module}")

    def build(self, model: ModelConfig) -> nn.Module:
        """The mixer module: ``build(model)`` of the folder's ``module.py``."""
        return self.torch_side().build(model)

    def compiles(self, block: nn.Module) -> bool:
        """Whether ``compile_blocks`` compiles ``block``, a built block of this type, as it is
        set up now (device, dtype, installed hooks): its forward has no host sync and no shape
        the data decides, so one graph serves every batch of a shape."""
        return self.eager_reason(block) is None

    def eager_reason(self, block: nn.Module) -> str | None:
        """Why ``block`` stays eager under ``training.compile`` (None: it compiles). From
        :attr:`static_shapes` unless the layer type overrides it to ask its module."""
        return None if self.static_shapes else "its shapes depend on the data"

    def kernel_choices(self, model: ModelConfig, device: str) -> list[KernelChoice]:
        """The kernels this layer's module runs on ``device`` (``"cuda"``, ``"cpu"``), each
        with why a fallback was taken: ``kernel_choices(model, device)`` of ``module.py``,
        which answers from the same tests its dispatch makes."""
        return self.torch_side().kernel_choices(model, device)

    def shrink(self, section: dict[str, Any], source: Any, proxy: ProxyScale) -> None:
        """Update this layer's section (a dict copy) in place for the CPU proxy."""

    hf_older_block_types: ClassVar[tuple[str, ...]] = ()
    """Its ``layers_block_type`` in older transformers releases, which an import still reads."""

    def hf_refusals(self, model: ModelConfig) -> list[str]:
        """What Hugging Face NemotronH cannot express about this layer."""
        if self.hf_block_type is None:
            return [f"{self.name!r} layers ({self.symbol!r}) have no NemotronH equivalent"]
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        """This layer's fields of a NemotronH ``config.json``."""
        return {}

    def from_hf(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        """This layer's blueprint section from a NemotronH ``config.json``."""
        return None

    megatron_fields: ClassVar[tuple[MegatronField, ...] | None] = None
    """The ``TransformerConfig`` fields this layer's section sets in a Megatron-Bridge
    recipe; None when Megatron-Core has no such layer, which the export then refuses."""

    def megatron_refusals(self, model: ModelConfig) -> list[tuple[str, str]]:
        """(blueprint path, reason) for what Megatron-Core cannot express about this layer."""
        if self.megatron_fields is None:
            message = f"{self.name!r} layers ({self.symbol!r}) have no Megatron-Core equivalent"
            return [("model.pattern", message)]
        return []

    def hf_zero_tensors(self, model: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        """Tensors a NemotronH checkpoint always has that this blueprint's mixer lacks; the
        export writes them as zeros (an expert bias that is off adds nothing)."""
        return []

    # Upcycling (``model.init.upcycle_from``, ``factory.graph.upcycle``).

    checkpoint_marker: ClassVar[str | None] = None
    """A parameter only this layer type's mixer has (``A_log``), by its name under the mixer:
    how upcycling tells which layer type a source checkpoint holds at each place. None: it
    cannot tell, and copying by name finds what does not fit."""
    upcycles_from: ClassVar[str | None] = None
    """The symbol of the layer type whose weights at the same place seed this one when a model
    is upcycled (the MoE: from the dense MLP, by :meth:`upcycle`); None: copied by name."""

    def upcycle(
        self,
        mixer: nn.Module,
        source: Mapping[str, torch.Tensor],
        prefix: str,
        model: ModelConfig,
        generator: torch.Generator,
    ) -> None:
        """Overwrite the built ``mixer`` (fp32) from the :attr:`upcycles_from` layer stored
        under ``prefix`` (``backbone.layers.3.mixer``) in ``source``; ``generator`` draws what
        is random. Raises :class:`UpcycleError` where that layer cannot seed this one."""
        raise NotImplementedError(f"{self.name!r} layers do not upcycle")


def register_layer_type(cls: type[LayerType]) -> type[LayerType]:
    """Class decorator: register one instance under ``cls.symbol``."""
    existing = LAYER_TYPES.get(cls.symbol)
    if existing is not None and type(existing) is not cls:
        raise ValueError(
            f"pattern symbol {cls.symbol!r} is already the {existing.name!r} layer type"
        )
    global _revision
    LAYER_TYPES[cls.symbol] = cls()
    _revision += 1
    return cls


def unregister_layer_type(symbol: str) -> None:
    global _revision
    if LAYER_TYPES.pop(symbol, None) is not None:
        _revision += 1


def layer_type(symbol: str) -> LayerType:
    try:
        return LAYER_TYPES[symbol]
    except KeyError:
        raise KeyError(f"no layer type is registered for pattern symbol {symbol!r}") from None


def layer_type_named(name: str) -> LayerType:
    """The layer type plans and reports call ``name`` ('mamba', 'moe')."""
    for registered in LAYER_TYPES.values():
        if registered.name == name:
            return registered
    raise KeyError(f"no layer type is named {name!r}")
