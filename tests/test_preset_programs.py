"""The presets' programs state the published Nemotron 3 recipes (docs/stages.md): each stage's
tokens, sequence length, batch, layout and schedule as the sources give them."""

from __future__ import annotations

import pytest

import factory
from factory.runtime.schedule import learning_rate
from factory.schemas.program import Program, resolve_program

NANO_PRETRAIN_TOKENS = 25 * 10**12


def program(name: str) -> Program:
    return resolve_program(factory.load_blueprint(name))


def test_nano_is_two_pretraining_phases_long_context_and_sft() -> None:
    phase1, phase2, long_context, sft = program("nano")
    assert [s.name for s in (phase1, phase2, long_context, sft)] == [
        "phase1",
        "phase2",
        "long_context",
        "sft",
    ]
    # 23.5T + 1.5T at 8192 x 3072: phase 2 starts at 94% of the pretraining tokens
    assert phase1.blueprint.training_tokens == 23_500 * 10**9
    assert phase2.blueprint.training_tokens == 1_500 * 10**9
    start = phase1.steps / (phase1.steps + phase2.steps)
    assert start == pytest.approx(0.94, abs=1e-4)
    for stage in (phase1, phase2):
        assert (stage.blueprint.data.seq_len, stage.blueprint.tokens_per_step) == (
            8192,
            8192 * 3072,
        )
    # one WSD schedule across the two phases: phase 2 goes on where phase 1 stopped
    assert (phase2.schedule_offset, phase2.schedule_steps) == (
        phase1.steps,
        phase1.steps + phase2.steps,
    )
    # long-context: 121B tokens at 512k, GBS 48, CP = TP = EP = 8, PP = 4, LR 1e-5 constant
    lc = long_context.blueprint
    assert (lc.data.seq_len, lc.training_tokens) == (524288, 121 * 10**9)
    par = lc.parallelism
    assert (par.cp, par.tp, par.ep, par.pp, par.global_batch_size) == (8, 8, 8, 4, 48)
    rates = {learning_rate(s, long_context.steps, lc.training) for s in (0, long_context.steps - 1)}
    assert rates == {1e-5}
    # SFT: 13,000 steps of batch 64 packed to 256k, 800 warmup steps, assistant turns only
    tuned = sft.blueprint
    assert (tuned.training_steps, tuned.parallelism.global_batch_size) == (13000, 64)
    assert tuned.data.seq_len == 262144
    assert round(tuned.training.schedule.warmup_fraction * 13000) == 800
    assert tuned.training.objective.kind == "sft"
    assert not sft.carry.optimizer


def test_super_decays_across_phase_two_and_averages_sft_loss_per_conversation_last() -> None:
    stages = program("super")
    assert stages.names == [
        "phase1",
        "phase2",
        "long_context",
        "long_context_mixed",
        "sft",
        "sft_per_conversation",
        "sft_budget",
    ]
    assert stages.stage("sft_budget").steps == 350
    phase1, phase2 = stages.stages[:2]
    total = phase1.steps + phase2.steps
    training = phase2.blueprint.training
    # the minus-sqrt decay 4.5e-4 -> 4.5e-6 is phase 2 (the last 20%)
    assert phase2.steps / total == pytest.approx(0.2, abs=1e-4)
    assert learning_rate(phase1.steps - 1, total, training) == 4.5e-4
    assert learning_rate(total - 1, total, training) == pytest.approx(4.5e-6)
    assert learning_rate(phase1.steps + 1, total, training) < 4.5e-4
    lc1, lc2 = stages.stage("long_context"), stages.stage("long_context_mixed")
    assert (lc1.blueprint.data.seq_len, lc1.blueprint.training_tokens) == (1048576, 34 * 10**9)
    assert lc2.blueprint.training_tokens == 17 * 10**9 and lc2.carry.data_position
    par = lc1.blueprint.parallelism
    assert (par.cp, par.tp, par.ep, par.global_batch_size) == (64, 2, 64, 16)
    averages = [
        stages.stage(n).blueprint.training.objective.loss_average
        for n in ("sft", "sft_per_conversation")
    ]
    assert averages == ["token", "conversation"]


def test_ultra_sft_is_packed_to_294912_with_its_cosine_schedule() -> None:
    stages = program("ultra")
    phase1, phase2 = stages.stages[:2]
    assert phase1.blueprint.training_tokens == 15 * 10**12
    assert phase2.blueprint.training_tokens == 5 * 10**12
    lc = stages.stage("long_context").blueprint
    par = lc.parallelism
    assert (lc.data.seq_len, par.cp, par.tp, par.ep, par.pp) == (1048576, 32, 8, 128, 2)
    sft = stages.stage("sft")
    tuned = sft.blueprint
    assert (tuned.data.seq_len, tuned.parallelism.global_batch_size) == (294912, 64)
    assert tuned.training_steps * 64 == 204_800  # samples
    assert round(tuned.training.schedule.warmup_fraction * tuned.training_steps) * 64 == 9600
    assert learning_rate(149, sft.steps, tuned.training) == pytest.approx(1.5e-5)
    assert learning_rate(sft.steps - 1, sft.steps, tuned.training) == pytest.approx(1e-6)


@pytest.mark.parametrize("name", ["nemotron_h_8b", "nemotron_nano_9b_v2"])
def test_the_dense_presets_keep_one_stage(name: str) -> None:
    stages = program(name)
    assert len(stages) == 1 and not stages.declared


@pytest.mark.parametrize("name", ["nano", "super", "ultra"])
def test_every_stage_trains_the_one_model(name: str) -> None:
    stages = program(name)
    first = stages.stages[0].blueprint.model
    assert all(s.blueprint.model == first for s in stages)
