"""``-``: the dense MLP, squared-ReLU (Nemotron) or SwiGLU; also the MoE's shared expert.

Tensor parallelism splits up (and gate) by columns and down by rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from factory.spec.activations import TokenShards, ffn_bytes, prologue_bytes
from factory.spec.layer_type import LayerType, MegatronField, ProxyScale, Ref, register_layer_type
from factory.spec.rounding import nearest_multiple
from factory.spec.tensors import Init, TensorSpec, linear

if TYPE_CHECKING:
    from factory.schemas.model import MLPConfig, ModelConfig

__all__ = [
    "MEGATRON_ACTIVATIONS",
    "DenseMLP",
    "megatron_activation_fields",
    "mlp_tensors",
    "swiglu_factor",
]

MEGATRON_ACTIVATIONS = {
    "relu2": (Ref("megatron.core.activations.squared_relu"), False),
    "swiglu": (Ref("torch.nn.functional.silu"), True),
}
"""Our activation -> Megatron's (``activation_func``, ``gated_linear_unit``)."""


def megatron_activation_fields(blueprint: str) -> tuple[MegatronField, MegatronField]:
    """``activation_func`` and ``gated_linear_unit`` from a section's ``activation``: one pair
    of fields for the dense MLPs and the experts, which must agree. Megatron requires them
    even without either: Nemotron's relu2 then."""
    func, gated = MEGATRON_ACTIVATIONS["relu2"]
    return (
        MegatronField(
            "activation_func",
            blueprint,
            lambda s: MEGATRON_ACTIVATIONS[s.activation][0],
            share="agree",
            absent=func,
        ),
        MegatronField(
            "gated_linear_unit",
            blueprint,
            lambda s: MEGATRON_ACTIVATIONS[s.activation][1],
            share="agree",
            absent=gated,
        ),
    )


def mlp_tensors(
    prefix: str, width: int, hidden: int, activation: str, bias: bool
) -> list[TensorSpec]:
    """An MLP width -> hidden -> width: up (and gate when SwiGLU) then down, in module order."""
    normal = Init("normal")
    gate = (
        linear(f"{prefix}.gate_proj", width, hidden, bias=bias, tp="column", init=normal)
        if activation == "swiglu"
        else []
    )
    return [
        *linear(f"{prefix}.up_proj", width, hidden, bias=bias, tp="column", init=normal),
        *gate,
        *linear(
            f"{prefix}.down_proj", hidden, width, bias=bias, tp="row", init=Init("scaled_normal")
        ),
    ]


def swiglu_factor(activation: str, flops: int) -> int:
    """Megatron's formula counts a gated MLP as 1.5x the two-matrix one."""
    return flops * 3 // 2 if activation == "swiglu" else flops


def activation_values(width: int, activation: str) -> int:
    """Values the activation kernel reads and writes per token: relu2 reads fc1's output and
    writes fc2's input; swiglu reads both halves."""
    return width * (3 if activation == "swiglu" else 2)


@register_layer_type
class DenseMLP(LayerType):
    symbol = "-"
    name = "mlp"
    title = "MLP"
    section = "mlp"
    context_parallel = "token_wise"
    hf_block_type = "mlp"
    checkpoint_marker = "up_proj.weight"
    megatron_modules: ClassVar[dict[str, str]] = {  # Megatron fuses the gate into fc1
        "mixer.up_proj": "mlp.linear_fc1",
        "mixer.gate_proj": "mlp.linear_fc1",
        "mixer.down_proj": "mlp.linear_fc2",
    }
    megatron_fields = (
        MegatronField(
            "ffn_hidden_size",
            "model.mlp.intermediate_size",
            lambda m: m.intermediate_size,
            share="agree",
        ),
        *megatron_activation_fields("model.mlp.activation"),
        MegatronField(
            "add_bias_linear", "model.mlp.bias", lambda m: m.bias, share="agree", absent=False
        ),
    )

    def mixer_tensors(self, model: ModelConfig, prefix: str) -> list[TensorSpec]:
        cfg: MLPConfig = self.config(model)
        return mlp_tensors(
            prefix, model.hidden_size, cfg.intermediate_size, cfg.activation, cfg.bias
        )

    def megatron_flops(self, model: ModelConfig, seq_len: int) -> int:
        cfg: MLPConfig = self.config(model)
        return swiglu_factor(
            cfg.activation, 4 * seq_len * model.hidden_size * cfg.intermediate_size
        )

    def elementwise_values(self, model: ModelConfig) -> int:
        cfg: MLPConfig = self.config(model)
        return 5 * model.hidden_size + activation_values(cfg.intermediate_size, cfg.activation)

    def activation_bytes(self, model: ModelConfig, tokens: TokenShards, recompute: str) -> float:
        cfg: MLPConfig = self.config(model)
        ffn = ffn_bytes(tokens, tokens.sharded(cfg.intermediate_size), cfg.activation, True)
        return prologue_bytes(tokens, model.hidden_size) + ffn

    def shrink(self, section: dict[str, Any], source: MLPConfig, proxy: ProxyScale) -> None:
        section["intermediate_size"] = nearest_multiple(source.intermediate_size * proxy.scale, 8)

    def hf_refusals(self, model: ModelConfig) -> list[str]:
        if self.config(model).activation != "relu2":
            return ["HF NemotronH MLPs are non-gated relu2 (model.mlp.activation)"]
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        cfg: MLPConfig = self.config(model)
        return {"intermediate_size": cfg.intermediate_size, "mlp_bias": cfg.bias}

    def from_hf(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "intermediate_size": cfg.get("intermediate_size", 1),
            "bias": cfg.get("mlp_bias", False),
        }
