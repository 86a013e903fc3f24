"""GEMM operand quantizers: what each recipe does to the operands of fprop, dgrad and wgrad.

A linear ``y = x Wᵀ`` (x [M, K], W [N, K]) runs three GEMMs, each reducing over
a different dimension, so each operand is quantized in blocks along that
dimension (``docs/precision.md``, 'GEMM operands'):

========  ==========================  ==========================  =========
GEMM      operand 1                   operand 2                   reduces
========  ==========================  ==========================  =========
fprop     ``input(x)``, along K       ``weight(W)``, along K      K
dgrad     ``grad(dy)``, along N       ``dgrad_weight(W)``, N      N
wgrad     ``wgrad(dy, x)[0]``: dyᵀ    ``wgrad(dy, x)[1]``: xᵀ     M
========  ==========================  ==========================  =========

Every method takes and returns fp32 tensors with leading batch dims (one matrix
per expert in a grouped GEMM, each with its own scales) and returns
*dequantized* values: the emulated GEMM is then a plain fp32 matmul, which
equals the hardware's per-block scaled accumulation up to fp32 summation order.
Each also takes the GEMM's :class:`~factory.precision.splits.GemmSplit`: under
tensor parallelism an operand may be this rank's part of a split tensor, and is
quantized with the whole tensor's statistics and random numbers
(``factory.precision.splits``); one process passes nothing.
``wgrad`` returns the transposed operands ``dyᵀ [.., N, M']`` and ``xᵀ [.., K, M']``;
``M'`` may exceed M by zero padding (the Hadamard transform needs whole tiles),
which leaves ``dyᵀ @ x`` unchanged.

One quantizer instance serves one module: delayed scaling keeps its amax
history there, MoR its statistics, NVFP4 its stochastic-rounding generator.

Where a recipe's GEMMs can run on tensor cores (FP8 with per-tensor scales, on a
GPU of compute capability >= 8.9), its quantizer also casts operands to FP8 codes
and ``scale_inv`` (:meth:`FP8Quantizer.scaled_cast`) and
``factory.precision.qlinear`` multiplies them with ``torch._scaled_mm``
(``factory.kernels.fp8_gemm``); :meth:`GemmQuantizer.gemm_kernel` says which
path runs on a device and why a fallback was taken.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from factory.kernels import cast_dispatch, fp8, fp8_gemm, hadamard, mor
from factory.kernels.choice import KernelChoice
from factory.kernels.tensor_parts import TensorPart
from factory.precision.splits import WHOLE_GEMM, GemmSplit
from factory.schemas.base import Section
from factory.schemas.precision import FP8Options, MoROptions, NVFP4Options, PrecisionConfig
from factory.schemas.precision_recipes import recipe_named

__all__ = [
    "FP8Quantizer",
    "GemmQuantizer",
    "MXFP8Quantizer",
    "MoRQuantizer",
    "NVFP4Quantizer",
    "make_quantizer",
]

_TILE = 16


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _per_matrix(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a per-tensor quantizer to every matrix of ``[..., rows, cols]``."""
    if x.ndim == 2:
        return fn(x)
    flat = x.reshape(-1, *x.shape[-2:])
    return torch.stack([fn(m) for m in flat]).reshape(x.shape)


