"""Filters: each heuristic fires on a crafted document, and the record rules read their fields."""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from factory.data.steps.filters import FILTERS
from factory.data.steps.filters.cuda_kernel import cuda_kernel_reason
from factory.data.steps.filters.heuristics import (
    _ngram_reason,
    heuristic_reason,
    text_quality_reason,
)
from factory.data.steps.filters.trajectory import trajectory_reason
from factory.data.steps.ngram_repetition import ngram_repetition
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import (
    FILTER_STEPS,
    CudaKernelFilter,
    HeuristicFilter,
    TrajectoryFilter,
)

PARAGRAPH = (
    "The river town grew slowly over the long decades that followed the war. Farmers brought "
    "grain to the market each autumn, and merchants from the coast traded salt, cloth and iron "
    "tools for it. Children learned their letters in a small stone school near the bridge, while "
    "their parents argued about taxes, weather and the price of bread. When the railway finally "
    "arrived, nobody expected how quickly the old ferry would disappear from daily life."
)
DEFAULTS = HeuristicFilter()


_OFF: dict[str, Any] = {
    "min_words": 0,
    "max_words": 10**9,
    "min_mean_word_length": 0.0,
    "max_mean_word_length": 1e9,
    "max_symbol_to_word_ratio": 1e9,
    "max_duplicate_line_fraction": 1.0,
    "max_non_alphanumeric_fraction": 1.0,
    "max_url_ratio": 1.0,
    "max_top_ngram_fraction": (),
    "max_duplicate_ngram_fraction": (),
}


def _only(**overrides: Any) -> HeuristicFilter:
    """Every check off except the ones overridden, to test one definition at a time."""
    return HeuristicFilter(**{**_OFF, **overrides})


def test_a_normal_paragraph_passes() -> None:
    assert len(PARAGRAPH.split()) >= 50
    assert text_quality_reason(PARAGRAPH, DEFAULTS) is None
    assert text_quality_reason("\n\n".join([PARAGRAPH, PARAGRAPH.upper()[:200]]), DEFAULTS) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("Too short to be a document.", "word_count"),
        (" ".join(["ab"] * 80), "mean_word_length"),
        (" ".join(["incomprehensibilities"] * 80), "mean_word_length"),
        (PARAGRAPH + " #tag" * 9, "symbol_to_word"),
        (
            " ".join(w + "..." * (i % 5 == 0) for i, w in enumerate(PARAGRAPH.split())),
            "symbol_to_word",
        ),
        ("\n".join([PARAGRAPH] + ["Subscribe to our newsletter today."] * 4), "duplicate_lines"),
        (" ".join(f"({w})" for w in PARAGRAPH.split()), "non_alphanumeric"),
        (PARAGRAPH + " https://example.com/a/very/long/path/to/some/page.html" * 4, "url_ratio"),
        (" ".join([PARAGRAPH] * 3), "duplicate_5gram"),
        (" ".join(f"{w} of the" for w in PARAGRAPH.split()), "top_2gram"),
    ],
)
def test_each_heuristic_fires_with_defaults(text: str, reason: str) -> None:
    assert text_quality_reason(text, DEFAULTS) == reason


def test_word_count_bounds_are_inclusive() -> None:
    text = " ".join(["word"] * 60)
    assert text_quality_reason(text, _only(min_words=60, max_words=60)) is None
    assert text_quality_reason(text, _only(min_words=61)) == "word_count"
    assert text_quality_reason(text, _only(max_words=59)) == "word_count"
    assert text_quality_reason("", _only()) is None  # no words, nothing to judge


def test_top_ngram_fraction_definition() -> None:
    # "aa bb" occurs 3 times: 3 x 4 characters of the 20 word characters = 0.6.
    text = "aa bb aa bb aa bb cc dd ee ff"
    assert text_quality_reason(text, _only(max_top_ngram_fraction=((2, 0.61),))) is None
    assert text_quality_reason(text, _only(max_top_ngram_fraction=((2, 0.59),))) == "top_2gram"
    # "aa bb aa" occurs twice: 2 x 6 / 20 = 0.6; only the 3-gram threshold is tight.
    tight = _only(max_top_ngram_fraction=[(2, 1.0), (3, 0.59), (4, 1.0)])
    assert text_quality_reason(text, tight) == "top_3gram"
    four = _only(max_top_ngram_fraction=((4, 0.39),))  # "aa bb aa bb": 2 x 8 / 20 = 0.8
    assert text_quality_reason(text, four) == "top_4gram"


