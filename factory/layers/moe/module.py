"""Mixture of experts (the ``E`` layers): router, grouped routed experts, shared expert, LatentMoE.

The router always sees the full hidden size in fp32. With ``latent_size`` set,
tokens are projected d -> latent before the routed experts and back after, so
dispatch and expert weights shrink by d/latent; the shared expert stays at d.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from factory.kernels.choice import KernelChoice
from factory.kernels.moe_dispatch import (
    Dispatch,
    ExpertLinear,
    ExpertWeights,
    combine,
    grouped_mlp,
    grouped_mm_problem,
    route_tokens,
)
from factory.layers.mlp.module import MLP
from factory.layers.moe.experts import ExpertPath, choose_path, pair_outputs
from factory.layers.moe.spec import mlp_bias
from factory.nn.decoding import StatelessCache
from factory.nn.outputs import RoutedOutput
from factory.schemas.model import ModelConfig, MoEConfig, RouterConfig

__all__ = ["ExpertDispatcher", "MoE", "RoutedExperts", "Router", "build", "kernel_choices"]


class Router(nn.Module):
    """Top-k routing: scores pick experts through ``score + expert_bias``; weights are the
    unbiased scores, optionally renormalised, times the scaling factor (``docs/architecture.md``,
    'Router')."""

    def __init__(self, width: int, num_experts: int, top_k: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg, self.num_experts, self.top_k = cfg, num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, width, dtype=torch.float32))
        # A parameter (so it counts and checkpoints like the released models) that no
        # gradient touches: the aux-loss-free rule in update_expert_bias moves it.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.expert_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] fp32, expert indices [T, k], scores [T, E] fp32)."""
        logits = x.float() @ self.weight.float().t()
        scores = logits.sigmoid() if self.cfg.score_function == "sigmoid" else logits.softmax(-1)
        bias = self.e_score_correction_bias
        choice = scores + bias if bias is not None else scores
        choice = self._limit_groups(choice.detach())
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.cfg.normalize_top_k and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.cfg.scaling_factor
        return weights, indices, scores

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 group-limited routing: keep the groups whose top-2 scores sum highest."""
        groups = self.cfg.num_groups
        if groups <= 1:
            return choice
        grouped = choice.view(choice.shape[0], groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(self.cfg.group_top_k, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask[..., None], float("-inf")).view_as(choice)

    def aux_loss(self, scores: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
        """Load-balancing loss  coeff * E/k * sum_i f_i * P_i  (Switch / DeepSeek-V3).

        ``seq_aux_loss`` computes f and P per sequence and averages (DeepSeek-V3's
        complementary sequence-wise loss); ``aux_loss`` and ``global_aux_loss`` use
        all tokens of the batch at once.
        """
        kind, coeff = self.cfg.aux_loss, self.cfg.aux_loss_coeff
        if kind == "none" or coeff == 0:
            return scores.new_zeros(())
        groups = batch if kind == "seq_aux_loss" else 1
        probs = scores / scores.sum(-1, keepdim=True)
        probs = probs.view(groups, -1, self.num_experts)
        chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0).view_as(probs)
        fraction = chosen.mean(1) * self.num_experts / self.top_k  # f_i, 1 when balanced
        return coeff * (fraction * probs.mean(1)).sum(-1).mean()

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of experts that received fewer
        than the mean of ``load`` (tokens per expert over the optimizer step), lower the others."""
        bias = self.e_score_correction_bias
        # No `load.sum() > 0` test (a host read): with no load every sign is 0 anyway.
        if bias is not None:
            load = load.to(bias.device, torch.float32)
            bias += self.cfg.expert_bias_update_rate * torch.sign(load.mean() - load)


