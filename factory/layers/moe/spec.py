"""``E``: mixture of experts with an fp32 router, a shared expert and optional LatentMoE.

Routing follows DeepSeek-V3 (arXiv:2412.19437): sigmoid or softmax scores, an
aux-loss-free expert bias that only ranks experts, optional group-limited
routing. LatentMoE runs the routed experts in ``latent_size`` between a d ->
latent and a latent -> d projection, both replicated on every tensor-parallel
rank as Megatron does; the router always sees the full width. Expert
parallelism splits the routed experts' first dimension, expert tensor parallelism
each expert's ffn (up and gate by columns, down by rows); the latent projections
and the shared expert are not routed experts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from factory.layers.mlp.spec import (
    DenseMLP,
    activation_values,
    megatron_activation_fields,
    mlp_tensors,
    swiglu_factor,
)
from factory.spec.activations import FP32, TokenShards, ffn_bytes, prologue_bytes
from factory.spec.layer_type import (
    LayerFinding,
    LayerType,
    MegatronField,
    ProxyScale,
    layer_check,
    register_layer_type,
)
from factory.spec.rounding import half_up, nearest_multiple
from factory.spec.tensors import Gemm, Init, Role, TensorSpec, expert_linear, linear

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from factory.schemas.blueprint import Blueprint
    from factory.schemas.model import ModelConfig, MoEConfig

__all__ = ["PROXY_EXPERTS", "MixtureOfExperts", "mlp_bias"]

PROXY_EXPERTS = 32
"""With 64 experts of width 176 the Nano proxy has 40M parameters; 32 keep it near 23M."""


def mlp_bias(model: ModelConfig) -> bool:
    """The shared expert and latent projections take the dense MLP's bias setting."""
    return model.mlp.bias if model.mlp is not None else False