def test_duplicate_ngram_fraction_definition() -> None:
    # The second "a b c d e" repeats the first: 5 of 11 word characters.
    text = "a b c d e a b c d e x"
    assert text_quality_reason(text, _only(max_duplicate_ngram_fraction=((5, 0.46),))) is None
    fires = _only(max_duplicate_ngram_fraction=((5, 0.45),))
    assert text_quality_reason(text, fires) == "duplicate_5gram"
    # Overlapping repeats count each character once: words 1..6 of 7.
    seven = _only(max_duplicate_ngram_fraction=((5, 6 / 7 - 1e-9),))
    assert text_quality_reason("a a a a a a a", seven) == "duplicate_5gram"
    assert (
        text_quality_reason("a a a a a a a", _only(max_duplicate_ngram_fraction=((5, 6 / 7),)))
        is None
    )
    # Each n has its own threshold: a repeated 6-gram but no repeated 10-gram.
    text = "p q r s t u p q r s t u v w x y z"
    ladder = _only(max_duplicate_ngram_fraction=((10, 0.0), (6, 0.3)))
    assert text_quality_reason(text, ladder) == "duplicate_6gram"
    assert text_quality_reason(text, _only(max_duplicate_ngram_fraction=((10, 0.0),))) is None


def _naive_repetition(words: list[str], n: int) -> tuple[float, float]:
    """The definitions, written the slow and obvious way."""
    total = sum(map(len, words))
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams or not total:
        return 0.0, 0.0
    gram, count = Counter(grams).most_common(1)[0]  # ties: the first seen
    top = count * sum(map(len, gram)) / total if count >= 2 else 0.0
    seen: set[tuple[str, ...]] = set()
    inside = [False] * len(words)
    for i, g in enumerate(grams):
        if g in seen:
            inside[i : i + n] = [True] * n
        seen.add(g)
    return top, sum(len(w) for w, hit in zip(words, inside, strict=True) if hit) / total


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "bb", "ccc", "d", "ee"]), max_size=40))
def test_ngram_repetition_matches_the_naive_definition(words: list[str]) -> None:
    sizes = range(1, 11)
    fast = ngram_repetition(words, sizes)
    for n in sizes:
        assert fast[n] == pytest.approx(_naive_repetition(words, n), abs=1e-12), n


def _reason_from_every_size(words: list[str], params: HeuristicFilter) -> str | None:
    top, dup = dict(params.max_top_ngram_fraction), dict(params.max_duplicate_ngram_fraction)
    for n, (top_fraction, dup_fraction) in sorted(ngram_repetition(words, {*top, *dup}).items()):
        if n in top and top_fraction > top[n]:
            return f"top_{n}gram"
        if n in dup and dup_fraction > dup[n]:
            return f"duplicate_{n}gram"
    return None


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.sampled_from(["a", "bb", "ccc", "d", "ee", "fff", "g"]), max_size=60),
    dup=st.dictionaries(st.integers(1, 10), st.floats(0, 0.5), min_size=1, max_size=6),
)
def test_skipping_larger_duplicate_sizes_never_changes_the_reason(
    words: list[str], dup: dict[int, float]
) -> None:
    """The duplicate fraction does not grow with n, which is what lets the check skip
    the larger sizes; here against computing every size, thresholds in any order."""
    params = HeuristicFilter(
        kind="heuristics", max_duplicate_ngram_fraction=tuple(sorted(dup.items()))
    )
    fast = ngram_repetition(words, range(1, 11))
    for m in range(1, 10):
        assert fast[m + 1][1] <= fast[m][1] + 1e-12, m
    top, dups = dict(params.max_top_ngram_fraction), dict(params.max_duplicate_ngram_fraction)
    measure = functools.partial(ngram_repetition, words)
    assert _ngram_reason(measure, top, dups) == _reason_from_every_size(words, params)


