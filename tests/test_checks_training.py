"""factory.checks.training_rules: each rule fires on a bad value and stays silent on the base.

The base trains 100 steps of 16 x 1024 tokens on a 1B-token mixture.
"""

from __future__ import annotations

import pytest
from blueprint_factory import DELETE, assert_fires, findings, make

from factory.checks import RULES, training_rules

TRAINING_RULES = sorted(
    name for name, r in RULES.items() if r.check.__module__ == training_rules.__name__
)

# (rule, overrides, blamed path, numbers the message must name, severity)
CASES = [
    ("training.length", {"training.tokens": "1M"}, "training.tokens", ("100", "1000000"), "error"),
    (
        "training.seq_len_fits_model",
        {"data.seq_len": 8192},
        "data.seq_len",
        ("8192", "4096"),
        "error",
    ),
    (
        "training.schedule_fractions",
        {"training.schedule": {"warmup_fraction": 0.5, "decay_fraction": 0.6}},
        "training.schedule.decay_fraction",
        ("0.5", "0.6", "1.1"),
        "error",
    ),
    (
        "training.min_lr",
        {"training.optimizer": {"lr": 1e-4, "min_lr": 1e-3}},
        "training.optimizer.min_lr",
        ("0.001", "0.0001"),
        "error",
    ),
    (
        "training.epochs",
        {"training.steps": DELETE, "training.tokens": "2.5B"},
        "training.tokens",
        ("2500000000", "2.50 epochs"),
        "warning",
    ),
    (
        "training.epochs",
        {"training.steps": 122071},
        "training.steps",
        ("2000011264", "2.00 epochs"),
        "warning",
    ),
    (
        "training.at_least_one_step",
        {"training.steps": DELETE, "training.tokens": 1000},
        "training.tokens",
        ("1000", "16384"),
        "error",
    ),
    (
        "training.average_start",
        {"training.average": {"decay": 0.9, "start": 100}},
        "training.average.start",
        ("start=100", "100 steps", "99"),
        "error",
    ),
    (
        "training.eval_interval",
        {"training.eval": {"interval": 101}},
        "training.eval.interval",
        ("101", "100 steps"),
        "error",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "path", "numbers", "severity"), CASES)
def test_rule_fires(name, overrides, path, numbers, severity):
    assert_fires(name, make(**overrides), path, *numbers, severity=severity)


@pytest.mark.parametrize("name", TRAINING_RULES)
def test_rule_silent_on_base(name):
    assert findings(name, make()) == []


def test_every_training_rule_has_a_firing_case():
    assert {case[0] for case in CASES} == set(TRAINING_RULES)


def test_whole_steps_of_tokens_are_silent():
    bp = make(**{"training.steps": DELETE, "training.tokens": 16384 * 50})
    assert findings("training.at_least_one_step", bp) == []
    assert findings("training.length", bp) == []


def test_cosine_schedule_ignores_decay_fraction():
    bp = make(
        **{"training.schedule": {"kind": "cosine", "warmup_fraction": 0.5, "decay_fraction": 0.6}}
    )
    assert findings("training.schedule_fractions", bp) == []
