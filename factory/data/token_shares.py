"""What a build actually contains: token shares per category and per source, from the manifest.

The recipe states a target mixture; filtering and dedup change it. These
helpers read the post-curation counts the pipeline recorded
(``manifest["sources"][name] = {"category", "after": {"documents", "tokens"}}``)
so the realised mixture can be checked against the target, as a table or a
plot. The manifest is read defensively: a missing or malformed field counts
as zero or ``"unknown"`` instead of failing an inspection command.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from factory.data.shards.manifest import read_manifest
from factory.io import atomic_write_bytes

__all__ = ["ShareRow", "inspect_table", "write_share_plot"]

ShareRow = tuple[str, str, str, int, int, float]
"""``(level, name, category, documents, tokens, share)``; level is ``"category"`` or ``"source"``.

``share`` is the fraction of all tokens after curation. For a category row,
``category`` repeats the name.
"""


def _count(value: Any) -> int:
    """A non-negative int from whatever the manifest holds (bools and junk count as 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(int(value), 0)


def _sources(manifest: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    """``(name, category, documents, tokens)`` per source, in name order."""
    sources = manifest.get("sources")
    if not isinstance(sources, dict):
        return []
    rows = []
    for name in sorted(sources, key=str):
        entry = sources[name] if isinstance(sources[name], dict) else {}
        category = entry.get("category")
        after = entry.get("after") if isinstance(entry.get("after"), dict) else {}
        rows.append(
            (
                str(name),
                category if isinstance(category, str) and category else "unknown",
                _count(after.get("documents")),
                _count(after.get("tokens")),
            )
        )
    return rows


def inspect_table(out: Path) -> list[ShareRow]:
    """Category rows, then source rows, each sorted by tokens descending then name."""
    sources = _sources(read_manifest(out))
    total = sum(tokens for _, _, _, tokens in sources)

    def share(tokens: int) -> float:
        return tokens / total if total else 0.0

    per_category: dict[str, list[int]] = {}
    for _, category, documents, tokens in sources:
        counts = per_category.setdefault(category, [0, 0])
        counts[0] += documents
        counts[1] += tokens
    categories = [
        ("category", name, name, docs, tokens, share(tokens))
        for name, (docs, tokens) in per_category.items()
    ]
    per_source = [
        ("source", name, category, docs, tokens, share(tokens))
        for name, category, docs, tokens in sources
    ]
    order = lambda row: (-row[4], row[1])  # noqa: E731 - one sort key used twice
    return sorted(categories, key=order) + sorted(per_source, key=order)


def write_share_plot(out: Path, png: Path) -> Path:
    """Draw token shares per category and per source as two horizontal bar charts.

    matplotlib is imported here, not at module load, so the data factory does
    not need it unless a plot is asked for. The figure is drawn through the
    Agg canvas directly (no pyplot global state, no display backend), with
    the hash salt pinned and no ``Software`` metadata, so equal manifests give
    byte-identical PNGs. The file is written atomically.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = inspect_table(out)
    panels = [
        ("Token share per category", [r for r in rows if r[0] == "category"]),
        ("Token share per source", [r for r in rows if r[0] == "source"]),
    ]
    height = 1.5 + 0.3 * max(1, sum(len(panel_rows) for _, panel_rows in panels))
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.hashsalt": "factory", "path.simplify": True}):
        figure = Figure(figsize=(8.0, height), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.subplots(2, 1, height_ratios=[max(1, len(r)) for _, r in panels])
        for ax, (title, panel_rows) in zip(axes, panels, strict=True):
            labels = [row[1] for row in reversed(panel_rows)]
            shares = [100.0 * row[5] for row in reversed(panel_rows)]
            ax.barh(range(len(labels)), shares, color="#4c72b0")
            ax.set_yticks(range(len(labels)), labels)
            ax.set_xlim(0, 100)
            ax.set_xlabel("% of tokens after curation")
            ax.set_title(title)
            for y, value in enumerate(shares):
                ax.annotate(
                    f"{value:.1f}%",
                    (value, y),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                )
            if not labels:
                ax.text(50, 0, "no data", ha="center", va="center")
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
    atomic_write_bytes(png, buffer.getvalue())
    return png
