"""CPU proxies: a few-million-parameter blueprint of the same family, from one knob.

:func:`derive_proxy` shrinks a blueprint to ``width`` (the proxy's hidden size,
default 256) and derives everything else from ``s = width / hidden_size``. The
proxy keeps every layer type, the rhythm of the pattern, the GQA ratio, the
top-k and expert ratios, the latent ratio, MTP and the precision policy, and
passes every rule of ``factory.checks`` without a finding. The rule:

* **Pattern.** Drop ``|`` (the proxy is pp=1). Cut the main stack into periods,
  each ending at a layer whose type ends one (``LayerType.ends_period``: attention
  ``*``; the remainder is a period too); keep the first two (none ends a period: the
  first min(len, 8) layers), append the stack's last layer unless the proxy already
  ends with it, then one layer of each type still missing. MTP is kept as written:
  the ``/`` segments or ``model.mtp`` as is.
* **Layer sections.** Each layer type shrinks its own section
  (``LayerType.shrink`` in ``factory.layers``):

  - attention: r = heads / kv_heads is kept: kv_heads = 1 if r >= 8 else
    min(kv_heads, 2); heads = r * kv_heads; head_dim is the multiple of 8
    (>= 8) nearest heads * head_dim * s / proxy heads;
  - Mamba: head_dim 16, state_size 16, chunk_size 16, groups min(groups, 2);
    heads is the multiple of groups (>= groups) nearest d_inner * s / 16, of
    lcm(groups, 16) under a quantised recipe (in_proj must be 16-aligned there);
    other fields are kept;
  - MLP and MoE: every intermediate width (dense, expert, shared) is the
    multiple of 8 (>= 8) nearest width * s. Experts: 32 if there were >= 32
    (else all); top_k = round(top_k * experts / num_experts), at least 2 when
    the source routes to 2 or more, which keeps top_k / num_experts to
    rounding; latent_size = width * latent / hidden keeps d / latent. The router
    is kept, its groups reduced to the largest divisor of the expert count not
    above them and group_top_k capped at the groups.
* **Rest.** vocab_size min(vocab, 4096) (the small tokenizer), max_seq_len
  min(max_seq_len, 4096), init std kept (no checkpoint or upcycling source: their
  weights have the full-size shapes). Precision: recipe, options, overrides and
  switch_to_bf16 verbatim; high_precision first/last scaled by proxy layers /
  layers (half up, >= 1 when non-zero), explicit indices mapped by the same
  proportion (floor) and de-duplicated. One rank (tp=cp=pp=ep=1, no
  sequence parallelism), micro batch 2, global batch 8, gpu, recompute and
  distributed optimizer kept (a flex dispatcher becomes alltoall: no exchange
  on one rank). Data: same recipe, seq_len 256, tokens = 300 * 8 * 256; a
  blueprint with context parallelism (cp > 1) keeps its seq_len (and max_seq_len
  at least that) and trains one sequence per micro-batch: long sequences are
  what CP is for, and what its proxy checks (two 32k-token sequences of the Nano
  proxy hold about 12 GB of activations per CP=2 rank, measured).
  Training: 300 steps, checkpoints every 100, optimizer, schedule and seed kept.
  Meta: ``{name}-proxy``, "CPU proxy of ..." and no hf_id.
* **Programs.** Every stage of a blueprint with ``stages`` trains one model, so its
  proxies share one (:func:`derive_program_proxy`): each stage's proxy is derived as
  above, then all take the model of the first stage that quantizes (the proxy's Mamba
  widths are aligned for it; else of the first stage). Sequence lengths keep the stages'
  ratio to the power of two nearest it: the shortest stage trains at 256, a stage 2**k
  times longer at 256 * 2**k, capped at 1024 (a 512k long-context stage after 8k
  pretraining trains at 1024, four times the pretraining proxy's, and stays fast on a
  CPU); ``max_seq_len`` covers the longest. A stage's micro-batch is 1 above 256.

Why 32 experts: with 64 of width 176 the Nano proxy has 40M parameters; 32 keep it
near 23M, small enough for CPU training. Why at least top-2: with one expert per
token, normalised sigmoid weights are a constant and the router learns nothing
from the language-model loss. Worked results (``factory plan nano --proxy``):

=================  ==========================  ==========================
                   Nano (2688 -> 256)          Super (4096 -> 256)
=================  ==========================  ==========================
pattern            ``MEMEM*EMEMEM*E`` (14)     ``MEMEMEM*EMEMEMEM*E`` (18)
attention          16 heads / 1 kv x 24        16 heads / 1 kv x 16
mamba              24 heads x 16, 2 groups     32 heads x 16, 2 groups
moe                32 experts, top 2,          32 experts, top 2,
                   expert 176, shared 352      expert 168, shared 336,
                                               latent 64
mtp, precision     none, bf16                  2 x ``*E`` repeated, nvfp4,
                                               last 3 layers bf16
parameters         22,871,792                  14,132,768
=================  ==========================  ==========================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from factory.precision.policy import uses_low_precision
from factory.schemas.blueprint import Blueprint
from factory.spec.layer_type import LAYER_TYPES, ProxyScale, layer_type
from factory.spec.rounding import half_up

__all__ = ["derive_program_proxy", "derive_proxy", "proxy_pattern", "proxy_stage_seq_lens"]

PROXY_STEPS, PROXY_GLOBAL_BATCH, PROXY_MICRO_BATCH, PROXY_SEQ_LEN = 300, 8, 2, 256
PROXY_VOCAB, PROXY_MAX_SEQ_LEN, PROXY_CHECKPOINT_INTERVAL = 4096, 4096, 100
PROXY_STAGE_MAX_SEQ_LEN = 1024
"""The longest sequence a program stage's proxy trains on (a long-context stage's)."""


def proxy_pattern(main: str) -> str:
    """The proxy's main stack from the source's (``|`` already dropped)."""
    ends = [i + 1 for i, symbol in enumerate(main) if layer_type(symbol).ends_period]
    # Two periods; a stack of one period whole; a stack without periods: its first 8 layers.
    kept = main[: ends[1] if len(ends) > 1 else len(main) if ends else 8]
    if not kept.endswith(main[-1]):
        kept += main[-1]
    for symbol in dict.fromkeys(main):  # missing types, in order of first appearance
        if symbol not in kept:
            kept += symbol
    return kept


def _scale_layers(count: int, proxy_layers: int, layers: int) -> int:
    return max(1, half_up(count * proxy_layers / layers)) if count else 0


def _shrink_sections(bp: Blueprint, model: dict[str, Any], width: int) -> None:
    """Each layer type shrinks its own section (``factory.layers``)."""
    src = bp.model
    proxy = ProxyScale(
        width=width,
        source_width=src.hidden_size,
        scale=width / src.hidden_size,
        quantized=uses_low_precision(bp),
    )
    for kind in LAYER_TYPES.values():
        source = getattr(src, kind.section) if kind.section is not None else None
        if source is not None:
            kind.shrink(model[kind.section], source, proxy)


def derive_proxy(bp: Blueprint, width: int = 256) -> Blueprint:
    """A CPU-sized blueprint of ``bp``'s family; the rule is the module docstring. Of a
    program, the proxy of its base sections alone: :func:`derive_program_proxy` gives each
    stage's."""
    src = bp.model
    data: dict[str, Any] = bp.model_dump(exclude_unset=True)
    data.pop("stages", None)  # a program's stages have proxies of their own
    model: dict[str, Any] = data["model"]

    main = proxy_pattern(src.parsed_pattern.main)
    model["pattern"] = "/".join((main, *src.parsed_pattern.mtp))
    model["hidden_size"] = width
    model["vocab_size"] = min(src.vocab_size, PROXY_VOCAB)
    # Context parallelism exists for long sequences: its proxy keeps them.
    seq_len = bp.data.seq_len if bp.parallelism.cp > 1 else PROXY_SEQ_LEN
    model["max_seq_len"] = max(min(src.max_seq_len, PROXY_MAX_SEQ_LEN), seq_len)
    model["init"] = {"std": src.init.std}
    _shrink_sections(bp, model, width)

    hp, layers = bp.precision.high_precision, src.num_layers
    data.setdefault("precision", {})["high_precision"] = {
        "first": _scale_layers(hp.first, len(main), layers),
        "last": _scale_layers(hp.last, len(main), layers),
        "layers": list(dict.fromkeys(i * len(main) // layers for i in hp.layers)),
    }

    par = bp.parallelism
    data["parallelism"] = {
        "world_size": 1,
        "gpu": par.gpu,
        "micro_batch_size": PROXY_MICRO_BATCH if seq_len == PROXY_SEQ_LEN else 1,
        "global_batch_size": PROXY_GLOBAL_BATCH,
        "distributed_optimizer": par.distributed_optimizer,
        "recompute": par.recompute,
        "moe_dispatcher": "alltoall" if par.moe_dispatcher == "flex" else par.moe_dispatcher,
    }
    tokens = PROXY_STEPS * PROXY_GLOBAL_BATCH * seq_len
    data["data"].update(seq_len=seq_len, tokens=tokens)
    data["training"].update(steps=PROXY_STEPS, checkpoint_interval=PROXY_CHECKPOINT_INTERVAL)
    data["training"].pop("tokens", None)

    meta = data["meta"]
    meta["name"] = f"{bp.meta.name}-proxy"
    meta["description"] = f"CPU proxy of {bp.meta.description or bp.meta.name}"
    meta.pop("hf_id", None)
    return Blueprint.model_validate(data)


def proxy_stage_seq_lens(seq_lens: Sequence[int]) -> list[int]:
    """The proxy's sequence length for stages of ``seq_lens``: the shortest at 256, the
    others by the power of two nearest their ratio to it, at most 1024."""
    shortest = min(seq_lens)
    return [
        min(PROXY_STAGE_MAX_SEQ_LEN, PROXY_SEQ_LEN * 2 ** max(0, round(math.log2(n / shortest))))
        for n in seq_lens
    ]


def derive_program_proxy(stages: Sequence[Blueprint], width: int = 256) -> list[Blueprint]:
    """The proxy of each of a program's stage blueprints (``ProgramStage.blueprint``, in
    order): one model for all, each stage's own data, layout, precision and training, at
    the sequence lengths of :func:`proxy_stage_seq_lens` (the module docstring's rule)."""
    proxies = [derive_proxy(bp, width) for bp in stages]
    seq_lens = proxy_stage_seq_lens([bp.data.seq_len for bp in stages])
    source = next((i for i, bp in enumerate(stages) if uses_low_precision(bp)), 0)
    model = proxies[source].model_dump(exclude_unset=True)["model"]
    model["max_seq_len"] = max(min(model["max_seq_len"], PROXY_MAX_SEQ_LEN), *seq_lens)
    out = []
    for proxy, seq_len in zip(proxies, seq_lens, strict=True):
        data = proxy.model_dump(exclude_unset=True)
        data["model"] = model
        batch = proxy.parallelism.global_batch_size
        data["data"].update(seq_len=seq_len, tokens=proxy.training_steps * batch * seq_len)
        micro = PROXY_MICRO_BATCH if seq_len == PROXY_SEQ_LEN else 1
        data["parallelism"]["micro_batch_size"] = micro
        out.append(Blueprint.model_validate(data))
    return out
