"""``factory plan --search`` (``factory.layout_search``): it returns only layouts that validate
and fit, fastest first, and never loses to a published Nemotron 3 Nano layout."""

from __future__ import annotations

import json

import pytest
from preset_stages import stage_alone

import factory
from benchmarks.perf_rows import published_rows
from factory.checks import run_rules
from factory.layout_search import search_layouts
from factory.planner.layout import resolve_layout
from factory.planner.memory import memory_per_rank
from factory.planner.performance import predict
from factory.schemas.parallelism import GPU_SPECS


def test_every_layout_found_validates_fits_and_is_ranked() -> None:
    results = search_layouts(factory.load_blueprint("nano"), 16, "h100")
    assert len(results) == 10
    speeds = [r.performance.tokens_per_s_per_gpu for r in results]
    assert speeds == sorted(speeds, reverse=True)
    for r in results:
        assert not [f for _, f in run_rules(r.blueprint) if f.severity == "error"]
        layout = resolve_layout(r.blueprint)
        assert r.memory_bytes == memory_per_rank(r.blueprint, layout).total
        assert r.memory_bytes <= GPU_SPECS["h100"].memory_bytes
        assert r.blueprint.parallelism.world_size == 16


def _published_nano() -> dict[str, object]:
    """The distinct published Nano layouts, by what the search must keep fixed."""
    distinct = {}
    for row in published_rows().used:
        if row.model == "Nemotron 3 Nano":
            p = row.blueprint.parallelism
            distinct[(row.gpu, row.num_gpus, row.precision, p.global_batch_size, p.tp, p.ep,
                      p.micro_batch_size, p.recompute)] = row.blueprint  # fmt: skip
    return {" ".join(map(str, key)): bp for key, bp in distinct.items()}


@pytest.mark.parametrize("name", sorted(_published_nano()))
def test_the_search_is_at_least_as_fast_as_each_published_nano_layout(name: str) -> None:
    """Each published layout ran, so it fits our memory estimate; the search finds one
    predicted at least as fast (docs/performance.md says where and why they differ)."""
    published = _published_nano()[name]
    layout = resolve_layout(published)
    ours = predict(published, layout).tokens_per_s_per_gpu
    fits = (
        memory_per_rank(published, layout).total
        <= GPU_SPECS[published.parallelism.gpu].memory_bytes
    )
    best = search_layouts(published, published.parallelism.world_size, top=1)
    assert fits and best
    assert best[0].performance.tokens_per_s_per_gpu >= ours


def test_search_needs_a_gpu_count_and_says_so(cli) -> None:
    code, _, err = cli("plan", "nano", "--stage", "phase1", "--search")
    assert code == 2 and "--gpus" in err
    # a program's stages have their own layouts: the search needs to know whose
    code, _, err = cli("plan", "nano", "--search", "--gpus", "8")
    assert code == 2 and "--stage (phase1, phase2, long_context, sft)" in err


def test_search_as_json_lists_the_layouts_and_writes_the_best(cli, tmp_path) -> None:
    out = tmp_path / "best.yaml"
    code, stdout, _ = cli("plan", "nano", "--stage", "phase1", "--search", "--gpus", "8",
                          "--gpu", "gb300", "--out", str(out), "--json")  # fmt: skip
    assert code == 0
    layouts = json.loads(stdout)["layouts"]
    assert len(layouts) == 10
    assert factory.load_blueprint(str(out)).parallelism.world_size == 8
    # the overrides are the stage's alone, as --out writes it
    best = factory.load_blueprint(stage_alone("nano", "phase1", tmp_path), layouts[0]["overrides"])
    assert (
        best.parallelism.model_dump() == factory.load_blueprint(str(out)).parallelism.model_dump()
    )
