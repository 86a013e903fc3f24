"""Small pieces of HTML every report page shares: escaping, tables, notes, sections, figures,
and the build page's stylesheet."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence

__all__ = [
    "STYLE", "escape", "figure_png", "figure_svg", "key_value_table", "legend_key", "note",
    "section", "svg", "table",
]  # fmt: skip


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def _class(css: str) -> str:
    return f' class="{escape(css)}"' if css else ""


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    css: str = "",
    row_classes: Sequence[str] | None = None,
) -> str:
    """A table of already-formatted text cells (escaped here); ``row_classes`` gives each row a
    CSS class (the run page colours an event's row by its action)."""
    head = "".join(f"<th>{escape(c)}</th>" for c in header)
    body = "".join(
        f"<tr{_class(row_css)}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
        for row, row_css in zip(rows, row_classes or [""] * len(rows), strict=True)
    )
    return f"<table{_class(css)}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_value_table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts"><tbody>{body}</tbody></table>'


def note(text: str, kind: str = "skipped") -> str:
    """A short boxed remark: why a section is empty ('skipped', 'failed') or a warning."""
    return f'<p class="note {escape(kind)}">{escape(text)}</p>'


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{escape(anchor)}"><h2>{escape(title)}</h2>{body}</section>'


def svg(css: str, width: float, height: float, body: str) -> str:
    """A standalone SVG picture of ``width`` x ``height`` pixels that scales down with the page."""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css}" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">'
        f"{body}</svg>"
    )


def legend_key(x: int, y: float, colour: str, label: str) -> str:
    """One key of an SVG picture's legend: a 14 px swatch and its label to the right."""
    return (
        f'<rect x="{x}" y="{y:.0f}" width="14" height="14" fill="{colour}"/>'
        f'<text x="{x + 19}" y="{y + 11:.0f}" font-size="11">{escape(label)}</text>'
    )


def figure_svg(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def figure_png(png: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2328;
  max-width:1200px;margin:0 auto;padding:1.5em 2em 4em;line-height:1.45}
h1{margin:.2em 0}h2{border-bottom:2px solid #d0d7de;padding-bottom:.2em;margin-top:2em}
h3{margin:1.4em 0 .5em}
nav{font-size:90%;margin:.6em 0 1em;display:flex;flex-wrap:wrap;gap:.3em 1.1em}
nav a{white-space:nowrap}
a{color:#0969da;text-decoration:none}a:hover{text-decoration:underline}
table{border-collapse:collapse;margin:.6em 0;font-size:90%;display:block;overflow-x:auto;
  max-width:100%}
th,td{border:1px solid #d0d7de;padding:3px 9px;text-align:left;vertical-align:top}
thead th{background:#f6f8fa}table.facts th{background:#f6f8fa;font-weight:600}
td.num,table.numbers td+td,table.plan td:nth-child(2){text-align:right;
  font-variant-numeric:tabular-nums}
figure{margin:1em 0}figcaption{font-size:88%;color:#57606a;margin-top:.3em;max-width:1000px}
img{max-width:100%;height:auto;display:block}svg{display:block;max-width:100%;height:auto}
.note{padding:.5em .9em;border-left:4px solid #8c959f;background:#f6f8fa;max-width:900px}
.note.failed{border-color:#cf222e;background:#ffebe9}.note.warn{border-color:#bf8700;background:#fff8c5}
.status{font-weight:600}.status.done{color:#1a7f37}.status.failed{color:#cf222e}
.status.skipped,.status.not-run{color:#6e7781}
.pass{color:#1a7f37;font-weight:700}.fail{color:#cf222e;font-weight:700}
.columns{display:grid;grid-template-columns:1fr 1fr;gap:1.5em;align-items:start}
.columns>div{min-width:0}
details{margin:.3em 0}summary{cursor:pointer}
ul.files{columns:2;font-size:88%;margin:.3em 0 .6em}ul.files li{break-inside:avoid}
code{font-size:90%}
table.stages td:last-child,table.facts td,ul.files li{overflow-wrap:anywhere}
@media (max-width:700px){
  body{padding:.8em .9em 3em}h1{font-size:1.5em}h2{margin-top:1.5em}
  .columns{grid-template-columns:1fr}ul.files{columns:1}
  figure{overflow-x:auto}figure svg{max-width:none}
}
"""
"""Tables scroll sideways inside themselves where the page is narrower than they are (a
phone), and long paths wrap, so the page itself never scrolls sideways; below 700 px the
two-column parts stack, and drawings keep their size (their labels stay legible) and scroll
sideways in their figure, while plots (PNG) shrink to fit, whole."""