class GemmQuantizer:
    """The interface; subclasses implement one recipe. See the module docstring."""

    recipe: str = ""
    """The registered recipe it carries out (``factory.schemas.precision_recipes``)."""
    reuses_casts: bool = False
    """wgrad takes the transposes of the fprop/dgrad casts (so fprop's input cast is kept)."""

    def _weight_casts(self) -> dict[str, tuple[torch.Tensor, int, Any]]:
        """kind -> (source tensor, its version when cast, the cast): per instance, made on
        first use (subclasses need not call an ``__init__`` here)."""
        return self.__dict__.setdefault("_weight_cast_cache", {})

    def cached_weight_cast(
        self, kind: str, w: torch.Tensor, source: torch.Tensor | None, cast: Callable[[], Any]
    ) -> Any:
        """``cast()``, done once per weight update: later micro-batches of the same step
        reuse it (as TE casts weights on the first micro-batch only). The cache holds the
        tensor itself (or ``source``, the parameter ``w`` is a local view of under tensor
        parallelism), so the in-place optimizer step, which bumps its version, is seen."""
        source = w if source is None else source
        casts = self._weight_casts()
        entry = casts.get(kind)
        if entry is None or entry[0] is not source or entry[1] != source._version:
            entry = casts[kind] = (source, source._version, cast())
        return entry[2]

    def fprop_weight(
        self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM, source: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``weight(w)``, cast once per weight update (:meth:`cached_weight_cast`)."""
        return self.cached_weight_cast(
            "dequantized", w, source, lambda: self.weight(w.detach().to(torch.float32), split)
        )

    def forget_weight_cast(self) -> None:
        """Drop the cached casts: the next ``fprop_weight`` casts again."""
        self._weight_casts().clear()

    def runs_scaled_gemm(self, device: str) -> bool:
        """Whether its GEMMs run as real low-precision GEMMs on ``device`` (``"cuda"``) rather
        than emulated; the same test :meth:`gemm_kernel` reports."""
        return False

    def gemm_kernel(self, device: str) -> KernelChoice:
        """What runs its GEMMs on ``device``: the emulation, with the recipe's reason on CUDA
        (``PrecisionRecipe.emulated_because``); on CPU the emulation is the reference."""
        record = recipe_named(self.recipe)
        reason = record.emulated_because(getattr(self, "options", None))
        return KernelChoice(
            f"{self.recipe} gemm",
            fp8_gemm.EMULATED,
            (reason or "no tensor-core GEMM is wired for it") if device == "cuda" else None,
        )

    def warn_emulated(self, why: str) -> None:
        """Say once per quantizer and reason that a GEMM it would run on tensor cores is
        emulated (a shape ``torch._scaled_mm`` refuses): never silently."""
        seen: set[str] = self.__dict__.setdefault("_emulated_reasons", set())
        if why not in seen:
            seen.add(why)
            warnings.warn(f"{self.recipe} gemm emulated: {why}", stacklevel=3)

    def input(self, x: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        raise NotImplementedError

    def weight(self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def for_recipe(cls, options: Section | None, seed: int) -> GemmQuantizer:
        """One module's quantizer from its recipe's settings section (None for a recipe
        without one); ``seed`` seeds a recipe that draws random numbers."""
        return cls() if options is None else cls(options)  # type: ignore[call-arg]

    @property
    def split_block(self) -> int:
        """Elements one scale covers along a GEMM dimension: a tensor-parallel rank must hold
        whole blocks (the recipe's ``split_block``)."""
        return recipe_named(self.recipe).split_block(getattr(self, "options", None))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to quantize exactly as this one would have (random
        generators, amax histories, counters); stateless recipes have nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def dgrad_weight(
        self, w: torch.Tensor, w_fprop: torch.Tensor | None, split: GemmSplit = WHOLE_GEMM
    ) -> torch.Tensor:
        """The weight operand of dgrad; ``w_fprop`` is fprop's quantized weight if it ran."""
        return w_fprop if w_fprop is not None else self.weight(w, split)

    def grad(self, dy: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        raise NotImplementedError

    def wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        dy_q: torch.Tensor | None = None,
        x_q: torch.Tensor | None = None,
        split: GemmSplit = WHOLE_GEMM,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dyᵀ, xᵀ)`` quantized along the tokens. ``dy_q`` / ``x_q`` are this GEMM's
        dgrad / fprop casts when they ran: a recipe whose transposed cast equals the
        transpose of that cast (per-tensor scaling) reuses them, as TE's single cast
        produces both layouts."""
        raise NotImplementedError


class NVFP4Quantizer(GemmQuantizer):
    """The NVFP4 paper's recipe (arXiv:2509.25149, section 4): 1x16 RN activations, 16x16 RN
    weights (so fprop and dgrad use identical weight values), 1x16 SR gradients, and a 16x16
    random Hadamard transform along the token dimension of both wgrad inputs.

    Two departures from TE, both documented choices: the rotation runs in fp32
    (TE rounds its output to BF16 before the amax), and the sign vector is drawn
    from ``hadamard_seed`` (TE hard-codes one); the paper found no difference
    between fixed and fresh random signs at 1.2B (arXiv:2509.25149, appendix E.4;
    ``docs/precision.md``, 'Random Hadamard transform')."""

    recipe = "nvfp4"

    @classmethod
    def for_recipe(cls, options: Section | None, seed: int) -> GemmQuantizer:
        assert isinstance(options, NVFP4Options)
        return cls(options, seed)

    def __init__(self, options: NVFP4Options, seed: int = 0) -> None:
        self.options = options
        self.weight_2d = options.weight_tile == "16x16"
        self.signs = hadamard.random_signs(_TILE, options.hadamard_seed)
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def _grad_q(
        self, g: torch.Tensor, part: TensorPart, rht_signs: torch.Tensor | None = None
    ) -> torch.Tensor:
        sr = self.options.stochastic_rounding
        return cast_dispatch.nvfp4_fake_quantize(g, (1, 16), sr, self.generator, part, rht_signs)

    def input(self, x: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return cast_dispatch.nvfp4_fake_quantize(x, (1, 16), part=split.part("tokens", "in"))

    def weight(self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        tile = (16, 16) if self.weight_2d else (1, 16)
        return cast_dispatch.nvfp4_fake_quantize(w, tile, part=split.part("out", "in"))

    def dgrad_weight(
        self, w: torch.Tensor, w_fprop: torch.Tensor | None, split: GemmSplit = WHOLE_GEMM
    ) -> torch.Tensor:
        if self.weight_2d:  # a 16x16 tile is its own transpose: reuse fprop's values
            return super().dgrad_weight(w, w_fprop, split)
        # 1x16 blocks along N instead
        part = split.part("in", "out")
        return _t(cast_dispatch.nvfp4_fake_quantize(_t(w), (1, 16), part=part))

    def grad(self, dy: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._grad_q(dy, split.part("tokens", "out"))

    def wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        dy_q: torch.Tensor | None = None,
        x_q: torch.Tensor | None = None,
        split: GemmSplit = WHOLE_GEMM,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Rotated operands are zero-padded to whole 16-token tiles; zero tokens add nothing.
        signs = self.signs if self.options.hadamard else None
        x_part = split.part("in", "tokens")
        return (
            self._grad_q(_t(dy), split.part("out", "tokens"), signs),
            cast_dispatch.nvfp4_fake_quantize(_t(x), (1, 16), part=x_part, rht_signs=signs),
        )


class FP8Quantizer(GemmQuantizer):
    """Transformer Engine's FP8 recipes.

    * ``tensorwise``: one current scale per tensor (per expert in a grouped GEMM).
    * ``delayed``: one amax history per role (input, weight, gradient) and module;
      the scale lags by a step. A grouped GEMM's experts share one history.
    * ``blockwise``: 1x128 blocks along the reduction dim for inputs and
      gradients (re-blocked along the tokens for wgrad), 128x128 for weights,
      whose values are then the same in fprop and dgrad. E4M3 everywhere, as
      in DeepSeek-V3 and TE's ``Float8BlockScaling``, whatever ``format`` says.

    ``format: hybrid`` means E4M3 forward and E5M2 gradients (per-tensor recipes).
    Per-tensor scaling does not depend on the layout, so wgrad uses the
    transposes of the fprop and dgrad casts when they ran (TE casts once into
    both layouts) and casts afresh only when they did not (e.g. the forward
    switched to BF16, or x needs no gradient).

    The per-tensor recipes run on FP8 tensor cores where ``fp8_gemm`` can
    (:meth:`runs_scaled_gemm`), from the same casts as FP8 codes
    (:meth:`scaled_cast`); blockwise scaling is emulated everywhere.
    """

    recipe = "fp8"

    def __init__(self, options: FP8Options) -> None:
        self.options = options
        self.reuses_casts = options.scaling != "blockwise"
        blockwise = options.scaling == "blockwise"
        self.fwd_fmt: fp8.FP8Format = "e4m3"
        self.bwd_fmt: fp8.FP8Format = (
            "e5m2" if options.format == "hybrid" and not blockwise else "e4m3"
        )
        if options.scaling == "delayed":
            kw = {
                "history_len": options.amax_history_len,
                "amax_compute": options.amax_compute,
                "margin": options.margin,
            }
            self.delayed = {
                "input": fp8.DelayedScaling(fmt=self.fwd_fmt, **kw),
                "weight": fp8.DelayedScaling(fmt=self.fwd_fmt, **kw),
                "grad": fp8.DelayedScaling(fmt=self.bwd_fmt, **kw),
            }

    def state_dict(self) -> dict[str, Any]:
        if self.options.scaling != "delayed":
            return {}
        return {
            role: {"history": list(d.history), "scale": d.scale.clone()}
            for role, d in self.delayed.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for role, entry in state.items():
            delayed = self.delayed[role]
            delayed.history.clear()
            delayed.history.extend(entry["history"])
            delayed.scale = entry["scale"].clone()

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (tensorwise, delayed): what ``torch._scaled_mm`` takes."""
        return self.options.scaling != "blockwise"

    def runs_scaled_gemm(self, device: str) -> bool:
        return self.per_tensor and fp8_gemm.scaled_mm_unavailable(device) is None

    def gemm_kernel(self, device: str) -> KernelChoice:
        if not self.per_tensor:
            return super().gemm_kernel(device)
        return fp8_gemm.fp8_gemm_kernel(device, f"{self.recipe} gemm ({self.options.scaling})")

    def role_format(self, role: str) -> fp8.FP8Format:
        """E5M2 for gradients under ``format: hybrid`` (per-tensor), E4M3 otherwise."""
        return self.bwd_fmt if role == "grad" else self.fwd_fmt

    def scaled_cast(self, x: torch.Tensor, role: str, part: TensorPart) -> fp8.FP8Tensor:
        """FP8 codes and ``scale_inv`` of ``x`` for ``role`` (input, weight, grad), the values
        :meth:`input`, :meth:`weight` and :meth:`grad` dequantize to: per matrix of
        ``[..., rows, cols]`` under current scaling (a ``scale_inv`` per matrix), from the
        role's amax history under delayed scaling (one shared). Current scaling checks no
        finiteness here: non-finite operands give non-finite products, as in TE."""
        fmt = self.role_format(role)
        if self.options.scaling == "delayed":
            return self.delayed[role].quantize(x, part)
        if not self.per_tensor:
            raise ValueError("scaled_cast needs per-tensor scaling (tensorwise or delayed)")
        # No finiteness check: it would wait for the device on every cast (TE checks none).
        if x.ndim == 2:
            return fp8.quantize_tensorwise(x, fmt, part, check_finite=False)
        matrices = x.reshape(-1, *x.shape[-2:])
        casts = [fp8.quantize_tensorwise(m, fmt, part, check_finite=False) for m in matrices]
        data = torch.stack([c.data for c in casts]).reshape(x.shape)
        return fp8.FP8Tensor(data, torch.stack([c.scale_inv for c in casts]), fmt)

    def scaled_fprop_weight(
        self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM, source: torch.Tensor | None = None
    ) -> fp8.FP8Tensor:
        """:meth:`scaled_cast` of the weight, once per weight update."""
        part = split.part("out", "in")
        return self.cached_weight_cast(
            "codes",
            w,
            source,
            lambda: self.scaled_cast(w.detach().to(torch.float32), "weight", part),
        )

    def _q(
        self, x: torch.Tensor, role: str, block: tuple[int, int], part: TensorPart
    ) -> torch.Tensor:
        """Blockwise scales need nothing from other ranks (splits hold whole blocks); the
        per-tensor amaxes are ``part``'s whole tensor's."""
        fmt = self.role_format(role)
        scaling = self.options.scaling
        if scaling == "tensorwise":
            return cast_dispatch.fp8_tensorwise(x, fmt, part)
        if scaling == "blockwise":
            return _per_matrix(lambda m: fp8.quantize_blockwise(m, block, fmt).dequantize(), x)
        return self.delayed[role].quantize(x, part).dequantize()

    def input(self, x: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(x, "input", (1, 128), split.part("tokens", "in"))

    def weight(self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(w, "weight", (128, 128), split.part("out", "in"))

    def grad(self, dy: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(dy, "grad", (1, 128), split.part("tokens", "out"))

    def wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        dy_q: torch.Tensor | None = None,
        x_q: torch.Tensor | None = None,
        split: GemmSplit = WHOLE_GEMM,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.options.scaling == "blockwise":
            return (
                self._q(_t(dy), "grad", (1, 128), split.part("out", "tokens")),
                self._q(_t(x), "input", (1, 128), split.part("in", "tokens")),
            )
        dy_q = dy_q if dy_q is not None else self.grad(dy, split)
        x_q = x_q if x_q is not None else self.input(x, split)
        return _t(dy_q), _t(x_q)


class _OneCastQuantizer(GemmQuantizer):
    """A recipe that casts every operand the same way, blocked along its last dim: ``_q``.
    wgrad casts the transposes afresh, so its blocks run along the tokens."""

    def _q(self, x: torch.Tensor, part: TensorPart) -> torch.Tensor:
        raise NotImplementedError

    def input(self, x: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(x, split.part("tokens", "in"))

    def weight(self, w: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(w, split.part("out", "in"))

    def grad(self, dy: torch.Tensor, split: GemmSplit = WHOLE_GEMM) -> torch.Tensor:
        return self._q(dy, split.part("tokens", "out"))

    def wgrad(
        self,
        dy: torch.Tensor,
        x: torch.Tensor,
        dy_q: torch.Tensor | None = None,
        x_q: torch.Tensor | None = None,
        split: GemmSplit = WHOLE_GEMM,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._q(_t(dy), split.part("out", "tokens")), self._q(
            _t(x), split.part("in", "tokens")
        )


class MXFP8Quantizer(_OneCastQuantizer):
    """OCP MXFP8 (TE ``MXFP8BlockScaling``): E4M3 elements, one E8M0 scale per 32 elements
    along the reduction dim of every GEMM. Blocks are 1D, so dgrad quantizes the weight
    again along N (its values differ from fprop's) and wgrad re-blocks along the tokens."""

    recipe = "mxfp8"

    def _q(self, x: torch.Tensor, part: TensorPart) -> torch.Tensor:
        """Every scale is a block's own: a split holding whole blocks needs nothing else."""
        return cast_dispatch.mxfp8(x, "e4m3")

    def dgrad_weight(
        self, w: torch.Tensor, w_fprop: torch.Tensor | None, split: GemmSplit = WHOLE_GEMM
    ) -> torch.Tensor:
        return _t(self._q(_t(w), split.part("in", "out")))


@dataclass
class MoRQuantizer(_OneCastQuantizer):
    """Mixture of Representations: every operand, per tensor or block, is FP8 (E4M3, current
    scaling) where its measured error is under the threshold and BF16 elsewhere. ``stats``
    counts the units kept in FP8 across all calls. Gradients use E4M3 too: the threshold
    is calibrated for it, and BF16 is the fallback that E5M2's range would otherwise buy."""

    options: MoROptions
    stats: mor.MoRStats = field(default_factory=mor.MoRStats)
    recipe = "mor"

    def state_dict(self) -> dict[str, Any]:
        s = self.stats
        return {"fp8_units": s.fp8_units, "total_units": s.total_units, "calls": s.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = mor.MoRStats(**state)

    def _q(self, x: torch.Tensor, part: TensorPart) -> torch.Tensor:
        def one(m: torch.Tensor) -> torch.Tensor:
            o = self.options
            result = mor.choose(m, o.threshold, o.granularity, o.block_size, "e4m3", part=part)
            self.stats.update(result)
            return result.out

        return _per_matrix(one, x)


def make_quantizer(recipe: str, options: Section | None = None, seed: int = 0) -> GemmQuantizer:
    """The quantizer of one module for a registered recipe that quantizes, with its settings
    section (None: the recipe's defaults); its class is the one the recipe names."""
    record = recipe_named(recipe)
    if record.quantizer is None:
        raise ValueError(f"no quantizer for recipe {recipe!r} (it runs unquantized)")
    if options is None and record.options is not None:
        options = PrecisionConfig().options_for(recipe)
    module, _, name = record.quantizer.rpartition(".")
    quantizer: type[GemmQuantizer] = getattr(importlib.import_module(module), name)
    return quantizer.for_recipe(options, seed)
