"""The build report rendered by headless Chromium: no script error or failed load, every
picture drawn, and a full-page screenshot kept under ``test-artifacts/`` for people."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser import chromium, render_page, scroll_width_at
from test_report_build_page import full_build  # noqa: F401  (the session's build folder fixture)

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

# CI installs Chromium (.ci/run), so there a missing browser is a failure, not a skip.
pytestmark = pytest.mark.skipif(
    chromium() is None and not os.environ.get("CI"),
    reason="Chromium is not installed (apt-get install chromium)",
)


def test_the_page_renders_every_picture_without_errors(full_build: Path) -> None:  # noqa: F811
    assert chromium() is not None, "no Chromium on PATH (.ci/run installs Debian's chromium)"
    shot = ARTIFACTS / "build_report.png"
    shot.unlink(missing_ok=True)
    page = render_page(full_build / "report.html", shot, width=1280)
    print(f"build report screenshot: {shot}")
    assert page.errors == []
    assert [i["alt"] for i in page.images] == [
        "loss.png", "distributed loss", "max_vio.png", "residual_rms.png",
    ]  # fmt: skip
    for image in page.images:
        assert image["complete"] and image["natural_width"] > 0, image["alt"]
        assert image["box"]["width"] > 200 and image["box"]["height"] > 100, image["alt"]
    classes = [svg["cls"] for svg in page.svgs]
    # The last bars: the evaluation's held-out loss per checkpoint.
    assert classes == ["layer-stack", "memory", "bars", "step", "bars", "bars", "bars"]
    for svg in page.svgs:
        assert svg["shapes"] > 0 and svg["bbox_width"] > 100 and svg["bbox_height"] > 20, svg
    assert page.blank == []
    assert page.width <= 1280  # nothing wider than the window: no sideways scrolling
    assert shot.stat().st_size > 50_000


def test_the_build_and_run_pages_fit_a_phone(full_build: Path) -> None:  # noqa: F811
    """At 390 px wide no table, drawing or path makes the page scroll sideways (they scroll
    inside themselves or wrap)."""
    for page in (full_build / "report.html", full_build / "smoke/report/report.html"):
        assert scroll_width_at(page, 390) == (390, 390), page


def test_the_phone_probe_sees_a_page_too_wide(tmp_path: Path) -> None:
    """Guards the checker: a fixed 600 px block sticks out of a 390 px frame."""
    page = tmp_path / "wide.html"
    page.write_text('<!doctype html><html><head></head><body style="margin:0">'
                    '<div style="width:600px;height:10px"></div></body></html>')  # fmt: skip
    assert scroll_width_at(page, 390) == (390, 600)


def test_the_probe_sees_errors_and_blank_pictures(tmp_path: Path) -> None:
    """Guards the checker: a broken image, an empty drawing and a script error are found."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!doctype html><html><head><meta charset="utf-8"></head><body>'
        '<p><img alt="missing" src="missing.png"></p>'
        '<svg class="empty" width="200" height="80" style="display:block"></svg>'
        "<script>noSuchFunction();</script></body></html>",
        encoding="utf-8",
    )
    found = render_page(page, tmp_path / "bad.png")
    assert any("missing.png" in e for e in found.errors)
    assert any("noSuchFunction" in e for e in found.errors)
    assert found.images[0]["natural_width"] == 0
    assert "svg 0.empty" in found.blank
