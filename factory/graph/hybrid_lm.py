"""The whole language model: embedding, the hybrid stack, final norm, head, and MTP.

The graph is built from the model spec (``factory.spec``), one block per
layer, and checked against it: every parameter's name and shape is the
spec's. ``model(input_ids)`` returns a :class:`~factory.nn.outputs.ModelOutput`.
Parameter names match the Hugging Face NemotronH checkpoints
(``backbone.layers.{i}.mixer...``, ``lm_head``, ``mtp.layers.{j}...``).
"""

from __future__ import annotations

import torch
from torch import nn

from factory.graph.blocks import Block
from factory.graph.loss import fused_head_problem
from factory.graph.mtp_head import MultiTokenPrediction
from factory.layers.model_spec import ModelSpec, model_spec
from factory.nn.decoding import DecodingCache, decoding_problem
from factory.nn.norms import RMSNorm
from factory.nn.outputs import DecodedStep, ModelOutput, collect_routing
from factory.nn.sequence_split import SequenceSplit
from factory.schemas.model import ModelConfig

__all__ = ["Backbone", "HybridLM", "SpecMismatch", "check_against_spec", "held_submodule"]


class SpecMismatch(RuntimeError):
    """The built graph's tensors differ from the model spec's (a bug in a layer type)."""


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec) -> None:
        super().__init__()
        # Given its (empty) weight, nn.Embedding skips its own N(0, 1) draw: the spec's init
        # rule sets the values (factory.graph.init), and on the meta device, where every model
        # is first built, torch's normal_ imports torch._dynamo, sympy and triton (~150 MiB).
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in spec.main_layers)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        routed: dict[str, torch.Tensor],
        aux: list[torch.Tensor],
        document_ids: torch.Tensor | None = None,
        rms: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden, out = layer(hidden, document_ids)
            collect_routing(routed, aux, layer.path, out)
            if rms is not None:  # one reduction per layer on the forward pass, no extra pass
                rms[layer.path] = hidden.detach().float().square().mean().sqrt()
        return hidden


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        spec = model_spec(cfg)
        self.backbone = Backbone(cfg, spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.mtp = MultiTokenPrediction(cfg, spec) if cfg.mtp_depth else None
        self.sequence_split: SequenceSplit | None = None
        """Set by context parallelism: this rank computes its chunks of every sequence."""
        check_against_spec(self, spec)

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        logits: bool = True,
    ) -> ModelOutput:
        """``document_ids`` [B, S] (``factory.nn.packed_documents``) keeps packed documents apart:
        each position's logits are those of its document run alone. Under context
        parallelism ``input_ids`` and ``document_ids`` are the whole sequence and the
        outputs are this rank's positions (``ModelOutput.positions``). ``logits=False``
        leaves the head to the fused loss (``factory.graph.loss``): the output carries the
        head's inputs and weight instead of logits, unless the head cannot be fused
        (``fused_head_problem``: a vocab-parallel head), which returns logits anyway."""
        routed: dict[str, torch.Tensor] = {}
        aux: list[torch.Tensor] = []
        rms: dict[str, torch.Tensor] = {}
        positions = None
        tokens = input_ids
        if self.sequence_split is not None:
            positions = self.sequence_split.positions(input_ids.shape[1], input_ids.device)
            tokens = input_ids[:, positions]
        hidden = self.backbone(tokens, routed, aux, document_ids, rms)
        fused = not logits and fused_head_problem(self.lm_head.weight) is None
        head = None if fused else self.lm_head
        normed = self.backbone.norm_f(hidden)
        mtp_rows: tuple[torch.Tensor, ...] = ()
        if self.mtp is not None:
            mtp_rows = self.mtp(
                hidden,
                input_ids,
                self.backbone.embeddings,
                head,
                routed,
                aux,
                document_ids,
                positions,
            )
        return ModelOutput(
            logits=None if fused else self.lm_head(normed),
            mtp_logits=() if fused else mtp_rows,
            head_inputs=(normed, *mtp_rows) if fused else (),
            head_weight=self.lm_head.weight if fused else None,
            aux_loss=torch.stack(aux).sum() if aux else None,
            tokens_per_expert=routed,
            hidden=hidden,
            residual_rms=rms,
            positions=positions,
        )

    def decoding_problems(self, with_mtp: bool = True) -> list[str]:
        """Why this model cannot decode incrementally, one line per block that cannot (its
        path and its mixer's reason), MTP blocks included ``with_mtp`` (self-speculation);
        empty where it can."""
        mtp = self.mtp.layers if self.mtp is not None and with_mtp else ()
        blocks = [*self.backbone.layers, *mtp]
        problems = []
        for block in blocks:
            problem = decoding_problem(block.mixer)
            if problem is not None:
                problems.append(f"{block.path}: {problem}")
        return problems

    def init_caches(self, batch: int, capacity: int) -> list[DecodingCache]:
        """Empty decoding caches of the main stack's blocks, for ``batch`` sequences of up to
        ``capacity`` positions (``factory.nn.decoding``)."""
        weight = self.backbone.embeddings.weight
        return [
            layer.mixer.init_cache(batch, capacity, weight.device, weight.dtype)
            for layer in self.backbone.layers
        ]

    def decode(self, input_ids: torch.Tensor, caches: list[DecodingCache]) -> DecodedStep:
        """The main stack over the next positions ``input_ids`` [B, T] after those in
        ``caches``, which they join: the logits and hidden states :meth:`forward` computes
        there over the whole sequence."""
        hidden = self.backbone.embeddings(input_ids)
        for layer, cache in zip(self.backbone.layers, caches, strict=True):
            hidden = layer.decode(hidden, cache)
        return DecodedStep(self.lm_head(self.backbone.norm_f(hidden)), hidden)

    @torch.no_grad()
    def update_expert_biases(self, tokens_per_expert: dict[str, torch.Tensor]) -> None:
        """Apply the aux-loss-free expert-bias step of every MoE layer, given the tokens each
        expert received over the optimizer step (summed over its micro-batches)."""
        for name, load in tokens_per_expert.items():
            mixer = self.get_submodule(f"{name}.mixer")
            mixer.update_expert_bias(load)  # only routing mixers report a load


def held_submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path`` (a full model's name), or None where ``model`` (a pipeline stage
    of one) does not hold it."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def check_against_spec(model: nn.Module, spec: ModelSpec) -> None:
    """Raise :class:`SpecMismatch` unless ``model``'s state_dict has exactly the spec's tensors,
    name for name and shape for shape."""
    built = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    declared = spec.shapes()
    if built == declared:
        return
    missing = sorted(declared.keys() - built.keys())
    extra = sorted(built.keys() - declared.keys())
    shapes = sorted(
        f"{name}: built {built[name]} vs spec {declared[name]}"
        for name in built.keys() & declared.keys()
        if built[name] != declared[name]
    )
    problems = [
        *(f"not built: {n}" for n in missing[:5]),
        *(f"not in the spec: {n}" for n in extra[:5]),
        *shapes[:5],
    ]
    raise SpecMismatch(
        f"the graph differs from the model spec ({len(missing)} missing, {len(extra)} extra, "
        f"{len(shapes)} mis-shaped): " + "; ".join(problems)
    )