@register_layer_type
class MixtureOfExperts(LayerType):
    symbol = "E"
    name = "moe"
    title = "MoE"
    routes_experts = True
    section = "moe"
    context_parallel = "token_wise"
    hf_block_type = "moe"
    static_shapes = False  # each expert's rows are the router's choice (padded path)
    checkpoint_marker = "gate.weight"
    upcycles_from = DenseMLP.symbol
    megatron_modules: ClassVar[dict[str, str]] = {
        "mixer.experts.up_proj": "mlp.experts.linear_fc1",
        "mixer.experts.gate_proj": "mlp.experts.linear_fc1",
        "mixer.experts.down_proj": "mlp.experts.linear_fc2",
        "mixer.shared_experts.up_proj": "mlp.shared_experts.linear_fc1",
        "mixer.shared_experts.gate_proj": "mlp.shared_experts.linear_fc1",
        "mixer.shared_experts.down_proj": "mlp.shared_experts.linear_fc2",
        "mixer.fc1_latent_proj": "mlp.fc1_latent_proj",
        "mixer.fc2_latent_proj": "mlp.fc2_latent_proj",
    }
    megatron_fields = (
        MegatronField("num_moe_experts", "model.moe.num_experts", lambda e: e.num_experts),
        MegatronField("moe_router_topk", "model.moe.top_k", lambda e: e.top_k),
        MegatronField(
            "moe_ffn_hidden_size",
            "model.moe.expert_intermediate_size",
            lambda e: e.expert_intermediate_size,
        ),
        MegatronField(
            "moe_shared_expert_intermediate_size",
            "model.moe.shared_expert_intermediate_size",
            lambda e: e.shared_expert_intermediate_size or None,
        ),
        MegatronField("moe_latent_size", "model.moe.latent_size", lambda e: e.latent_size),
        MegatronField(
            "moe_expert_capacity_factor", "model.moe.capacity_factor", lambda e: e.capacity_factor
        ),
        MegatronField(
            "moe_router_score_function",
            "model.moe.router.score_function",
            lambda e: e.router.score_function,
        ),
        MegatronField(
            "moe_router_pre_softmax",
            "model.moe.router.normalize_top_k",
            lambda e: e.router.score_function == "softmax" and not e.router.normalize_top_k,
        ),
        MegatronField(
            "moe_router_topk_scaling_factor",
            "model.moe.router.scaling_factor",
            lambda e: e.router.scaling_factor,
        ),
        MegatronField(
            "moe_router_enable_expert_bias",
            "model.moe.router.expert_bias",
            lambda e: e.router.expert_bias,
        ),
        MegatronField(
            "moe_router_bias_update_rate",
            "model.moe.router.expert_bias_update_rate",
            lambda e: e.router.expert_bias_update_rate,
        ),
        MegatronField(
            "moe_router_load_balancing_type",
            "model.moe.router.aux_loss",
            lambda e: e.router.aux_loss,
        ),
        MegatronField(
            "moe_aux_loss_coeff",
            "model.moe.router.aux_loss_coeff",
            lambda e: e.router.aux_loss_coeff if e.router.aux_loss != "none" else 0.0,
        ),
        MegatronField(
            "moe_router_num_groups",
            "model.moe.router.num_groups",
            lambda e: e.router.num_groups,
            when=lambda e: e.router.num_groups > 1,
        ),
        MegatronField(
            "moe_router_group_topk",
            "model.moe.router.group_top_k",
            lambda e: e.router.group_top_k,
            when=lambda e: e.router.num_groups > 1,
        ),
        MegatronField("moe_router_dtype", "(router runs in fp32)", lambda e: "fp32"),
        MegatronField("moe_grouped_gemm", "(experts are grouped GEMMs)", lambda e: True),
        # Fields Megatron shares with the dense MLP.
        MegatronField(
            "ffn_hidden_size",
            "model.moe.expert_intermediate_size",
            lambda e: e.expert_intermediate_size,
            share="fallback",
        ),
        *megatron_activation_fields("model.moe.activation"),
        # Layout fields only the experts read.
        MegatronField(
            "moe_token_dispatcher_type",
            "parallelism.moe_dispatcher",
            lambda par: par.moe_dispatcher,
            reads="parallelism",
        ),
        MegatronField(
            "expert_tensor_parallel_size",
            "parallelism.etp",
            lambda par: par.expert_tp,
            reads="parallelism",
        ),
    )

    @layer_check("model.moe_top_k")
    def top_k_fits(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """A token cannot be routed to more experts than exist."""
        moe = bp.model.moe
        if moe is not None and moe.top_k > moe.num_experts:
            yield (
                "model.moe.top_k",
                f"top_k={moe.top_k} must be at most num_experts ({moe.num_experts})",
            )

    @layer_check("model.moe_latent_size")
    def latent_is_narrower(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """LatentMoE only saves anything when the latent is narrower than the model."""
        moe, d = bp.model.moe, bp.model.hidden_size
        if moe is not None and moe.latent_size is not None and moe.latent_size >= d:
            yield (
                "model.moe.latent_size",
                f"latent_size={moe.latent_size} must be smaller than hidden_size ({d})",
            )

    @layer_check("model.moe_router_groups")
    def router_groups(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """Group-limited routing: groups tile the experts and keep enough experts for top_k."""
        moe = bp.model.moe
        if moe is None:
            return
        groups, group_top_k = moe.router.num_groups, moe.router.group_top_k
        if moe.num_experts % groups:
            yield (
                "model.moe.router.num_groups",
                f"router num_groups={groups} must divide num_experts ({moe.num_experts})",
            )
        if group_top_k > groups:
            yield (
                "model.moe.router.group_top_k",
                f"router group_top_k={group_top_k} must be at most num_groups ({groups})",
            )
        elif moe.num_experts % groups == 0:
            reachable = group_top_k * (moe.num_experts // groups)
            if reachable < moe.top_k:
                yield (
                    "model.moe.router.group_top_k",
                    f"group_top_k*(num_experts/num_groups) = {group_top_k}*"
                    f"({moe.num_experts}/{groups}) = {reachable} experts are reachable, "
                    f"fewer than top_k ({moe.top_k})",
                )

    @layer_check("parallelism.flex_dispatcher")
    def flex_dispatcher(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """The flex (DeepEP) dispatcher needs a token exchange: etp*ep > 1."""
        par = bp.parallelism
        if par.moe_dispatcher == "flex" and par.expert_tp * par.ep <= 1:
            yield (
                "parallelism.moe_dispatcher",
                f"the flex dispatcher requires etp*ep > 1, got etp*ep = {par.expert_tp}*{par.ep}",
            )

    @layer_check("parallelism.moe_bias_etp")
    def biases_need_etp_1(self, bp: Blueprint) -> Iterator[LayerFinding]:
        """Linear biases with MoE layers need etp=1 (Megatron's one add_bias_linear covers
        experts)."""
        m, par = bp.model, bp.parallelism
        biased = [
            name
            for name, section in (("attention", m.attention), ("mlp", m.mlp))
            if section is not None and section.bias
        ]
        if self.used_by(m) and biased and par.expert_tp > 1:
            yield (
                "parallelism.etp",
                f"biases on linear layers (model.{', model.'.join(f'{b}.bias' for b in biased)}) "
                f"with MoE layers need etp=1, got etp={par.expert_tp}; Megatron-Core refuses "
                "'Bias in Moe is only supported when ETP==1'",
            )

    def eager_reason(self, block: nn.Module) -> str | None:
        """Where its dispatch is sync-free (``MoE.sync_problem`` is None: the
        ``torch._grouped_mm`` path, no quantized expert GEMMs, no expert-parallel all-to-all),
        every shape follows from ``T``, ``k`` and ``E``, and the block compiles as the others
        do; elsewhere the reason it does not."""
        return block.mixer.sync_problem()

    def mixer_tensors(self, model: ModelConfig, prefix: str) -> list[TensorSpec]:
        cfg: MoEConfig = self.config(model)
        d, experts, k = model.hidden_size, cfg.num_experts, cfg.top_k
        width, ff = cfg.latent_size or d, cfg.expert_intermediate_size
        router = [
            TensorSpec(
                f"{prefix}.gate.weight",
                (experts, d),
                Role.ROUTER,
                Init("normal"),
                fp32=True,
                gemm=Gemm(d, experts, quantizable=False),
            )
        ]
        if cfg.router.expert_bias:
            router.append(
                TensorSpec(
                    f"{prefix}.gate.e_score_correction_bias",
                    (experts,),
                    Role.ROUTER_BIAS,
                    Init("zeros"),
                    fp32=True,
                    trainable=False,
                )
            )
        routed = [
            expert_linear(
                f"{prefix}.experts.up_proj", experts, width, ff, k, "column", Init("normal")
            )
        ]
        if cfg.activation == "swiglu":
            routed.append(
                expert_linear(
                    f"{prefix}.experts.gate_proj", experts, width, ff, k, "column", Init("normal")
                )
            )
        routed.append(
            expert_linear(
                f"{prefix}.experts.down_proj", experts, ff, width, k, "row", Init("scaled_normal")
            )
        )
        shared = []
        if cfg.shared_expert_intermediate_size:
            shared = mlp_tensors(
                f"{prefix}.shared_experts",
                d,
                cfg.shared_expert_intermediate_size,
                cfg.activation,
                mlp_bias(model),
            )
        latent = []
        if cfg.latent_size:
            bias = mlp_bias(model)
            latent = [
                *linear(
                    f"{prefix}.fc1_latent_proj", d, width, bias=bias, tp="none", init=Init("normal")
                ),
                *linear(
                    f"{prefix}.fc2_latent_proj",
                    width,
                    d,
                    bias=bias,
                    tp="none",
                    init=Init("scaled_normal"),
                ),
            ]
        return [*router, *routed, *shared, *latent]

    def megatron_flops(self, model: ModelConfig, seq_len: int) -> int:
        """Megatron has one global SwiGLU flag; here the MoE section's own activation sets it."""
        cfg: MoEConfig = self.config(model)
        h, s, ff, k = model.hidden_size, seq_len, cfg.expert_intermediate_size, cfg.top_k
        if cfg.latent_size:
            routed = swiglu_factor(cfg.activation, 4 * s * cfg.latent_size * ff * k)
            routed += 4 * s * h * cfg.latent_size
        else:
            routed = swiglu_factor(cfg.activation, 4 * s * h * ff * k)
        return routed + swiglu_factor(
            cfg.activation, 4 * s * h * cfg.shared_expert_intermediate_size
        )

    def elementwise_values(self, model: ModelConfig) -> int:
        """The block's norm and residual add, the routed and shared activations, and the
        permutation of top_k copies of every token into expert order and back (each read
        and written)."""
        cfg: MoEConfig = self.config(model)
        width = cfg.latent_size or model.hidden_size
        routed = cfg.top_k * activation_values(cfg.expert_intermediate_size, cfg.activation)
        shared = activation_values(cfg.shared_expert_intermediate_size, cfg.activation)
        return 5 * model.hidden_size + routed + shared + 4 * cfg.top_k * width

    def dispatch_values(self, model: ModelConfig) -> int:
        """top_k copies of the token at the width experts run in (the latent one, if any)."""
        cfg: MoEConfig = self.config(model)
        return cfg.top_k * (cfg.latent_size or model.hidden_size)

    def selective_recompute(self, model: ModelConfig, seq_len: int) -> tuple[int, int]:
        """moe_act: the routed experts' activation runs again."""
        cfg: MoEConfig = self.config(model)
        return 0, cfg.top_k * activation_values(cfg.expert_intermediate_size, cfg.activation)

    def activation_bytes(self, model: ModelConfig, tokens: TokenShards, recompute: str) -> float:
        """Router scores (fp32), routed tokens x top_k at the expert width, expert
        intermediates (sharded over ETP), the combined latent and the shared expert.

        A rank's n/TP tokens (sequence parallel) fan out top_k times and the ETP group
        gathers them: n*top_k*ETP/TP routed tokens with ff/ETP-wide intermediates.
        moe_act recompute drops the routed activation output. The routed tokens, the
        activation outputs and the combined latent are GEMM inputs only: kept in the
        recipe's format.
        """
        cfg: MoEConfig = self.config(model)
        h, width = model.hidden_size, cfg.latent_size or model.hidden_size
        routed = tokens.n * cfg.top_k * tokens.etp / tokens.tp
        saved = (
            prologue_bytes(tokens, h)
            + FP32 * tokens.replicated(cfg.num_experts)
            + tokens.gemm_input * routed * width
        )
        ff_local = cfg.expert_intermediate_size / tokens.etp
        keep_act = recompute == "none"
        saved += ffn_bytes(tokens, routed * ff_local, cfg.activation, keep_act_output=keep_act)
        if cfg.latent_size:
            saved += tokens.gemm_input * tokens.replicated(cfg.latent_size)
        if cfg.shared_expert_intermediate_size:
            shared = tokens.sharded(cfg.shared_expert_intermediate_size)
            saved += ffn_bytes(tokens, shared, cfg.activation, keep_act_output=True)
        return saved

    def ep_rules(self, model: ModelConfig, ep: int) -> list[str]:
        """EP places whole experts on ranks, so it must divide the expert count."""
        experts = self.config(model).num_experts
        return [f"ep={ep} must divide num_experts ({experts})"] if experts % ep else []

    def etp_rules(self, model: ModelConfig, etp: int) -> list[str]:
        """ETP splits each expert's ffn: up (and gate) by columns, down by rows, so it must
        divide expert_intermediate_size (Megatron's grouped linears ``divide`` it)."""
        ff = self.config(model).expert_intermediate_size
        if ff % etp == 0:
            return []
        return [
            f"etp={etp} must divide model.moe.expert_intermediate_size ({ff}): each routed "
            f"expert's up/gate columns and down rows split over the expert-tensor-parallel ranks"
        ]

    def expert_parallel_problems(self, mixer: nn.Module, ep: int, etp: int) -> list[str]:
        cfg, problems = mixer.cfg, []
        experts, ff = cfg.num_experts, cfg.expert_intermediate_size
        if experts % ep:
            problems.append(
                f"{experts} routed experts cannot be split evenly over {ep} expert-parallel "
                f"ranks ({experts} % {ep} = {experts % ep}); choose an EP size that divides "
                f"{experts}"
            )
        if ff % etp:
            problems.append(
                f"routed experts of width {ff} cannot be split evenly over {etp} "
                f"expert-tensor-parallel ranks ({ff} % {etp} = {ff % etp}); choose an ETP size "
                f"that divides {ff}"
            )
        if mixer.dispatcher is not None:
            problems.append("already expert-parallel")
        return problems

    def apply_expert_parallel(
        self, mixer: nn.Module, expert_mesh: DeviceMesh, tensors: Mapping[str, TensorSpec]
    ) -> None:
        self.torch_side("expert_parallel").shard_experts(mixer, expert_mesh, tensors)

    def shrink(self, section: dict[str, Any], source: MoEConfig, proxy: ProxyScale) -> None:
        """32 experts if there were >= 32 (else all); top_k scaled with them but at least 2
        when the source routes to 2 or more: with one expert per token, normalised sigmoid
        weights are constant and the LM loss never trains the router. Widths scale to the
        nearest multiple of 8; latent keeps d / latent; router groups shrink to the largest
        divisor of the expert count not above them."""
        experts = PROXY_EXPERTS if source.num_experts >= PROXY_EXPERTS else source.num_experts
        top_k = max(min(2, source.top_k), half_up(source.top_k * experts / source.num_experts))
        section.update(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=nearest_multiple(
                source.expert_intermediate_size * proxy.scale, 8
            ),
        )
        if source.shared_expert_intermediate_size:
            shared = nearest_multiple(source.shared_expert_intermediate_size * proxy.scale, 8)
            section["shared_expert_intermediate_size"] = shared
        if source.latent_size is not None:
            section["latent_size"] = half_up(proxy.width * source.latent_size / proxy.source_width)
        groups = max(g for g in range(1, source.router.num_groups + 1) if experts % g == 0)
        section.setdefault("router", {}).update(
            num_groups=groups, group_top_k=min(source.router.group_top_k, groups)
        )

    def hf_refusals(self, model: ModelConfig) -> list[str]:
        cfg: MoEConfig = self.config(model)
        out = []
        if cfg.activation != "relu2":
            out.append("HF NemotronH experts are non-gated relu2 (model.moe.activation)")
        if cfg.router.score_function != "sigmoid":
            out.append("HF NemotronH routes with sigmoid scores (model.moe.router.score_function)")
        if not cfg.shared_expert_intermediate_size:
            out.append("HF NemotronH MoE always has a shared expert")
        return out

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        cfg: MoEConfig = self.config(model)
        router = cfg.router
        return {
            "intermediate_size": cfg.expert_intermediate_size,  # NemotronH's fallback width
            "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.expert_intermediate_size,
            "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "n_shared_experts": 1,
            "moe_latent_size": cfg.latent_size,
            "moe_shared_expert_overlap": False,
            "routed_scaling_factor": router.scaling_factor,
            "n_group": router.num_groups,
            "topk_group": router.group_top_k,
            "norm_topk_prob": router.normalize_top_k,
        }

    def from_hf(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_experts": cfg["n_routed_experts"],
            "top_k": cfg["num_experts_per_tok"],
            "expert_intermediate_size": cfg["moe_intermediate_size"],
            "shared_expert_intermediate_size": cfg.get("moe_shared_expert_intermediate_size", 0),
            "latent_size": cfg.get("moe_latent_size"),
            "router": {
                "score_function": "sigmoid",
                "expert_bias": True,
                "normalize_top_k": cfg.get("norm_topk_prob", True),
                "scaling_factor": cfg.get("routed_scaling_factor", 1.0),
                "num_groups": cfg.get("n_group", 1),
                "group_top_k": cfg.get("topk_group", 1),
            },
        }

    def megatron_refusals(self, model: ModelConfig) -> list[tuple[str, str]]:
        router = self.config(model).router
        out = []
        if (
            router.score_function == "sigmoid"
            and not router.normalize_top_k
            and model.moe.top_k > 1
        ):
            reason = "Megatron always renormalises sigmoid top-k scores"
            out.append(("model.moe.router.normalize_top_k", reason))
        if router.expert_bias and router.score_function != "sigmoid":
            out.append(("model.moe.router.expert_bias", "Megatron's expert bias needs sigmoid"))
        if mlp_bias(model):
            reason = (
                "the shared expert takes mlp.bias, and add_bias_linear would also put biases "
                "on the routed experts, which factory builds without"
            )
            out.append(("model.mlp.bias", reason))
        return out

    def hf_zero_tensors(self, model: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        cfg: MoEConfig = self.config(model)
        if cfg.router.expert_bias:
            return []
        return [(f"{prefix}.gate.e_score_correction_bias", (cfg.num_experts,))]

    def upcycle(
        self,
        mixer: nn.Module,
        source: Mapping[str, torch.Tensor],
        prefix: str,
        model: ModelConfig,
        generator: torch.Generator,
    ) -> None:
        """Experts cut from the dense MLP's hidden units, copies routed alike, so the layer
        starts as that MLP exactly (``upcycle.py`` has the construction)."""
        self.torch_side("upcycle").upcycle_moe(mixer, source, prefix, generator, model.init.std)
