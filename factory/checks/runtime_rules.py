"""What factory's own training runtime cannot run, each condition written once.

Megatron runs some layouts that factory's runtime (``factory.distributed``,
``factory.runtime``) does not run yet. Each condition is a rule named
``runtime.*``, so ``factory validate`` reports it with its file and line: an
error where Megatron refuses the layout too, a warning where only factory's
runtime does (the blueprint still plans, and the layout search keeps it). :func:`runtime_refusals` returns the same findings as refusals; the launch
(``factory.jobs.launch.check_launch``) and the proxy's layout
(``factory.proxy_layout``) ask it, the layout search reports them
(``SearchResult.warnings``), and the runtime's own tensor-parallel check asks
:func:`sequence_parallel_problem`.

One condition depends on the precision backend, which a run chooses and a
blueprint does not say: Transformer Engine's linears under tensor parallelism
(:func:`transformer_engine_problem`). It is no validate rule; the launch asks it
for ``--precision te`` and ``factory.compile`` for ``auto``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from factory.checks.registry import RULES, Finding, RuleFn, rule
from factory.layers.model_spec import expert_layer_types
from factory.precision.backends import PrecisionBackend
from factory.precision.policy import uses_low_precision
from factory.schemas.blueprint import Blueprint
from factory.schemas.model import ModelConfig

__all__ = [
    "RUNTIME_RULES",
    "needs_sequence_parallel",
    "runtime_refusals",
    "sequence_parallel_problem",
    "transformer_engine_problem",
]

RUNTIME_RULES: list[str] = []
"""The names of the rules below, in the order they register: what :func:`runtime_refusals`
runs."""


def runtime_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register a check as the validate rule ``name`` and as one of :data:`RUNTIME_RULES`."""

    def register(fn: RuleFn) -> RuleFn:
        RUNTIME_RULES.append(name)
        return rule(name)(fn)

    return register


def needs_sequence_parallel(model: ModelConfig) -> bool:
    """Whether tensor parallelism needs sequence parallelism for ``model``: a layer with
    routed experts routes each TP rank's own part of the sequence."""
    return bool(expert_layer_types(model))


def sequence_parallel_problem(model: ModelConfig, tp: int, sequence_parallel: bool) -> str | None:
    """Why ``model`` cannot run on ``tp`` tensor-parallel ranks with ``sequence_parallel`` as
    given, or None. factory's tensor parallelism refuses MoE layers without sequence
    parallelism, and so does Megatron-Core's ``MoELayer.forward`` in training (whatever EP;
    its config only warns for TP with EP)."""
    if tp > 1 and not sequence_parallel and needs_sequence_parallel(model):
        return (
            f"tp={tp} with MoE layers needs sequence parallelism (each TP rank routes its "
            "own part of the sequence); use --set parallelism.sequence_parallel=true"
        )
    return None


@runtime_rule("runtime.moe_sequence_parallel")
def moe_sequence_parallel(bp: Blueprint) -> Iterator[Finding]:
    """MoE layers under TP need sequence parallelism (factory's runtime and Megatron alike)."""
    par = bp.parallelism
    problem = sequence_parallel_problem(bp.model, par.tp, par.sequence_parallel)
    if problem is not None:
        yield Finding("parallelism.sequence_parallel", problem)


@runtime_rule("runtime.context_across_stages")
def context_across_stages(bp: Blueprint) -> Iterator[Finding]:
    """factory's runtime does not run context parallelism across pipeline stages (Megatron does)."""
    par = bp.parallelism
    if par.cp > 1 and par.pp > 1:
        yield Finding(
            "parallelism.cp",
            f"parallelism.cp={par.cp} with pp={par.pp}: factory's runtime does not run context "
            "parallelism across pipeline stages yet (the Megatron export carries it); use "
            "--set parallelism.cp=1 or --set parallelism.pp=1",
            "warning",
        )


@runtime_rule("runtime.eval_pipeline")
def eval_pipeline(bp: Blueprint) -> Iterator[Finding]:
    """factory's runtime evaluates held-out sets through the model's forward pass, which a
    pipeline's stages do not have (they run through a schedule)."""
    pp = bp.parallelism.pp
    if bp.training.eval is not None and pp > 1:
        yield Finding(
            "training.eval",
            f"training.eval with parallelism.pp={pp}: factory's runtime does not evaluate "
            "held-out sets under pipeline parallelism yet; use --set parallelism.pp=1, or "
            "leave training.eval out and run factory eval on the checkpoints",
            "warning",
        )


@runtime_rule("runtime.module_layouts")
def module_layouts(bp: Blueprint) -> Iterator[Finding]:
    """factory's runtime does not run per-module (heterogeneous) layouts."""
    modules = bp.parallelism.modules
    if modules:
        yield Finding(
            "parallelism.modules",
            f"parallelism.modules ({', '.join(modules)}): per-module layouts are not run "
            "by factory's runtime",
            "warning",
        )


def transformer_engine_problem(bp: Blueprint) -> str | None:
    """Why factory's runtime cannot run ``bp``'s precision policy on Transformer Engine, or
    None: tensor parallelism does not split TE's linears yet."""
    tp = bp.parallelism.tp
    if tp > 1 and uses_low_precision(bp):
        return (
            f"--precision te with parallelism.tp={tp}: factory does not split Transformer "
            "Engine's linears yet; use --precision emulate (auto does under TP), or --set "
            "parallelism.tp=1"
        )
    return None


def runtime_refusals(
    bp: Blueprint, backend: PrecisionBackend = "auto"
) -> list[tuple[str | None, Finding]]:
    """What factory's runtime refuses in ``bp``'s layout with the precision ``backend``:
    every finding of :data:`RUNTIME_RULES` (a warning in ``factory validate`` is a refusal
    here), with its rule's name, then Transformer Engine's under ``te`` (no rule: None)."""
    refused: list[tuple[str | None, Finding]] = [
        (name, finding) for name in RUNTIME_RULES for finding in RULES[name].check(bp)
    ]
    te = transformer_engine_problem(bp) if backend == "te" else None
    if te is not None:
        refused.append((None, Finding("parallelism.tp", te)))
    return refused
