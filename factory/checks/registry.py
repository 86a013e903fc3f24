"""The rule registry: every cross-field check, by name.

A rule is a function from a validated :class:`Blueprint` to the findings it
makes. Rules register themselves with :func:`rule`, so adding one never
touches a central switch, and ``factory validate --rules`` can list them.
Each finding names its rule and the numbers involved. A program rule
(:func:`program_rule`) sees a program's stages together, for what concerns a
stage's place in the program rather than one blueprint. The rule modules are
listed in ``factory/checks/__init__.py``, which imports them all: importing any
module of ``factory.checks`` registers every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

from factory.schemas.blueprint import Blueprint
from factory.schemas.precision_recipes import (
    PRECISION_RECIPES,
    PrecisionRecipe,
    RecipeCheck,
    recipes_revision,
)
from factory.schemas.program import Program
from factory.spec.layer_type import LAYER_TYPES, LayerType, registry_revision

__all__ = [
    "PROGRAM_RULES",
    "RULES",
    "Finding",
    "ProgramRule",
    "Rule",
    "layer_checks",
    "layer_rule",
    "program_rule",
    "recipe_checks",
    "rule",
    "run_rules",
    "sync_registered_rules",
]


@dataclass(frozen=True)
class Finding:
    """A rule's verdict on one value."""

    path: str
    message: str
    severity: Literal["error", "warning"] = "error"


RuleFn = Callable[[Blueprint], Iterator[Finding]]
LayerRuleFn = Callable[[LayerType, Blueprint], Iterator[Finding]]
LayerCheckFn = Callable[..., Iterator[Finding]]
"""``fn(kind, bp=..., check=...)``: runs one of a layer type's declared checks."""


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    check: RuleFn


RULES: dict[str, Rule] = {}

StageFinding = tuple[int, Finding]
"""A program rule's verdict: the index of the stage and the finding, at a path of that
stage's blueprint."""
ProgramRuleFn = Callable[[Program], Iterator[StageFinding]]


@dataclass(frozen=True)
class ProgramRule:
    name: str
    summary: str
    check: ProgramRuleFn


PROGRAM_RULES: dict[str, ProgramRule] = {}


def program_rule(name: str) -> Callable[[ProgramRuleFn], ProgramRuleFn]:
    """Register a check of a whole program under ``name``; its docstring's first line is its
    summary. Validate runs it once per blueprint, after the rules of every stage."""

    def register(fn: ProgramRuleFn) -> ProgramRuleFn:
        if name in PROGRAM_RULES or name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        PROGRAM_RULES[name] = ProgramRule(name=name, summary=summary, check=fn)
        return fn

    return register


def rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register a check under ``name``; its docstring's first line is its summary."""

    def register(fn: RuleFn) -> RuleFn:
        if name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        RULES[name] = Rule(name=name, summary=summary, check=fn)
        return fn

    return register


_LayerRules = Callable[[LayerType], list[Rule]]
"""A family of layer rules: the rules it makes for one registered layer type."""
_LAYER_RULES: list[_LayerRules] = []
_RECIPE_RULES: list[Callable[[PrecisionRecipe], list[Rule]]] = []
"""The same for precision recipes (``factory.schemas.precision_recipes``)."""
_synced: tuple[int, ...] | None = None  # registry revisions and families at the last sync
_FROM_LAYERS: set[str] = set()  # the rules the families made, layer types' and recipes'


def layer_rule(
    prefix: str, applies: Callable[[LayerType], bool], summary: Callable[[LayerType], str]
) -> Callable[[LayerRuleFn], LayerRuleFn]:
    """Register a check that runs once for each layer type it ``applies`` to, as the rule
    ``<prefix>_<layer name>``: a layer type registered later (``factory.layers``, or a
    test's) gets its rule without touching this package."""

    def register(fn: LayerRuleFn) -> LayerRuleFn:
        def rules(kind: LayerType) -> list[Rule]:
            if not applies(kind):
                return []
            return [Rule(f"{prefix}_{kind.name}", summary(kind), _bind(fn, kind, kind.name))]

        _LAYER_RULES.append(rules)
        sync_registered_rules()
        return fn

    return register


def layer_checks(fn: LayerCheckFn) -> LayerCheckFn:
    """Register ``fn(kind, check, bp)`` as the runner of every check a layer type declares
    (``factory.spec.layer_type.layer_check``), each as a rule of the check's own name."""

    def rules(kind: LayerType) -> list[Rule]:
        out = []
        for name, check in kind.checks():
            summary = (check.__doc__ or name).strip().splitlines()[0]
            bound = _bind(partial(fn, check=check), kind, name)
            out.append(Rule(name, summary, bound))
        return out

    _LAYER_RULES.append(rules)
    sync_registered_rules()
    return fn


def recipe_checks(fn: Callable[..., Iterator[Finding]]) -> Callable[..., Iterator[Finding]]:
    """Register ``fn(recipe, bp, check)`` as the runner of every check a precision recipe
    declares (``PrecisionRecipe.checks``), each as a rule of the check's own name."""

    def rules(recipe: PrecisionRecipe) -> list[Rule]:
        return [
            Rule(c.name, _summary(c), _bind(partial(fn, check=c), recipe, c.name))
            for c in recipe.checks
        ]

    _RECIPE_RULES.append(rules)
    sync_registered_rules()
    return fn


def _summary(check: RecipeCheck) -> str:
    return (check.check.__doc__ or check.name).strip().splitlines()[0]


def sync_registered_rules() -> None:
    """Give :data:`RULES` the rules every family makes for every registered layer type and
    precision recipe, and none for those no longer registered."""
    global _synced
    state = (registry_revision(), recipes_revision(), len(_LAYER_RULES), len(_RECIPE_RULES))
    if _synced == state:
        return
    wanted: dict[str, Rule] = {}
    for family in _LAYER_RULES:
        for kind in sorted(LAYER_TYPES.values(), key=lambda kind: kind.name):
            for made in family(kind):
                wanted[made.name] = RULES.get(made.name) or made
    for recipe_family in _RECIPE_RULES:
        for recipe in PRECISION_RECIPES.values():
            for made in recipe_family(recipe):
                wanted[made.name] = RULES.get(made.name) or made
    for name in _FROM_LAYERS - set(wanted):
        del RULES[name]
    RULES.update((name, r) for name, r in wanted.items() if name not in RULES)
    _FROM_LAYERS.clear()
    _FROM_LAYERS.update(wanted)
    _synced = state


def _bind(
    check: Callable[..., Iterator[Finding]], kind: LayerType | PrecisionRecipe, label: str
) -> RuleFn:
    def bound(bp: Blueprint) -> Iterator[Finding]:
        return check(kind, bp=bp)

    runner = check.func if isinstance(check, partial) else check
    bound.__module__ = runner.__module__  # where the rule is run, as for plain rules
    bound.__qualname__ = f"{runner.__qualname__}[{label}]"
    return bound


def run_rules(bp: Blueprint) -> list[tuple[Rule, Finding]]:
    """Run every registered rule; findings come back in registration order.

    Every rule is registered by then: Python runs ``factory/checks/__init__.py``,
    which imports every rule module, before this module; layer types registered since
    get their layer rules here.
    """
    sync_registered_rules()
    return [(r, finding) for r in RULES.values() for finding in r.check(bp)]
