"""Formatting: the chat template, its loss mask, and the reasoning policy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.data.steps.formatting import TOOLS_PREAMBLE, Drop, format_chat, format_text
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import ReasoningConfig

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


def _record(data: dict[str, Any], key: str = "src:0:1") -> RawRecord:
    return RawRecord(key, "src", "conversational", data)


def _trained(doc: Document) -> str:
    return "".join(text for text, trains in doc.segments if trains)


def _one(record: RawRecord, policy: ReasoningConfig | None = None) -> Document:
    out = format_chat(record, policy or ReasoningConfig(), record.key)
    assert isinstance(out, list) and len(out) == 1, out
    return out[0]


def _conversation(turns: int = 3) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}"})
        messages.append(
            {"role": "assistant", "content": f"answer {i}", "reasoning_content": f"thought {i}"}
        )
    return messages


def test_format_text() -> None:
    doc = format_text(RawRecord("k", "s", "pretrain_text", {"body": "hello"}), field="body")
    assert isinstance(doc, Document) and doc.segments == (("hello", True),)
    for data in ({}, {"text": ""}, {"text": "  \n"}, {"text": 3}):
        assert format_text(RawRecord("k", "s", "c", data)) == Drop("missing_field:text")


def test_mask_covers_exactly_the_assistant_output() -> None:
    call = {"type": "function", "function": {"name": "ls", "arguments": '{"path": "/"}'}}
    messages = [
        {"role": "user", "content": "list /"},
        {"role": "assistant", "content": "", "reasoning_content": "\nI should look.\n"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
        {"role": "tool", "content": "bin etc"},
        {"role": "assistant", "content": "bin and etc."},
    ]
    doc = _one(_record({"messages": messages, "tools": TOOLS}))
    tools_block = "# Tools\n\n" + TOOLS_PREAMBLE + "\n" + json.dumps(TOOLS[0])
    bodies = [
        "<think>\nI should look.\n</think>\n<|im_end|>",
        '<think></think>\nLet me see.<tool_call>{"name": "ls", "arguments": {"path": "/"}}'
        "</tool_call><|im_end|>",
        "<think></think>\nbin and etc.<|im_end|>",
    ]
    header = "<|im_start|>assistant\n"
    expected = (
        f"<|im_start|>system\n{tools_block}<|im_end|>\n<|im_start|>user\nlist /<|im_end|>\n"
        f"{header}{bodies[0]}\n{header}{bodies[1]}\n"
        f"<|im_start|>tool\nbin etc<|im_end|>\n{header}{bodies[2]}\n"
    )
    assert doc.text == expected
    assert _trained(doc) == "".join(bodies)
    assert doc.meta == {"format": "chat", "reasoning": "full"}


def test_tools_join_an_existing_system_turn() -> None:
    messages = [{"role": "system", "content": "Sys."}, *_conversation(1)[1:]]
    doc = _one(_record({"messages": messages, "tools": json.dumps(TOOLS)}))
    assert doc.text.startswith("<|im_start|>system\nSys.\n\n# Tools\n\n")
    assert doc.text.count("<|im_start|>system") == 1


def test_previous_turn_reasoning_is_dropped() -> None:
    record = _record({"messages": _conversation(3)})
    doc = _one(record)
    assert "thought 0" not in doc.text and "thought 1" not in doc.text
    assert "<think>\nthought 2\n</think>\nanswer 2<|im_end|>" in _trained(doc)
    assert doc.text.count("<think></think>\n") == 2
    # Earlier answers still train; only their reasoning is gone.
    assert "answer 0" in _trained(doc) and "answer 1" in _trained(doc)
    kept = _one(record, ReasoningConfig(drop_previous_turns=False))
    assert all(f"thought {i}" in _trained(kept) for i in range(3))


def test_split_turns_gives_one_document_per_user_turn() -> None:
    record = _record({"messages": _conversation(3)})
    docs = format_chat(record, ReasoningConfig(split_turns=True), record.key)
    assert isinstance(docs, list) and len(docs) == 3
    for i, doc in enumerate(docs):
        assert doc.key == f"src:0:1#{i}" and doc.meta["turn"] == i
        assert doc.text.endswith(f"answer {i}<|im_end|>\n")  # ends at this turn's answer
        assert f"question {i + 1}" not in doc.text
        assert _trained(doc) == f"<think>\nthought {i}\n</think>\nanswer {i}<|im_end|>"
        assert all(f"thought {j}" not in doc.text for j in range(i))  # earlier reasoning gone
    # Without reasoning there is nothing to gain from splitting.
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in _conversation(3)]
    assert (
        len(format_chat(_record({"messages": plain}), ReasoningConfig(split_turns=True), "k")) == 1
    )


def test_masked_trace_is_read_but_not_trained() -> None:
    doc = _one(_record({"messages": _conversation(1)}), ReasoningConfig(trace="mask"))
    assert "<think>\nthought 0\n</think>\n" in doc.text
    assert _trained(doc) == "answer 0<|im_end|>"


def _many(
    n: int, policy: ReasoningConfig, reverse: bool = False, seed: int = 0
) -> dict[str, Document]:
    long_thought = "step " * 200  # 1000 characters, longer than any budget below
    keys = [f"src:0:{i}" for i in range(n)]
    out = {}
    for key in reversed(keys) if reverse else keys:
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "the answer", "reasoning_content": long_thought},
        ]
        (doc,) = format_chat(_record({"messages": messages}, key), policy, key, seed)
        out[key] = doc
    return out


def _keys_in(docs: dict[str, Document], mode: str) -> set[str]:
    return {k for k, d in docs.items() if d.meta["reasoning"] == mode}


def test_strip_and_truncate_fractions_are_hit_and_deterministic() -> None:
    policy = ReasoningConfig(strip_fraction=0.10, truncate_fraction=0.03, truncate_max_chars=300)
    docs = _many(2000, policy)
    modes = [d.meta["reasoning"] for d in docs.values()]
    # Expected 200 +- 13.4 and 60 +- 7.6 (one sigma); the draw is fixed, the bounds are ~5 sigma.
    assert 133 <= modes.count("stripped") <= 267
    assert 22 <= modes.count("truncated") <= 98
    assert modes.count("full") == 2000 - modes.count("stripped") - modes.count("truncated")
    again = _many(2000, policy, reverse=True)
    assert {k: d.segments for k, d in again.items()} == {k: d.segments for k, d in docs.items()}
    reseeded = _many(2000, ReasoningConfig(strip_fraction=0.10, truncate_fraction=0.03), seed=1)
    assert _keys_in(reseeded, "stripped") != _keys_in(docs, "stripped")
    for doc in docs.values():
        if doc.meta["reasoning"] == "stripped":
            assert "step" not in doc.text and "<think></think>\nthe answer" in _trained(doc)


def test_truncated_reasoning_keeps_the_answer_and_masks_the_close() -> None:
    docs = _many(300, ReasoningConfig(truncate_fraction=1.0, truncate_max_chars=300))
    budgets = set()
    for doc in docs.values():
        assert doc.meta["reasoning"] == "truncated"
        budget = doc.meta["reasoning_budget"]
        budgets.add(budget)
        assert 1 <= budget <= 300
        masked = [text for text, trains in doc.segments if not trains]
        assert "</think>" in masked  # the closing tag alone is out of the loss
        assert "</think>" not in _trained(doc)
        trained = _trained(doc)
        assert trained == f"<think>\n{('step ' * 200)[:budget]}\n\nthe answer<|im_end|>"
    assert len(budgets) > 100  # budgets vary with the key


def test_truncated_close_trains_when_the_policy_says_so() -> None:
    policy = ReasoningConfig(truncate_fraction=1.0, truncate_max_chars=300, truncated_close="train")
    for doc in _many(50, policy).values():
        budget = doc.meta["reasoning_budget"]
        trace = ("step " * 200)[:budget]
        assert _trained(doc) == f"<think>\n{trace}\n</think>\nthe answer<|im_end|>"
    # a masked trace stays masked whole, </think> included
    masked = ReasoningConfig(
        truncate_fraction=1.0, truncate_max_chars=300, truncated_close="train", trace="mask"
    )
    for doc in _many(50, masked).values():
        assert _trained(doc) == "the answer<|im_end|>"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({}, "missing_field:messages"),
        ({"messages": []}, "missing_field:messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "all_masked"),
        ({"messages": ["hi"]}, "bad_message"),
        ({"messages": [{"role": "user", "content": {"x": 1}}]}, "bad_message"),
        ({"messages": _conversation(1), "tools": "{not json"}, "bad_tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "ls"}]},
                ]
            },
            "tool_call_without_tools",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": '<tool_call>{"name": "ls"}</tool_call>'},
                ],
                "tools": [],
            },
            "tool_call_without_tools",
        ),
    ],
)
def test_invalid_records_are_dropped_with_a_reason(data: dict[str, Any], reason: str) -> None:
    assert format_chat(_record(data), ReasoningConfig(), "k") == Drop(reason)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="trace"):
        ReasoningConfig(trace="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"strip_fraction \(0.7\) \+ truncate_fraction \(0.5\)"):
        ReasoningConfig(strip_fraction=0.7, truncate_fraction=0.5)
    with pytest.raises(ValueError, match="truncate_fraction"):
        ReasoningConfig(truncate_fraction=-0.1)
    with pytest.raises(ValueError, match="truncate_max_chars"):
        ReasoningConfig(truncate_max_chars=10**400)
    with pytest.raises(ValueError, match="Extra inputs"):
        ReasoningConfig(seed=1)  # type: ignore[call-arg]  # the recipe's seed, not the policy's


# --- property: segments re-form the rendered conversation; only assistant text trains ----

# Each role writes in its own alphabet, none of which the template uses, so a
# character tells which role it came from.
USER, SYSTEM, TOOL, ANSWER, THOUGHT = "ü", "ß", "ŧ", "å", "ř"


def _render_reference(messages: list[dict[str, Any]], tools: list[Any] | None, drop: bool) -> str:
    """The documented template, written out independently of the implementation."""
    turns = list(messages)
    if tools:
        block = "# Tools\n\n" + TOOLS_PREAMBLE + "\n" + "\n".join(json.dumps(t) for t in tools)
        if turns[0]["role"] == "system":
            head = turns[0]["content"]
            turns[0] = {"role": "system", "content": f"{head}\n\n{block}" if head else block}
        else:
            turns.insert(0, {"role": "system", "content": block})
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    keep_from = users[-1] if drop and users else 0
    out = []
    for i, m in enumerate(turns):
        if m["role"] != "assistant":
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
            continue
        thought = m.get("reasoning_content", "").strip() if i >= keep_from else ""
        think = f"<think>\n{thought}\n</think>\n" if thought else "<think></think>\n"
        calls = "".join(
            "<tool_call>"
            + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
            + "</tool_call>"
            for c in m.get("tool_calls", [])
        )
        out.append(f"<|im_start|>assistant\n{think}{m['content']}{calls}<|im_end|>\n")
    return "".join(out)


def _message(role: str, text: str, thought: str, call: bool) -> dict[str, Any]:
    alphabet = {"user": USER, "system": SYSTEM, "tool": TOOL, "assistant": ANSWER}[role]
    message: dict[str, Any] = {"role": role, "content": text.replace("x", alphabet)}
    if role == "assistant":
        message["reasoning_content"] = thought.replace("x", THOUGHT)
        if call:
            message["tool_calls"] = [{"name": "ls", "arguments": {"p": ANSWER}}]
    return message


_messages = st.lists(
    st.builds(
        _message,
        st.sampled_from(["system", "user", "assistant", "tool"]),
        st.text(alphabet="x \n", max_size=12),
        st.text(alphabet="x \n", max_size=12),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(_messages, st.booleans(), st.booleans(), st.sampled_from(["keep", "mask"]))
def test_segments_rebuild_the_conversation(
    messages: list[dict[str, Any]], with_tools: bool, drop: bool, trace: str
) -> None:
    if not with_tools:
        for m in messages:
            m.pop("tool_calls", None)
    tools = TOOLS if with_tools else None
    data: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    policy = ReasoningConfig(trace=trace, drop_previous_turns=drop)  # type: ignore[arg-type]
    out = format_chat(_record(data), policy, "k")
    if not any(m["role"] == "assistant" for m in messages):
        assert out == Drop("all_masked")
        return
    assert isinstance(out, list) and len(out) == 1
    doc = out[0]
    assert doc.text == _render_reference(messages, tools, drop)
    trained = _trained(doc)
    assert not set(trained) & {USER, SYSTEM, TOOL}
    assert trained.count(ANSWER) == doc.text.count(ANSWER)  # all assistant output trains
    assert trained.count(THOUGHT) == (doc.text.count(THOUGHT) if trace == "keep" else 0)
    assert trained.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)
_message_like = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "tool", "system"]) | _json_values,
        "content": _json_values,
        "reasoning_content": _json_values,
        "tool_calls": _json_values,
    },
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_message_like | _json_values, max_size=4), _json_values)
def test_arbitrary_records_never_raise(messages: list[Any], tools: Any) -> None:
    out = format_chat(_record({"messages": messages, "tools": tools}), ReasoningConfig(), "k")
    assert isinstance(out, Drop | list)
