"""Parameter initialisation.

Linear, embedding, router and expert weights draw from N(0, std). The
projections that write into the residual stream (attention o_proj, Mamba
out_proj, MLP/expert down_proj) use std / sqrt(2 * layers), Megatron's
"scaled init", so the residual variance does not grow with depth. Norm weights
are 1, biases 0, the expert bias 0, and the Mamba SSM parameters follow
Mamba-2's own rule.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from factory.graph.mamba import Mamba2Mixer
from factory.graph.model import HybridLM
from factory.graph.moe import RoutedExperts, Router
from factory.graph.norms import GatedGroupRMSNorm, RMSNorm

__all__ = ["initialize"]

_RESIDUAL_WRITERS = ("o_proj", "out_proj", "down_proj", "fc2_latent_proj")


@torch.no_grad()
def initialize(model: HybridLM, std: float, generator: torch.Generator) -> None:
    layers = len(model.cfg.layout.main) + len(model.cfg.mtp_pattern) * model.cfg.mtp_stored_blocks
    scaled = std / math.sqrt(2 * max(layers, 1))

    def normal(t: torch.Tensor, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).mul_(s).to(t.dtype))

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal(module.weight, scaled if leaf in _RESIDUAL_WRITERS else std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Conv1d):
            # PyTorch's default conv init (kaiming-uniform over the kernel), drawn from our generator.
            bound = 1 / math.sqrt(module.weight.shape[1] * module.weight.shape[2])
            module.weight.copy_(
                torch.rand(module.weight.shape, generator=generator) * 2 * bound - bound
            )
            if module.bias is not None:
                module.bias.copy_(
                    torch.rand(module.bias.shape, generator=generator) * 2 * bound - bound
                )
        elif isinstance(module, Router):
            normal(module.weight, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, RoutedExperts):
            normal(module.up_proj, std)
            normal(module.down_proj, scaled)
            if module.gate_proj is not None:
                normal(module.gate_proj, std)
        elif isinstance(module, (RMSNorm, GatedGroupRMSNorm)):
            module.weight.fill_(1.0)
        if isinstance(module, Mamba2Mixer):
            module.reset_ssm_parameters(generator)
