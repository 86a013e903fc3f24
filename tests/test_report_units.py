"""Numbers for people (``factory.report.units``): no exponent, units, thousands separators,
shares that read as percentages."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.report.units import (
    format_number,
    human_bytes,
    human_count,
    human_duration,
    human_energy,
    human_flops,
    human_gpu_hours,
    percent,
    plain,
)

EXPONENT = re.compile(r"\d[eE][+-]?\d")
fast = settings(max_examples=200, deadline=None, derandomize=True)
numbers = st.floats(-1e30, 1e30, allow_nan=False) | st.floats(-1e-6, 1e-6, allow_nan=False)
FORMATTERS = (format_number, human_count, human_flops, human_bytes, human_duration, human_energy,
              human_gpu_hours, plain)  # fmt: skip


@fast
@given(numbers)
def test_no_formatter_writes_an_exponent(value: float) -> None:
    for formatter in FORMATTERS:
        assert not EXPONENT.search(formatter(value)), (formatter.__name__, value)


@fast
@given(st.integers(-(2**53), 2**53))  # exact as floats too
def test_counts_are_whole_with_thousands_separators(n: int) -> None:
    for value in (n, float(n)):
        text = format_number(value)
        assert "." not in text and int(text.replace(",", "")) == n
        assert all(len(group) == 3 for group in text.lstrip("-").split(",")[1:])


@fast
@given(st.floats(1e-12, 1e15) | st.floats(-1e15, -1e-12))
def test_plain_keeps_three_significant_digits(value: float) -> None:
    assert float(plain(value).replace(",", "")) == pytest.approx(value, rel=5e-3)


@fast
@given(st.floats(0.0, 1.0))
def test_a_share_is_a_percentage_of_at_most_100(fraction: float) -> None:
    text = percent(fraction)
    assert text.endswith("%") and not EXPONENT.search(text)
    shown = float(text.removeprefix("< ").rstrip("%").replace(",", ""))
    assert 0 <= shown <= 100
    if fraction * 100 >= 1e-3:
        assert shown == pytest.approx(fraction * 100, rel=5e-3, abs=0.05)


@pytest.mark.parametrize(
    ("formatted", "expected"),
    [
        (human_flops(3.8953e7), "38.95 MFLOP"),
        (human_flops(2.177e13), "21.77 TFLOP"),
        (human_gpu_hours(1.60921e-05), "57.9 ms of GPU time"),
        (human_gpu_hours(384_490.4), "384,490 GPU-hours"),
        (human_duration(2111.54 * 86400), "2,111.54 days"),
        (human_duration(600), "10 min"),
        (human_duration(0.058), "58 ms"),
        (human_energy(0.0016), "1.6 kWh"),
        (human_bytes(320_205_088), "305.37 MiB"),
        (plain(1.97e-05), "0.0000197"),
        (percent(0.38), "38.0%"),
        (percent(0.04), "4.00%"),
        (percent(0.0063663), "0.637%"),
        (percent(1e-9), "< 0.001%"),
    ],
)
def test_figures_the_plan_showed_wrong_now_read_right(formatted: str, expected: str) -> None:
    assert formatted == expected
