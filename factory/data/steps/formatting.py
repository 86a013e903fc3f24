"""Turn raw records into training documents: plain text, or chat with a loss mask.

A recipe may give its own chat template (``tokenizer.chat_template``, Jinja as
in a tokenizer's ``chat_template``): the model's template then renders the
turns and the loss mask follows the roles (``factory.data.steps.chat_template``;
docs/data.md, Chat templates). Without one, the template is our own,
ChatML-like, and fixed here so that training and inference render
conversations identically (``data_recipes/templates/chatml.jinja`` is the same
format as Jinja)::

    <|im_start|>system
    {system content}

    # Tools

    {TOOLS_PREAMBLE}
    {tool spec as JSON}            (one line per declared tool)<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    <think>
    {reasoning}
    </think>
    {content}<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
    <|im_start|>tool
    {tool result}<|im_end|>

* The ``# Tools`` block exists only when the record declares ``tools``; it is
  appended to the first system turn, or becomes a system turn of its own.
* Every assistant turn opens a think block; a turn without reasoning (none
  given, dropped from history, or stripped) renders ``<think></think>\\n``, so
  the model always sees which mode it is in, as Nemotron's template does.
* Tool calls follow the content with no separator, one ``<tool_call>`` each.

Loss mask (``Document.segments``): an assistant turn's body (think block,
content, tool calls) and its ``<|im_end|>`` train; its ``<|im_start|>assistant\\n``
header, the newline after ``<|im_end|>`` and all system, user and tool turns do
not: the header is the prompt at inference, everything else is input.

With a recipe's template, an assistant turn's text beyond its generation
prompt trains, less trailing whitespace (the model stops at its end-of-turn
token, so a separator after it is never generated). Either way, ``trace="mask"``
keeps the turn's text through ``</think>`` and the newline after it out of the
loss, and a truncated turn's ``</think>`` does not train.

Reasoning handling follows the open Nemotron SFT recipe (docs/data.md,
Reasoning): history reasoning is dropped, conversations with reasoning can be split
into one document per user turn, and a few percent of documents get their
reasoning stripped ("reasoning off") or truncated to a random budget with the
answer kept and ``</think>`` masked (budget control, as in Ultra) or trained
(as in Nano and Super; ``truncated_close``). Every random
choice is a hash of ``(seed, rng_key)``, so the same record gets the same
treatment however many workers run and in whatever order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from factory.data.steps.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateRefused,
    assistant_spans,
)
from factory.data.steps.records import Document, RawRecord
from factory.schemas.data_recipe import ChatFormat, ReasoningConfig, TextFormat

__all__ = [
    "IM_END",
    "IM_START",
    "TOOLS_PREAMBLE",
    "Drop",
    "Formatter",
    "call_parts",
    "declared_tools",
    "format_chat",
    "format_text",
    "formatter",
]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>\n"
THINK_CLOSE = "</think>"
EMPTY_THINK = "<think></think>\n"
TOOLS_PREAMBLE = (
    "You may call one or more functions. Write each call as "
    '<tool_call>{"name": <function-name>, "arguments": <arguments-object>}</tool_call>. '
    "Available functions:"
)
ROLES = frozenset({"system", "user", "assistant", "tool"})
Segments = list[tuple[str, bool]]


@dataclass(frozen=True)
class Drop:
    """A record that yields no document; ``reason`` is counted in the stage report."""

    reason: str


@dataclass(frozen=True)
class _Turn:
    role: str
    content: str
    reasoning: str = ""
    calls: tuple[dict[str, Any], ...] = ()
    """OpenAI form: ``{"type": "function", "function": {"name", "arguments"}}``, arguments
    parsed from JSON where they were a string (what chat templates expect)."""
    fields: tuple[tuple[str, Any], ...] = ()
    """The message's other fields (``tool_call_id``, ``name``...), for a recipe's template."""


Formatter = Callable[[RawRecord], "list[Document] | Drop"]
"""A source's format step bound to its parameters: a record's documents, or why it has none."""


def _text_formatter(step: TextFormat, seed: int, template: ChatTemplate | None) -> Formatter:
    field = step.field

    def fmt(record: RawRecord) -> list[Document] | Drop:
        doc = format_text(record, field)
        return doc if isinstance(doc, Drop) else [doc]

    return fmt


def _chat_formatter(step: ChatFormat, seed: int, template: ChatTemplate | None) -> Formatter:
    policy = step.reasoning

    def fmt(record: RawRecord) -> list[Document] | Drop:
        return format_chat(record, policy, record.key, seed, template)

    return fmt


_FORMATTERS: dict[str, Callable[[Any, int, ChatTemplate | None], Formatter]] = {
    "text": _text_formatter,
    "chat": _chat_formatter,
}


def formatter(
    step: TextFormat | ChatFormat, seed: int, template: ChatTemplate | None = None
) -> Formatter:
    """What formats a record as ``step`` (a source's first step) says; ``seed`` is the
    recipe's, for the reasoning draws, and ``template`` its chat template (None: the
    built-in one)."""
    return _FORMATTERS[step.kind](step, seed, template)


def format_text(record: RawRecord, field: str = "text") -> Document | Drop:
    """A pretraining document: the whole of ``record.data[field]`` trains."""
    text = record.data.get(field)
    if not isinstance(text, str) or not text.strip():
        return Drop(f"missing_field:{field}")
    return Document(record.key, record.source, record.category, ((text, True),), {"format": "text"})


def format_chat(
    record: RawRecord,
    policy: ReasoningConfig,
    rng_key: str,
    seed: int = 0,
    template: ChatTemplate | None = None,
) -> list[Document] | Drop:
    """Render a ``messages`` record into one document, or one per user turn.

    Reads ``messages`` (``role``, ``content``, assistant ``reasoning_content``
    and ``tool_calls``) and ``tools``. ``policy`` is the recipe's chat step's
    ``reasoning`` section; ``trace="mask"`` keeps the think block in the text
    (the model reads it) but out of the loss, and ``strip_fraction`` and
    ``truncate_fraction`` are disjoint shares of the documents that carry
    reasoning. ``seed`` (the recipe's) and ``rng_key`` (normally the record
    key) drive the strip/truncate draw; split documents draw with ``rng_key#i``.
    ``template`` renders the turns instead of the built-in format; a record it
    refuses (its ``raise_exception``) is dropped, and one whose renders are not
    prefixes of each other raises ``ChatTemplateError`` naming the record.
    """
    parsed = _parse(record.data)
    if isinstance(parsed, Drop):
        return parsed
    turns, tools = parsed
    users = [i for i, t in enumerate(turns) if t.role == "user"]
    has_reasoning = any(t.reasoning for t in turns)
    # (first trained turn, first turn keeping reasoning, end, rng key, meta) per document.
    plans: list[tuple[int, int, int, str, dict[str, Any]]] = []
    split = policy.split_turns and has_reasoning and bool(users)
    if split:
        for n, start in enumerate(users):
            end = users[n + 1] if n + 1 < len(users) else len(turns)
            plans.append((start, start, end, f"{rng_key}#{n}", {"turn": n}))
    else:
        keep_from = users[-1] if policy.drop_previous_turns and users else 0
        plans.append((0, keep_from, len(turns), rng_key, {}))

    documents = []
    for train_from, keep_from, end, key, meta in plans:
        mode, budget = _draw(turns[:end], keep_from, policy, seed, key)
        reasoning = [_kept(t, i, keep_from, mode) for i, t in enumerate(turns[:end])]
        if template is None:
            segments = _render(turns[:end], tools, reasoning, train_from, policy, budget)
        else:
            try:
                segments = _render_template(
                    template, turns[:end], tools, reasoning, train_from, policy, budget
                )
            except TemplateRefused:
                return Drop("chat_template_refused")
            except ChatTemplateError as exc:
                raise ChatTemplateError(
                    f"record {record.key} (source {record.source}): chat template "
                    f"{template.origin}: {exc}"
                ) from None
        mode_meta: dict[str, Any] = {"reasoning": mode}
        if budget is not None:
            mode_meta["reasoning_budget"] = budget
        if not any(trains for _, trains in segments):
            continue  # e.g. a trailing user turn with no answer
        doc_key = f"{record.key}#{meta['turn']}" if split else record.key
        documents.append(
            Document(
                doc_key,
                record.source,
                record.category,
                segments,
                {"format": "chat", **meta, **mode_meta},
            )
        )
    return documents or Drop("all_masked")


def _parse(data: dict[str, Any]) -> tuple[list[_Turn], list[Any] | None] | Drop:
    """Validate and normalize messages; the turns and the declared tools."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return Drop("missing_field:messages")
    try:
        tools = declared_tools(data)
    except ValueError:
        return Drop("bad_tools")

    turns: list[_Turn] = []
    for message in messages:
        if not isinstance(message, dict):
            return Drop("bad_message")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            return Drop("unknown_role")
        content = _as_text(message.get("content"))
        if content is None:
            return Drop("bad_message")
        fields = tuple((k, v) for k, v in message.items() if v is not None and k not in _NORMALIZED)
        if role != "assistant":
            turns.append(_Turn(role, content, fields=fields))
            continue
        reasoning = _as_text(message.get("reasoning_content"))
        calls = message.get("tool_calls") or []
        if reasoning is None or not isinstance(calls, list):
            return Drop("bad_message")
        if tools is None and (calls or "<tool_call>" in content):
            return Drop("tool_call_without_tools")
        normalized = tuple(c for c in map(_openai_call, calls) if c is not None)
        if len(normalized) != len(calls):
            return Drop("bad_message")
        # Outer whitespace belongs to the template, not the trace.
        turns.append(_Turn(role, content, reasoning.strip(), normalized, fields))
    return turns, tools