class RoutedExperts(nn.Module):
    """All routed experts of a layer as 3D weights [E, out, in], computed grouped, never looped."""

    def __init__(self, num_experts: int, width: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.gate_proj = (
            nn.Parameter(torch.empty(num_experts, hidden, width))
            if activation == "swiglu"
            else None
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.linear: ExpertLinear | None = None
        """Runs the expert GEMMs when set (``factory.precision`` installs quantized ones)."""
        self.path: ExpertPath | None = None
        """Forces one expert GEMM path; None picks by each routing's load
        (``factory.layers.moe.experts.choose_path``)."""

    def forward(
        self, x: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Under expert (and expert-tensor) parallelism the weights are DTensors over the
        ``(ep, etp)`` mesh and ``dispatch`` routes over this rank's experts only, so the GEMMs
        take the local shards (``to_local`` hands the gradient back to the DTensor); with ETP
        the output is this rank's partial sum over its share of the ffn. The dispatcher calls this module rather than
        reading its weights so that module hooks (FSDP's gather and reshard) still run."""
        # The GEMMs run in the activations' dtype. FSDP's mixed precision casts the weights it
        # gathers, but with one expert-data-parallel replica it leaves the experts alone, so
        # their fp32 masters would meet BF16 activations (grouped_mm refuses mixed dtypes).
        gate = _local(self.gate_proj).to(x.dtype) if self.gate_proj is not None else None
        up, down = _local(self.up_proj).to(x.dtype), _local(self.down_proj).to(x.dtype)
        experts = ExpertWeights(up, down, self.activation, gate)
        linear = self.linear if self._hook_matters() else None
        # The quantized GEMMs take padded [E, C, in] batches, so they keep the padded path.
        path = (
            "padded_bmm"
            if linear is not None
            else self.path or choose_path(dispatch, x, up.shape[1])
        )
        if path != "padded_bmm":
            return combine(pair_outputs(path, x, dispatch, experts), dispatch, weights, x.dtype)
        return grouped_mlp(x, dispatch, experts, weights, linear=linear)

    def sync_free(self) -> bool:
        """Whether :meth:`forward`, as set up now, runs with no host sync and shapes from
        ``T``, ``k`` and ``E`` alone, so ``torch.compile`` traces it once."""
        return self.sync_problem() is None

    def sync_problem(self) -> str | None:
        """Why :meth:`forward` reads the host (None: it does not): the ``grouped_mm`` path,
        verified for the weights' device, dtype and widths, is sync-free; a quantized GEMM
        hook takes padded batches, sized by the largest count on the host, and so does a
        forced other path. Asking runs the ``_grouped_mm`` probe eagerly, before any
        tracing."""
        if self.linear is not None:
            return "quantized expert GEMMs take padded batches sized on the host"
        if self.path not in (None, "grouped_mm"):
            return f"the expert path is forced to {self.path}"
        up = self.up_proj
        return grouped_mm_problem(up.device, up.dtype, up.shape[2], up.shape[1])

    def _hook_matters(self) -> bool:
        """Whether the installed GEMM hook changes this call. After a precision switch to bf16
        it quantizes neither pass (or only the backward, which no-grad calls never run) and is
        a plain bmm; skipping it then gives the load's path, the same ops as without a hook,
        so the output equals the unquantized model's bit for bit."""
        if self.linear is None:
            return False
        forward = getattr(self.linear, "quantize_forward", True)
        backward = getattr(self.linear, "quantize_backward", True) and torch.is_grad_enabled()
        return bool(forward or backward)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor weight, any other weight as it is. Duck-typed so that
    single-process runs never import ``torch.distributed.tensor`` (over a second)."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


ExpertDispatcher = Callable[
    [RoutedExperts, torch.Tensor, Dispatch, torch.Tensor, int | None], torch.Tensor
]
"""``(experts, x [T, d_in], dispatch, weights [T, k], capacity) -> [T, d_in]``: runs the routed
experts in place of ``experts(x, dispatch, weights)``; ``capacity`` (None when dropless) is the
per-expert count of pairs kept, the rest already carry weight 0."""


class MoE(nn.Module):
    def __init__(self, width: int, cfg: MoEConfig, mlp_bias: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(width, cfg.num_experts, cfg.top_k, cfg.router)
        inner = cfg.latent_size or width
        self.experts = RoutedExperts(
            cfg.num_experts, inner, cfg.expert_intermediate_size, cfg.activation
        )
        self.shared_experts = (
            MLP(width, cfg.shared_expert_intermediate_size, cfg.activation, mlp_bias)
            if cfg.shared_expert_intermediate_size
            else None
        )
        self.fc1_latent_proj = nn.Linear(width, inner, bias=mlp_bias) if cfg.latent_size else None
        self.fc2_latent_proj = nn.Linear(inner, width, bias=mlp_bias) if cfg.latent_size else None
        self.dispatcher: ExpertDispatcher | None = None
        """Runs the routed experts when set: expert parallelism
        (``factory.layers.moe.expert_parallel``) sends the kept pairs to the ranks holding
        their experts. Routing, aux loss and capacity stay local either way."""

    def capacity(self, dispatch: Dispatch) -> int | None:
        """Pairs each expert keeps, ceil(cf * T * k / E); None without a capacity factor."""
        if self.cfg.capacity_factor is None:
            return None
        return math.ceil(
            self.cfg.capacity_factor * dispatch.num_tokens * dispatch.top_k / self.cfg.num_experts
        )

    def _drop_over_capacity(self, dispatch: Dispatch, weights: torch.Tensor) -> torch.Tensor:
        """With a capacity factor, each expert keeps its first ceil(cf * T * k / E) assignments
        in token order (the dispatch's stable sort ranks them); the rest get weight 0 and the
        token keeps its residual path."""
        capacity = self.capacity(dispatch)
        if capacity is None:
            return weights
        kept = dispatch.unpermute(dispatch.rank_in_expert < capacity)
        return weights * kept.to(weights.dtype)

    def sync_free(self) -> bool:
        """Whether :meth:`forward` runs with no host sync and static shapes, so the block
        compiles (``MixtureOfExperts.eager_reason``)."""
        return self.sync_problem() is None

    def sync_problem(self) -> str | None:
        """Why :meth:`forward` reads the host (None: it does not): the routed experts' own
        reason, or expert parallelism (its all-to-all takes the split sizes as host lists)."""
        if self.dispatcher is not None:
            return "expert parallelism's all-to-all takes its split sizes from the host"
        return self.experts.sync_problem()

    def update_expert_bias(self, load: torch.Tensor) -> None:
        """The routing mixer's half of the aux-loss-free step (every mixer that returns a
        :class:`RoutedOutput` has one): the router moves its expert bias by ``load``."""
        self.gate.update_expert_bias(load)

    def decoding_problem(self) -> str | None:
        """Why this mixer cannot decode incrementally (None: it can)."""
        if self.cfg.capacity_factor is not None:
            return (
                "its capacity factor drops tokens by what else the batch holds, so a position's "
                "output would depend on how many positions a decoding step carries"
            )
        return None

    def init_cache(
        self, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> StatelessCache:
        """Token-wise: nothing to keep between decoding steps."""
        return StatelessCache()

    def decode(self, x: torch.Tensor, cache: StatelessCache) -> RoutedOutput:
        """The next positions: the same routing and experts as :meth:`forward`."""
        return self(x)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> RoutedOutput:
        """Token-wise routing: ``document_ids`` changes nothing."""
        batch, seq, width = x.shape
        flat = x.reshape(-1, width)
        weights, indices, scores = self.gate(flat)
        aux = self.gate.aux_loss(scores, indices, batch) if self.training else None
        # A top-k over num_experts scores cannot leave the range: no check, no host read.
        dispatch = route_tokens(indices, self.cfg.num_experts, check=False)
        weights = self._drop_over_capacity(dispatch, weights)
        h = self.fc1_latent_proj(flat) if self.fc1_latent_proj is not None else flat
        if self.dispatcher is None:
            y = self.experts(h, dispatch, weights)
        else:
            y = self.dispatcher(self.experts, h, dispatch, weights, self.capacity(dispatch))
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return RoutedOutput(y.view(batch, seq, width), aux, dispatch.tokens_per_expert.detach())


def build(model: ModelConfig) -> MoE:
    """The ``E`` mixer of ``model`` (``LayerType.build``)."""
    return MoE(model.hidden_size, model.moe, mlp_bias(model))


def kernel_choices(model: ModelConfig, device: str) -> list[KernelChoice]:
    """The MoE block's kernels on ``device``: the routing's sort and the expert GEMMs, from the
    test :func:`choose_path` makes (``grouped_mm_problem``), for the dtype a run computes in
    there (BF16 on CUDA, fp32 elsewhere). A precision recipe's quantized expert GEMMs take
    padded [E, C, in] batches whatever the device, so they keep the padded path and their
    blocks stay eager (``RoutedExperts.sync_free``)."""
    moe = model.moe
    assert moe is not None
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    width = moe.latent_size or model.hidden_size
    problem = grouped_mm_problem(device, dtype, width, moe.expert_intermediate_size)
    quantized = "; quantized expert GEMMs: padded bmm, eager"
    if problem is None:
        return [
            KernelChoice("moe dispatch", "device sort, int32 offsets on the device (no host sync)"),
            KernelChoice("expert gemms", f"torch._grouped_mm, the block compiles{quantized}"),
        ]
    # CPU's PyTorch paths are the reference there: no fallback to report.
    fallback = None if device == "cpu" else problem
    gemms = "padded bmm or per-expert mm, by load" if device == "cpu" else "padded bmm"
    return [
        KernelChoice("moe dispatch", "stable sort, largest count read on the host", fallback),
        KernelChoice("expert gemms", f"{gemms}, block eager{quantized}", fallback),
    ]
