"""One residual block per pattern symbol, and the registry that maps symbols to mixers.

Every layer is ``x + mixer(norm(x))``: there is no separate MLP sub-block, each
pattern character is one whole residual block (as in Megatron's hybrid model
and the Hugging Face checkpoints, whose keys are ``layers.{i}.norm`` and
``layers.{i}.mixer.*``). A new layer type registers a builder here and needs
no change anywhere else in the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from factory.graph.attention import Attention
from factory.graph.mamba import Mamba2Mixer
from factory.graph.mlp import MLP
from factory.graph.moe import MoE
from factory.graph.norms import RMSNorm
from factory.schemas.model import ModelConfig

__all__ = ["MIXERS", "Block", "build_mixer"]

MixerBuilder = Callable[[ModelConfig], nn.Module]
MIXERS: dict[str, MixerBuilder] = {}


def register(symbol: str) -> Callable[[MixerBuilder], MixerBuilder]:
    def wrap(builder: MixerBuilder) -> MixerBuilder:
        MIXERS[symbol] = builder
        return builder

    return wrap


def _required(section: object, symbol: str) -> object:
    if section is None:  # the model rules reject this before compile; keep a clear message
        raise ValueError(f"pattern symbol {symbol!r} needs its model section")
    return section


@register("M")
def _mamba(cfg: ModelConfig) -> nn.Module:
    return Mamba2Mixer(cfg.hidden_size, _required(cfg.mamba, "M"), cfg.norm_eps)  # type: ignore[arg-type]


@register("*")
def _attention(cfg: ModelConfig) -> nn.Module:
    rope = (cfg.rope_base, cfg.rope_fraction) if cfg.position_embedding == "rope" else None
    return Attention(cfg.hidden_size, _required(cfg.attention, "*"), rope)  # type: ignore[arg-type]


@register("-")
def _mlp(cfg: ModelConfig) -> nn.Module:
    mlp = _required(cfg.mlp, "-")
    return MLP(cfg.hidden_size, mlp.intermediate_size, mlp.activation, mlp.bias)  # type: ignore[attr-defined]


@register("E")
def _moe(cfg: ModelConfig) -> nn.Module:
    mlp_bias = cfg.mlp.bias if cfg.mlp is not None else False
    return MoE(cfg.hidden_size, _required(cfg.moe, "E"), mlp_bias)  # type: ignore[arg-type]


def build_mixer(cfg: ModelConfig, symbol: str) -> nn.Module:
    return MIXERS[symbol](cfg)


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``."""

    def __init__(self, cfg: ModelConfig, symbol: str) -> None:
        super().__init__()
        self.symbol = symbol
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = build_mixer(cfg, symbol)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))