def test_short_texts_do_not_crash_the_ngram_checks() -> None:
    for text in ["", "one", "one two", "one two three four"]:
        assert text_quality_reason(text, _only(**_all_ngrams(0.0))) is None


def _all_ngrams(limit: float) -> dict[str, Any]:
    return {
        "max_top_ngram_fraction": tuple((n, 1.0) for n in (2, 3, 4)),
        "max_duplicate_ngram_fraction": tuple((n, limit) for n in range(5, 11)),
    }


def test_heuristics_read_the_whole_document_text() -> None:
    doc = Document("k", "s", "c", ((PARAGRAPH[:100], True), (PARAGRAPH[100:], False)))
    assert heuristic_reason(RawRecord("k", "s", "c", {}), doc, DEFAULTS) is None


# --- trajectories ------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {}}},
    {"name": "submit"},
]


def _trajectory(**overrides: Any) -> RawRecord:
    call = {"type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
    data: dict[str, Any] = {
        "finished": True,
        "tests_passed": True,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "fix the bug"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "a.py"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "submit", "arguments": {}}],
            },
        ],
    }
    data.update(overrides)
    return RawRecord(
        "swe:0:1", "swe", "swe_trajectory", {k: v for k, v in data.items() if v is not None}
    )


def _traj(record: RawRecord, **params: Any) -> str | None:
    return trajectory_reason(record, Document("k", "s", "c", ()), TrajectoryFilter(**params))


def _with_call(call: Any) -> RawRecord:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]
    return _trajectory(messages=messages)


def test_trajectory_rules() -> None:
    assert _traj(_trajectory()) is None
    assert _traj(_trajectory(finished=False)) == "unfinished"
    assert _traj(_trajectory(finished=None)) == "unfinished"  # missing
    assert _traj(_trajectory(finished=None), require_finished=False) is None
    assert _traj(_trajectory(tests_passed=False)) == "tests_failed"
    assert _traj(_trajectory(tests_passed=False), require_tests_passed=False) is None
    passing = {"passed": 12, "failed": 0}
    assert _traj(_trajectory(tests_passed=None, test_results=passing)) is None
    for results in ({"passed": 11, "failed": 1}, {"passed": 0, "failed": 0}, None):
        assert _traj(_trajectory(tests_passed=None, test_results=results)) == "tests_failed"
    assert _traj(_trajectory(), max_turns=3) == "too_many_turns"
    assert _traj(_trajectory(), max_turns=4) is None


@pytest.mark.parametrize(
    "call",
    [
        {"name": "rm_rf", "arguments": {}},  # not a declared tool
        {"name": "bash", "arguments": "ls -la"},  # arguments are not JSON
        {"name": "bash", "arguments": "[1, 2]"},  # JSON, but not an object
        {"function": {"arguments": {}}},  # no name
        "bash ls",
    ],
)
def test_malformed_tool_calls(call: Any) -> None:
    assert _traj(_with_call(call)) == "malformed_tool_call"
    assert _traj(_with_call(call), require_well_formed_tool_calls=False) is None


def test_tool_calls_need_declared_tools() -> None:
    record = _trajectory(tools=None)
    assert _traj(record) == "malformed_tool_call"
    assert _traj(_with_call({"name": "bash", "arguments": '{"cmd": "ls"}'})) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
_field_names = st.sampled_from(
    ["finished", "tests_passed", "test_results", "messages", "tools", "verified", "benchmark"]
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_field_names, _json, max_size=7))
def test_record_rules_never_raise(data: dict[str, Any]) -> None:
    record, doc = RawRecord("k", "s", "c", data), Document("k", "s", "c", ())
    relaxed = TrajectoryFilter(require_finished=False, require_tests_passed=False)
    assert trajectory_reason(record, doc, relaxed) in (
        None,
        "too_many_turns",
        "malformed_tool_call",
    )
    assert cuda_kernel_reason(record, doc, CudaKernelFilter()) in (
        None,
        "unverified",
        "missing_benchmark",
        "slow_kernel",
    )


# --- CUDA kernels ------------------------------------------------------------------------


def _kernel(**data: Any) -> str | None:
    params = data.pop("params", CudaKernelFilter())
    record = RawRecord("cuda:0:1", "cuda", "cuda_kernel", data)
    return cuda_kernel_reason(record, Document("k", "s", "c", ()), params)


