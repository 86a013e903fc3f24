"""Agent trajectories (recipe step ``kind: trajectory``): finished, tests passed, turns, tool calls.

The Nemotron 3 reports describe filtering SWE, terminal and search trajectories
by outcome without publishing the rules; these rules and their defaults are
factory's own (docs/data.md, Trajectory and CUDA-kernel filters).
"""

from __future__ import annotations

from typing import Any

from factory.data.steps.filter_registry import register_filter
from factory.data.steps.formatting import call_parts, declared_tools
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import TrajectoryFilter

__all__ = ["trajectory_reason"]


@register_filter(TrajectoryFilter)
def trajectory_reason(record: RawRecord, doc: Document, params: TrajectoryFilter) -> str | None:
    """``unfinished``, ``tests_failed``, ``too_many_turns``, ``malformed_tool_call`` or None."""
    data = record.data
    if params.require_finished and data.get("finished") is not True:
        return "unfinished"
    if params.require_tests_passed and not _tests_passed(data):
        return "tests_failed"
    messages = data.get("messages")
    messages = messages if isinstance(messages, list) else []
    if len(messages) > params.max_turns:
        return "too_many_turns"
    if params.require_well_formed_tool_calls and not _tool_calls_well_formed(data, messages):
        return "malformed_tool_call"
    return None


def _tests_passed(data: dict[str, Any]) -> bool:
    if "tests_passed" in data:
        return data["tests_passed"] is True
    results = data.get("test_results")
    if not isinstance(results, dict):
        return False
    passed, failed = results.get("passed"), results.get("failed")
    return _is_count(passed) and _is_count(failed) and failed == 0 and passed > 0


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tool_calls_well_formed(data: dict[str, Any], messages: list[Any]) -> bool:
    try:
        tools = declared_tools(data) or []
    except ValueError:
        return False
    names = set()
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            continue
        if not isinstance(calls, list):
            return False
        for call in calls:
            name, arguments = call_parts(call) or (None, None)
            if not (isinstance(name, str) and name in names and isinstance(arguments, dict)):
                return False
    return True
