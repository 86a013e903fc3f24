"""A recipe's chat template: Jinja text rendered as transformers renders a tokenizer's
``chat_template``, and the role spans that the loss mask is cut from.

The environment is transformers' (``_compile_jinja_template`` in
``transformers/utils/chat_template_utils.py``), written again here so that
curation needs no transformers: a sandbox that cannot be mutated,
``trim_blocks`` and ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
a ``tojson`` that neither escapes HTML nor sorts keys, ``dict`` and a
``namespace`` that refuses underscore names. Two differences, both on purpose:

* ``{% generation %}`` blocks render their body and mark nothing: the mask
  comes from prefix renders (below), which work for every template.
* ``strftime_now`` is not defined. A build's output is a function of its
  recipe and inputs, never of the day it ran; templates that ask
  ``strftime_now is defined`` (Llama 3.1's) take their own fallback date.

Role spans: the text an assistant turn adds is what rendering
``messages[:k + 1]`` adds to rendering ``messages[:k]`` with the generation
prompt. For that to mean anything, each render must be a prefix of the next
(``[:k]`` + prompt, then ``[:k + 1]``, then the next turn's, then the whole
conversation); a template that rewrites earlier turns once later ones exist
(Qwen3's drops history reasoning by position) is refused with the place the
renders part.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "SPECIAL_TOKEN_NAMES",
    "ChatTemplate",
    "ChatTemplateError",
    "TemplateRefused",
    "assistant_spans",
    "check_template",
    "read_template_file",
    "render",
]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens transformers passes to a template (``special_tokens_map``), read from a
``tokenizer_config.json`` when the template comes from one."""


class ChatTemplateError(ValueError):
    """A template that cannot render or whose renders are not prefixes of each other."""


class TemplateRefused(ChatTemplateError):
    """The template's own ``raise_exception``: it declines this conversation."""


@dataclass(frozen=True)
class ChatTemplate:
    """Jinja text, the special tokens it is rendered with, and where it came from."""

    text: str
    origin: str
    """For messages: the recipe field or file it was read from."""
    special_tokens: tuple[tuple[str, str], ...] = ()


def read_template_file(path: Path) -> ChatTemplate:
    """A ``.jinja`` file's text, or a ``tokenizer_config.json``'s ``chat_template`` (its
    ``default`` entry when it holds named templates) with the special tokens beside it.
    Raises ``ChatTemplateError`` when the JSON holds no usable template."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".json":
        return ChatTemplate(text, str(path))
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{path} is not JSON: {exc}") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates, as transformers saves several
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{path} has no chat_template string (nor a 'default' one)")
    tokens = []
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken as saved: {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens.append((name, value))
    return ChatTemplate(template, str(path), tuple(tokens))


@lru_cache(maxsize=8)
def _compiled(text: str) -> Any:
    """The template compiled in transformers' environment (once per process and text)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateRefused(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Underscore names would reach CPython internals through attribute access.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore names on a namespace: {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(text)


def check_compiles(template: ChatTemplate) -> None:
    """Raise ``ChatTemplateError`` with Jinja's message when the text does not compile."""
    import jinja2

    try:
        _compiled(template.text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"line {exc.lineno}: {exc.message}") from None


def render(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    tools: list[Any] | None,
    add_generation_prompt: bool,
) -> str:
    """What ``apply_chat_template(messages, tools=tools, tokenize=False, ...)`` returns.

    ``TemplateRefused`` when the template raises; ``ChatTemplateError`` for any
    other failure (an undefined name, a type error in the template)."""
    import jinja2

    try:
        return _compiled(template.text).render(
            messages=list(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **dict(template.special_tokens),
        )
    except TemplateRefused:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None


def assistant_spans(
    template: ChatTemplate, messages: Sequence[dict[str, Any]], tools: list[Any] | None
) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered conversation and, per assistant message, ``(index, start, end)``: the
    characters it adds after its generation prompt.

    Raises ``ChatTemplateError`` naming the first pair of renders that are not
    prefixes of each other."""
    spans = []
    before, before_what = "", "nothing"
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(template, messages[:index], tools, add_generation_prompt=True)
        prompt_what = f"messages[:{index}] with the generation prompt"
        _require_prefix(before, before_what, prompt, prompt_what)
        turn = render(template, messages[: index + 1], tools, add_generation_prompt=False)
        turn_what = f"messages[:{index + 1}]"
        _require_prefix(prompt, prompt_what, turn, turn_what)
        spans.append((index, len(prompt), len(turn)))
        before, before_what = turn, turn_what
    text = render(template, messages, tools, add_generation_prompt=False)
    _require_prefix(before, before_what, text, f"all {len(messages)} messages")
    return text, spans


def _require_prefix(head: str, head_what: str, full: str, full_what: str) -> None:
    if full.startswith(head):
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(head, full, strict=False)) if a != b),
        min(len(head), len(full)),
    )
    raise ChatTemplateError(
        f"rendering {head_what} is not a prefix of rendering {full_what}: they part at "
        f"character {at} ({head[at : at + 40]!r} vs {full[at : at + 40]!r}), so the turns' "
        "spans, and the loss mask, cannot be told apart"
    )


_PROBE_TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
_PROBE_CALL = {"type": "function", "function": {"name": "ls", "arguments": {"path": "/"}}}


def _probe_turn(content: str, reasoning: str = "", **more: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "thinking": reasoning,
        **more,
    }


_PROBES: tuple[tuple[list[dict[str, Any]], list[Any] | None], ...] = (
    (
        [
            {"role": "user", "content": "Hi."},
            _probe_turn("Hello."),
            {"role": "user", "content": "What is 2 + 2?"},
            _probe_turn("4.", "Add them."),
        ],
        None,
    ),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi."},
            _probe_turn("Hello.", "Greet back."),
            {"role": "user", "content": "Bye."},
            _probe_turn("Bye."),
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "List /."},
            _probe_turn("", "Look first.", tool_calls=[_PROBE_CALL]),
            {"role": "tool", "content": "bin etc"},
            _probe_turn("bin and etc."),
        ],
        _PROBE_TOOLS,
    ),
)


def check_template(template: ChatTemplate) -> None:
    """Compile the template and find the role spans of a few small conversations (plain,
    with a system turn, with a tool call); ``ChatTemplateError`` says what fails. A
    conversation the template refuses (``raise_exception``) is skipped: records of that
    shape are dropped at build, not the recipe."""
    check_compiles(template)
    for messages, tools in _PROBES:
        try:
            assistant_spans(template, messages, tools)
        except TemplateRefused:
            continue
