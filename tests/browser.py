"""Headless Chromium for tests: render a local HTML page, report what a person would see go
wrong (script errors, resources that failed to load, images or drawings with nothing in
them), and save a full-page screenshot.

No browser library is needed: Chromium's own command line does it. The page is copied
with a probe script in front; ``--dump-dom`` runs it to its load event, and the probe
writes its findings (errors, every image's natural size, every picture's box) onto the
``<html>`` element. ``--enable-logging=stderr`` adds the browser's console lines. A second
run screenshots the unmodified page at the height the probe measured, and the pixels inside
each picture's box must not all be one colour.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Render", "chromium", "render_page", "scroll_width_at"]

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT = 120
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
    "--disable-extensions", "--mute-audio", "--force-device-scale-factor=1",
)  # fmt: skip
PROBE = """<script>
(function () {
  var found = [];
  window.addEventListener("error", function (e) {
    var t = e.target;
    if (t && t !== window && (t.src || t.href)) found.push("failed to load " + (t.src || t.href).slice(0, 120));
    else found.push("script error: " + e.message);
  }, true);
  window.addEventListener("unhandledrejection", function (e) { found.push("rejection: " + e.reason); });
  var log = console.error;
  console.error = function () { found.push("console.error: " + Array.from(arguments).join(" ")); log.apply(console, arguments); };
  function box(el) {
    var r = el.getBoundingClientRect();
    return {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height};
  }
  window.addEventListener("load", function () {
    var images = Array.from(document.images).map(function (img) {
      return {alt: img.alt, natural_width: img.naturalWidth, natural_height: img.naturalHeight,
              complete: img.complete, box: box(img)};
    });
    var svgs = Array.from(document.querySelectorAll("svg")).map(function (svg) {
      var b = svg.getBBox();
      return {cls: svg.getAttribute("class") || "", shapes: svg.querySelectorAll("rect,path,line,circle,polyline").length,
              bbox_width: b.width, bbox_height: b.height, box: box(svg)};
    });
    var probe = {errors: found, images: images, svgs: svgs,
                 width: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight};
    document.documentElement.setAttribute("data-probe", JSON.stringify(probe));
  });
})();
</script>"""
CONSOLE = re.compile(r"CONSOLE.*?\] \"(.*)\", source: (\S+)|:(?:ERROR|WARNING):CONSOLE.*?\] (.*)")


def chromium() -> str | None:
    """The Chromium (or Chrome) executable on PATH, or None."""
    return next((path for name in NAMES if (path := shutil.which(name))), None)


@dataclass
class Render:
    """What rendering one page found."""

    errors: list[str]
    """Script errors, failed loads and console errors, from the probe and the browser's log."""
    images: list[dict[str, Any]]
    svgs: list[dict[str, Any]]
    width: int
    height: int
    screenshot: Path
    blank: list[str] = field(default_factory=list)
    """The pictures whose screenshot pixels are all one colour."""


def _run(browser: str, profile: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [browser, *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _probed_copy(page: Path) -> Path:
    """The page with the probe first in <head>, beside the original so relative links hold."""
    text = page.read_text(encoding="utf-8")
    probed = page.with_name(f".probe-{page.name}")
    probed.write_text(text.replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
    return probed


def _probe(browser: str, profile: Path, page: Path, width: int) -> tuple[dict[str, Any], list[str]]:
    probed = _probed_copy(page)
    try:
        args = [f"--window-size={width},1000", "--virtual-time-budget=10000",
                "--enable-logging=stderr", "--v=0", "--dump-dom", probed.as_uri()]  # fmt: skip
        done = _run(browser, profile, args)
    finally:
        probed.unlink(missing_ok=True)
    match = re.search(r'<html[^>]*data-probe="([^"]*)"', done.stdout)
    if not match:
        raise RuntimeError(f"Chromium ran no probe (exit {done.returncode}): {done.stderr[-2000:]}")
    console = [m.group(1) or m.group(3) for m in CONSOLE.finditer(done.stderr)]
    return json.loads(html.unescape(match.group(1))), console


def _blank_pictures(screenshot: Path, pictures: list[tuple[str, dict[str, float]]]) -> list[str]:
    """The names of the pictures whose pixels on the screenshot are all one colour."""
    from PIL import Image

    blank = []
    with Image.open(screenshot) as shot:
        image = shot.convert("RGB")
        for name, box in pictures:
            left, top = int(box["x"]), int(box["y"])
            right, bottom = int(box["x"] + box["width"]), int(box["y"] + box["height"])
            region = image.crop((left, top, min(right, image.width), min(bottom, image.height)))
            colours = region.getcolors(maxcolors=2) if region.width and region.height else None
            if colours is not None and len(colours) < 2:
                blank.append(name)
    return blank


def render_page(page: Path, screenshot: Path, width: int = 1280) -> Render:
    """Render ``page`` in headless Chromium; save a full-page PNG at ``screenshot``."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        probe, console = _probe(browser, Path(profile), page, width)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        size = f"--window-size={width},{probe['height']}"
        shot = _run(browser, Path(profile), [size, f"--screenshot={screenshot}",
                                             "--virtual-time-budget=10000", page.as_uri()])  # fmt: skip
    if not screenshot.is_file():
        raise RuntimeError(
            f"Chromium wrote no screenshot (exit {shot.returncode}): {shot.stderr[-2000:]}"
        )
    pictures = [(f"img {i['alt']}", i["box"]) for i in probe["images"]]
    pictures += [(f"svg {i}.{s['cls']}", s["box"]) for i, s in enumerate(probe["svgs"])]
    return Render(
        errors=probe["errors"] + console,
        images=probe["images"],
        svgs=probe["svgs"],
        width=probe["width"],
        height=probe["height"],
        screenshot=screenshot,
        blank=_blank_pictures(screenshot, pictures),
    )


FRAMED = """<script>window.addEventListener("load", function () {
  parent.postMessage(JSON.stringify({inner: window.innerWidth,
                                     scroll: document.documentElement.scrollWidth}), "*");
});</script>"""
FRAME = """<!doctype html><html><head><script>
window.addEventListener("message", function (m) { document.documentElement.setAttribute("data-probe", m.data); });
</script></head><body style="margin:0"><iframe src="{src}" width="{width}" height="800" style="border:0"></iframe></body></html>"""


def scroll_width_at(page: Path, width: int) -> tuple[int, int]:
    """(viewport, page) widths of ``page`` shown ``width`` px wide: a phone is narrower than
    headless Chromium's smallest window (500 px), so the page runs in an iframe that wide."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium on PATH (apt-get install chromium)")
    inner = page.with_name(f".framed-{page.name}")
    outer = page.with_name(f".frame-{page.name}")
    inner.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + FRAMED, 1))
    frame = FRAME.replace("{src}", html.escape(inner.name)).replace("{width}", str(width))
    outer.write_text(frame, encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
            args = ["--window-size=500,800", "--virtual-time-budget=10000", "--dump-dom",
                    outer.as_uri()]  # fmt: skip
            done = _run(browser, Path(profile), args)
    finally:
        inner.unlink(missing_ok=True)
        outer.unlink(missing_ok=True)
    match = re.search(r'<html[^>]*data-probe="([^"]*)"', done.stdout)
    if not match:
        raise RuntimeError(f"the framed page reported nothing (exit {done.returncode})")
    found = json.loads(html.unescape(match.group(1)))
    return found["inner"], found["scroll"]
