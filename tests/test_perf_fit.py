"""The performance model's shipped constants are the fit of the published rows, bit for bit
(``python -m benchmarks perf_model --fit``, ``docs/performance.md``)."""

from __future__ import annotations

from benchmarks.perf_fit import abs_error, fit, median
from benchmarks.perf_model import CONSTANTS_FILE, constants_json
from benchmarks.perf_rows import published_rows
from factory.planner.perf_constants import LOWER_BOUNDS, perf_constants


def test_the_shipped_constants_are_the_fit_of_the_published_rows() -> None:
    rows = published_rows().used
    fitted = fit(rows)
    assert constants_json(fitted.constants, len(rows)) == CONSTANTS_FILE.read_text()
    assert fitted.constants == perf_constants()


def test_the_fit_respects_its_bounds_and_predicts_nano_within_fifteen_percent() -> None:
    constants = perf_constants()
    for name, bound in LOWER_BOUNDS.items():
        assert constants.coefficients[name] >= bound
    nano = [row for row in published_rows().used if row.model == "Nemotron 3 Nano"]
    assert len(nano) == 20
    assert median([abs_error(row, constants) for row in nano]) <= 0.15


def test_the_same_layout_floor_predicts_each_row_by_its_siblings() -> None:
    """Rows published more than once with one layout get the error of their siblings' median;
    rows published once get none."""
    from collections import Counter

    from benchmarks.perf_model import same_layout_spread
    from benchmarks.perf_rows import published_rows

    rows = published_rows().used
    spread = same_layout_spread(rows)
    count = Counter(row.label for row in rows)
    assert set(spread) == {i for i, row in enumerate(rows) if count[row.label] > 1}
    pairs = [i for i, row in enumerate(rows) if count[row.label] == 2]
    i = pairs[0]
    j = next(k for k in pairs if k != i and rows[k].label == rows[i].label)
    expected = abs(rows[j].tokens_per_s_per_gpu / rows[i].tokens_per_s_per_gpu - 1)
    assert spread[i] == expected
