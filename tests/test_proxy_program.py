"""The proxy of a program: one model for every stage, each stage's own data, layout and
schedule, at sequence lengths that keep the stages' ratio (``factory.proxy``'s rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

import factory
from factory.checks import run_rules
from factory.jobs.train import prepare_program
from factory.jobs.train_request import TrainSettings
from factory.proxy import derive_program_proxy, derive_proxy, proxy_stage_seq_lens
from factory.proxy_layout import derive_proxy_layout
from factory.schemas.blueprint import Blueprint
from factory.schemas.program import resolve_program


def nano_program() -> Blueprint:
    """Nano as four stages: two pretraining phases, long context on CP=8, then SFT."""
    data = factory.load_blueprint("nano").model_dump(exclude_unset=True)
    data["stages"] = [
        {"name": "phase1", "training": {"steps": 1000}},
        {"name": "phase2", "continue_schedule": True, "training": {"steps": 100}},
        {
            "name": "long_context",
            "data": {"seq_len": 262144},
            "parallelism": {"world_size": 64, "tp": 8, "cp": 8, "global_batch_size": 48},
            "training": {"steps": 10, "schedule": {"kind": "constant"}},
        },
        {"name": "sft", "data": {"seq_len": 16384}, "training": {"steps": 20}},
    ]
    return Blueprint.model_validate(data)


def test_the_shortest_stage_trains_at_256_and_longer_ones_by_their_ratio_capped() -> None:
    assert proxy_stage_seq_lens([8192, 8192, 262144, 16384]) == [256, 256, 1024, 512]
    assert proxy_stage_seq_lens([4096, 5000, 2048]) == [512, 512, 256]


def test_every_stage_of_a_program_trains_one_proxy_model() -> None:
    program = resolve_program(nano_program())
    proxies = derive_program_proxy([stage.blueprint for stage in program])
    assert len({proxy.model for proxy in proxies}) == 1
    assert [p.data.seq_len for p in proxies] == [256, 256, 1024, 512]
    assert [p.parallelism.micro_batch_size for p in proxies] == [2, 2, 1, 1]
    assert proxies[0].model.max_seq_len >= 1024
    for stage, proxy in zip(program, proxies, strict=True):
        assert not [f for _, f in run_rules(proxy) if f.severity == "error"], stage.name
        assert proxy.data.recipe == stage.blueprint.data.recipe
        assert proxy.training.schedule == stage.blueprint.training.schedule
        laid_out, _ = derive_proxy_layout(stage.blueprint, 2, proxy=proxy)
        assert laid_out.model == proxy.model  # the layout never changes the model
    laid_out, changes = derive_proxy_layout(program.stage("long_context").blueprint, 2,
                                            proxy=proxies[2])  # fmt: skip
    assert laid_out.parallelism.cp == 2 and "cp 8 -> 2" in changes


@pytest.mark.parametrize(
    ("steps", "windows"),
    [(None, [(0, 600), (300, 600), (0, 300), (0, 300)]), (5, [(0, 10), (5, 10), (0, 5), (0, 5)])],
)
def test_the_proxy_program_trains_each_stage_into_its_folder_on_its_schedule(
    tmp_path: Path, steps: int | None, windows: list[tuple[int, int]]
) -> None:
    """``--steps N`` is N per stage; a continued schedule spans the stages it joins;
    ``--data DIR`` is DIR/<stage>/ per stage."""
    settings = TrainSettings(out=tmp_path / "run", steps=steps, data=tmp_path / "data")
    request = prepare_program(nano_program(), settings, proxy=True, precision="off", world_size=1)
    assert request.names == ("phase1", "phase2", "long_context", "sft")
    got = [(r.stage.schedule_offset, r.stage.schedule_steps) for r in request.stages]  # type: ignore[union-attr]
    assert got == windows
    for name, one in zip(request.names, request.stages, strict=True):
        assert one.out == tmp_path / "run" / name
        assert one.settings.data == tmp_path / "data" / name
        assert one.blueprint.model == request.stages[0].blueprint.model


def test_the_proxy_of_a_program_blueprint_alone_is_its_base_without_stages() -> None:
    proxy = derive_proxy(nano_program())
    assert proxy.stages is None and proxy.data.seq_len == 256