_NORMALIZED = frozenset(
    {"role", "content", "reasoning_content", "thinking", "reasoning", "tool_calls"}
)
"""Message fields the formatter rewrites; the others reach a recipe's template as they are."""


def _as_text(value: Any) -> str | None:
    """Message text: a string, None (empty), or OpenAI-style text parts; else None."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)
    return None


def declared_tools(data: dict[str, Any]) -> list[Any] | None:
    """The record's ``tools`` list, or None when it declares none.

    Some exports store the list as a JSON string; it is parsed. Raises
    ``ValueError`` when the field is present but is not a list.
    """
    tools = data.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"tools is not JSON: {exc}") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools is not a list")
    return tools or None


def call_parts(call: Any) -> tuple[Any, Any] | None:
    """``(name, arguments)`` of an OpenAI (``function``-wrapped) or a flat tool call.

    Arguments given as a JSON string are parsed; a string that is not JSON is
    returned as it is (the trajectory filter judges it). None if ``call`` is
    not a mapping.
    """
    if not isinstance(call, dict):
        return None
    body = call["function"] if isinstance(call.get("function"), dict) else call
    arguments = body.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return body.get("name"), arguments


def _openai_call(call: Any) -> dict[str, Any] | None:
    parts = call_parts(call)
    if parts is None:
        return None
    extra = {k: v for k, v in call.items() if k not in ("type", "function", "name", "arguments")}
    return {**extra, "type": "function", "function": {"name": parts[0], "arguments": parts[1]}}


def _render_call(call: dict[str, Any]) -> str:
    body = call["function"]
    return f"<tool_call>{_json({'name': body['name'], 'arguments': body['arguments']})}</tool_call>"


def _json(value: Any) -> str:
    # default=str: parquet rows can carry timestamps or bytes, which must not crash a worker.
    return json.dumps(value, ensure_ascii=False, default=str)


def _unit(seed: int, key: str, salt: str) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, key, salt)."""
    digest = hashlib.blake2b(f"{seed}\x1f{salt}\x1f{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _draw(
    turns: list[_Turn], keep_from: int, policy: ReasoningConfig, seed: int, key: str
) -> tuple[str, int | None]:
    """The document's reasoning mode (none, full, stripped, truncated) and, when
    truncated, its budget in characters; turns at index >= ``keep_from`` keep reasoning."""
    kept = [len(t.reasoning) for i, t in enumerate(turns) if i >= keep_from and t.reasoning]
    if not kept:
        return "none", None
    draw = _unit(seed, key, "reasoning")
    if draw < policy.strip_fraction:
        return "stripped", None
    if draw < policy.strip_fraction + policy.truncate_fraction:
        # A budget in [1, top] (0 only if nothing else fits), below the
        # longest trace so that a "truncated" document really is one.
        top = min(policy.truncate_max_chars, max(kept) - 1)
        low = min(1, top)
        return "truncated", low + int(_unit(seed, key, "budget") * (top - low + 1))
    return "full", None