def test_cuda_kernel_rules() -> None:
    fast = {"reference_ms": 2.0, "kernel_ms": 1.0}
    assert _kernel(verified=True, benchmark=fast) is None
    assert _kernel(verified=False, benchmark=fast) == "unverified"
    assert _kernel(benchmark=fast) == "unverified"
    assert _kernel(benchmark=fast, params=CudaKernelFilter(require_verified=False)) is None
    assert _kernel(verified=True) == "missing_benchmark"
    for bad in ({"reference_ms": 2.0}, {"reference_ms": 2.0, "kernel_ms": 0}, {"kernel_ms": 1.0}):
        assert _kernel(verified=True, benchmark=bad) == "missing_benchmark"
    slow = {"reference_ms": 1.0, "kernel_ms": 1.25}
    assert _kernel(verified=True, benchmark=slow) == "slow_kernel"
    assert _kernel(verified=True, benchmark=slow, params=CudaKernelFilter(min_speedup=0.8)) is None
    assert _kernel(verified=True, benchmark=fast, params=CudaKernelFilter(min_speedup=2.5)) == (
        "slow_kernel"
    )
    assert _kernel(verified=True, params=CudaKernelFilter(min_speedup=0)) is None


# --- registry ----------------------------------------------------------------------------


def test_registry_binds_the_recipe_steps_themselves() -> None:
    assert {spec.params for spec in FILTERS.values()} == set(FILTER_STEPS)
    assert all(FILTERS[kind].params.model_fields["kind"].default == kind for kind in FILTERS)
    check = FILTERS["heuristics"].bind(HeuristicFilter(min_words=200))
    doc = Document("k", "s", "c", ((PARAGRAPH, True),))
    assert check(RawRecord("k", "s", "c", {}), doc) == "word_count"
    cuda = FILTERS["cuda_kernel"].bind(CudaKernelFilter(min_speedup=1.5))
    record = RawRecord(
        "k", "s", "c", {"verified": True, "benchmark": {"reference_ms": 3, "kernel_ms": 2}}
    )
    assert cuda(record, doc) is None
    assert FILTERS["trajectory"].bind(TrajectoryFilter())(record, doc) == "unfinished"


def test_binding_takes_only_the_filters_own_step() -> None:
    with pytest.raises(TypeError, match="TrajectoryFilter expected"):
        FILTERS["trajectory"].bind(HeuristicFilter())  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="min_word\n"):  # a typo is an error, not dropped
        HeuristicFilter.model_validate({"min_word": 200})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"min_words": 60, "max_words": 59}, "min_words (60) must not exceed max_words (59)"),
        ({"min_mean_word_length": 5.0, "max_mean_word_length": 4.0}, "min_mean_word_length (5.0)"),
        ({"max_words": 10**400}, "less than or equal to 1000000000"),
        ({"max_url_ratio": 1.5}, "less than or equal to 1"),
        ({"max_symbol_to_word_ratio": math.inf}, "finite number"),  # every Section float
        ({"max_top_ngram_fraction": [[0, 0.1]]}, "greater than or equal to 1"),
        ({"max_top_ngram_fraction": [[257, 0.1]]}, "less than or equal to 256"),
        ({"max_duplicate_ngram_fraction": [[5, 0.1], [5, 0.2]]}, "[5] given more than once"),
    ],
)
def test_heuristic_thresholds_are_validated(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        HeuristicFilter.model_validate(values)
    assert message in str(info.value)


def test_every_threshold_is_a_recipe_field_with_a_description() -> None:
    """No threshold is a constant in a filter module: each is settable in YAML and documented."""
    from factory.json_schema import described_schema

    params = described_schema(HeuristicFilter)["properties"]
    for name in ("max_top_ngram_fraction", "max_duplicate_ngram_fraction", "min_words"):
        assert params[name]["description"]
    # As YAML writes it: a list of [n, fraction] lists.
    step = HeuristicFilter.model_validate({**_OFF, "max_top_ngram_fraction": [[2, 0.59]]})
    assert step.max_top_ngram_fraction == ((2, 0.59),)
    assert text_quality_reason("aa bb aa bb aa bb cc dd ee ff", step) == "top_2gram"
