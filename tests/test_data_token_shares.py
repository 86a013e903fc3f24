"""Token-share table and plot from a small fake manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.data.shards.manifest import write_manifest
from factory.data.token_shares import inspect_table, write_share_plot

MANIFEST = {
    "sources": {
        "web": {"category": "crawl", "after": {"documents": 10, "tokens": 600}},
        "code_a": {"category": "code", "after": {"documents": 3, "tokens": 250}},
        "code_b": {"category": "code", "after": {"documents": 2, "tokens": 150}},
        "broken": {"before": {"tokens": 999}},
    },
    "shards": [],
}


@pytest.fixture
def out(tmp_path: Path) -> Path:
    write_manifest(tmp_path, MANIFEST)
    return tmp_path


def test_table_has_category_then_source_shares(out: Path) -> None:
    rows = inspect_table(out)
    assert rows == [
        ("category", "crawl", "crawl", 10, 600, pytest.approx(0.6)),
        ("category", "code", "code", 5, 400, pytest.approx(0.4)),
        ("category", "unknown", "unknown", 0, 0, 0.0),
        ("source", "web", "crawl", 10, 600, pytest.approx(0.6)),
        ("source", "code_a", "code", 3, 250, pytest.approx(0.25)),
        ("source", "code_b", "code", 2, 150, pytest.approx(0.15)),
        ("source", "broken", "unknown", 0, 0, 0.0),
    ]


def test_table_tolerates_a_manifest_without_sources(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"shards": []})
    assert inspect_table(tmp_path) == []


def test_share_plot_is_a_deterministic_png(out: Path, tmp_path: Path) -> None:
    first = write_share_plot(out, tmp_path / "plots" / "a.png")
    second = write_share_plot(out, tmp_path / "plots" / "b.png")
    data = first.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert data == second.read_bytes()
    assert b"Software" not in data
    assert not list((tmp_path / "plots").glob("*.tmp"))