def _kept(turn: _Turn, index: int, keep_from: int, mode: str) -> str:
    """The reasoning a turn renders before any truncation."""
    return turn.reasoning if index >= keep_from and mode != "stripped" else ""


def _tools_block(tools: list[Any]) -> str:
    return "# Tools\n\n" + TOOLS_PREAMBLE + "\n" + "\n".join(_json(tool) for tool in tools)


def _render(
    turns: list[_Turn],
    tools: list[Any] | None,
    reasoning: list[str],
    train_from: int,
    policy: ReasoningConfig,
    budget: int | None,
) -> tuple[tuple[str, bool], ...]:
    """Segments of one document in the built-in format; assistant turns at index >=
    ``train_from`` train, ``reasoning[i]`` is what turn i renders in its think block.
    The tools block joins the first system turn, or is one of its own."""
    pieces: Segments = []
    add = pieces.append
    block = _tools_block(tools) if tools is not None else None
    if block is not None and (not turns or turns[0].role != "system"):
        add((f"{IM_START}system\n{block}{IM_END}\n", False))
    for i, turn in enumerate(turns):
        if turn.role != "assistant":
            content = turn.content
            if i == 0 and turn.role == "system" and block is not None:
                content = f"{content}\n\n{block}" if content else block
            add((f"{IM_START}{turn.role}\n{content}{IM_END}\n", False))
            continue
        trains = i >= train_from
        add((f"{IM_START}assistant\n", False))
        think_trains = trains and policy.trace == "keep"
        if not reasoning[i]:
            add((EMPTY_THINK, think_trains))
        elif budget is not None and len(reasoning[i]) > budget:
            add((f"{THINK_OPEN}{reasoning[i][:budget]}\n", think_trains))
            # masked, the model does not learn to stop thinking where the budget cut the trace
            add((THINK_CLOSE, think_trains and policy.truncated_close == "train"))
            add(("\n", think_trains))
        else:
            add((f"{THINK_OPEN}{reasoning[i]}\n{THINK_CLOSE}\n", think_trains))
        calls = "".join(_render_call(call) for call in turn.calls)
        add((turn.content + calls + IM_END, trains))
        add(("\n", False))
    return _merge(pieces)


def _template_message(turn: _Turn, reasoning: str) -> dict[str, Any]:
    """A turn as a chat template reads it; reasoning under both names transformers gives it
    (``reasoning_content``, and ``thinking`` for gpt-oss templates)."""
    message: dict[str, Any] = {**dict(turn.fields), "role": turn.role, "content": turn.content}
    if turn.role == "assistant":
        message["reasoning_content"] = reasoning
        message["thinking"] = reasoning
        if turn.calls:
            message["tool_calls"] = list(turn.calls)
    return message


def _render_template(
    template: ChatTemplate,
    turns: list[_Turn],
    tools: list[Any] | None,
    reasoning: list[str],
    train_from: int,
    policy: ReasoningConfig,
    budget: int | None,
) -> tuple[tuple[str, bool], ...]:
    """Segments of one document rendered by a recipe's template, masked by role spans."""
    truncated = [budget is not None and len(r) > budget for r in reasoning]
    shown = [r[:budget] if cut else r for r, cut in zip(reasoning, truncated, strict=True)]
    messages = [_template_message(t, r) for t, r in zip(turns, shown, strict=True)]
    text, spans = assistant_spans(template, messages, tools)
    pieces: Segments = []
    done = 0
    for index, start, end in spans:
        if index < train_from:
            continue
        end = start + len(text[start:end].rstrip())
        hidden = start, start  # the part of the span that does not train
        close = text.find(THINK_CLOSE, start, end)
        masks_close = truncated[index] and policy.truncated_close == "mask"
        needs_close = policy.trace == "mask" or masks_close
        if needs_close and close < 0 and shown[index] and shown[index] in text[start:end]:
            # The trace is rendered, but not closed where this policy can find it.
            raise ChatTemplateError(
                f"the reasoning policy (trace {policy.trace!r}, truncation) masks through "
                f"{THINK_CLOSE}, but the template renders message {index}'s reasoning without it"
            )
        if close >= 0 and policy.trace == "mask":
            stop = close + len(THINK_CLOSE)
            hidden = start, stop + 1 if text.startswith("\n", stop) and stop < end else stop
        elif close >= 0 and masks_close:
            hidden = close, close + len(THINK_CLOSE)
        pieces += [
            (text[done:start], False),
            (text[start : hidden[0]], True),
            (text[hidden[0] : hidden[1]], False),
            (text[hidden[1] : end], True),
        ]
        done = end
    pieces.append((text[done:], False))
    return _merge(pieces)


def _merge(pieces: Segments) -> tuple[tuple[str, bool], ...]:
    """Join neighbouring pieces that share a mask; drop empty ones."""
    merged: list[tuple[str, bool]] = []
    run: list[str] = []
    flag = False
    for text, trains in pieces:
        if not text:
            continue
        if run and trains != flag:
            merged.append(("".join(run), flag))
            run = []
        run.append(text)
        flag = trains
    if run:
        merged.append(("".join(run), flag))
    return tuple(merged)
