"""A recipe's chat template: the shipped ChatML template is the built-in format, masks follow
the roles under any template, renders match transformers', and bad templates are refused."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

import factory.data_recipes
from factory.data.build_job import build
from factory.data.loaded_recipe import load_recipe, recipe_hash
from factory.data.steps.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    read_template_file,
    render,
)
from factory.data.steps.formatting import (
    Drop,
    _parse,
    _template_message,
    format_chat,
)
from factory.data.steps.records import Document, RawRecord
from factory.data.steps.tokenize import DocumentTokenizer
from factory.errors import BlueprintError
from factory.schemas.data_recipe import ReasoningConfig

RECIPES = Path(factory.data_recipes.__file__).parent
CHATML = RECIPES / "templates" / "chatml.jinja"
SAMPLES = RECIPES / "samples"
CHAT_SAMPLES = (
    "conversational.jsonl",
    "cuda_kernel.jsonl",
    "math.jsonl",
    "multilingual_safety.jsonl",
    "search_trajectory.jsonl",
    "stem_synthetic.jsonl",
    "swe_trajectory.jsonl",
    "terminal.jsonl.gz",
)
POLICIES = (
    ReasoningConfig(),
    ReasoningConfig(strip_fraction=0.3, truncate_fraction=0.3, truncate_max_chars=40),
    ReasoningConfig(trace="mask", drop_previous_turns=False, truncate_fraction=0.5),
    ReasoningConfig(split_turns=True, truncate_fraction=0.4),
    ReasoningConfig(strip_fraction=0.1, truncate_fraction=0.5, truncated_close="train"),
)

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""A Llama-3-style header template: no think block, no trailing newline, a BOS first."""


def _records(name: str) -> list[RawRecord]:
    path = SAMPLES / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return [
            RawRecord(f"{name}:0:{i + 1}", name.split(".")[0], "conversational", json.loads(line))
            for i, line in enumerate(lines)
        ]


def _trained(doc: Document) -> list[str]:
    return [text for text, trains in doc.segments if trains]


@pytest.mark.parametrize("name", CHAT_SAMPLES)
def test_shipped_chatml_template_is_the_builtin_format(name: str) -> None:
    """Same text, same segments (so the same tokens and mask), same meta and drops, for
    every shipped chat record under policies that strip, truncate, mask and split."""
    template = read_template_file(CHATML)
    tokenizer = DocumentTokenizer()
    modes: set[str] = set()
    for record in _records(name):
        for policy in POLICIES:
            builtin = format_chat(record, policy, record.key, 7)
            templated = format_chat(record, policy, record.key, 7, template)
            assert templated == builtin, (record.key, policy)
            if isinstance(builtin, list):
                modes.update(doc.meta["reasoning"] for doc in builtin)
                for ours, theirs in zip(
                    tokenizer.encode(templated), tokenizer.encode(builtin), strict=True
                ):
                    assert (ours.ids == theirs.ids).all() and (ours.mask == theirs.mask).all()
    if name != "cuda_kernel.jsonl":  # its one assistant turn per record may lack reasoning
        assert {"full", "stripped", "truncated"} <= modes, modes


def _conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "Six.", "reasoning_content": "Add again."},
    ]


def test_llama3_style_template_trains_exactly_the_assistant_turns() -> None:
    template = ChatTemplate(LLAMA3, "test", (("bos_token", "<|begin_of_text|>"),))
    record = RawRecord("src:0:1", "src", "conversational", {"messages": _conversation()})
    (doc,) = format_chat(record, ReasoningConfig(), record.key, 0, template)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert doc.text == (
        "<|begin_of_text|>"
        + header.format("system")
        + "Be brief.<|eot_id|>"
        + header.format("user")
        + "What is 2 + 2?<|eot_id|>"
        + header.format("assistant")
        + "Four.<|eot_id|>"
        + header.format("user")
        + "And 3 + 3?<|eot_id|>"
        + header.format("assistant")
        + "Six.<|eot_id|>"
    )
    # The assistant header is the generation prompt: it does not train; the end token does.
    assert _trained(doc) == ["Four.<|eot_id|>", "Six.<|eot_id|>"]

    # Token by token: the trained tokens are the assistant turns' own, and the EOS.
    tokenizer = DocumentTokenizer()
    (encoded,) = tokenizer.encode([doc])
    tok = tokenizer.tokenizer
    answers = [tok.encode(text, add_special_tokens=False).ids for text in _trained(doc)]
    trained_ids = encoded.ids[encoded.mask.astype(bool)].tolist()
    assert trained_ids == [*answers[0], *answers[1], tokenizer.eos_id]

    # One document per user turn: the earlier answer is context, not trained.
    split = format_chat(record, ReasoningConfig(split_turns=True), record.key, 0, template)
    assert isinstance(split, list) and [_trained(d) for d in split] == [
        ["Four.<|eot_id|>"],
        ["Six.<|eot_id|>"],
    ]


def test_truncated_budget_masks_the_templates_close_tag() -> None:
    """A template of its own layout: ``</think>`` is found in the assistant span and kept
    out of the loss; with trace=mask, the whole think block is."""
    text = (
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.role == 'assistant' %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
        "{{ m.content }}[end]\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    template = ChatTemplate(text, "test")
    messages = _conversation()[1:3]
    messages[1]["reasoning_content"] = "x" * 100
    record = RawRecord("k", "src", "math", {"messages": messages})
    policy = ReasoningConfig(truncate_fraction=1.0, truncate_max_chars=10)
    (doc,) = format_chat(record, policy, "k", 0, template)
    budget = doc.meta["reasoning_budget"]
    assert doc.meta["reasoning"] == "truncated" and 1 <= budget <= 10
    assert _trained(doc) == ["<think>" + "x" * budget, "\nFour.[end]"]
    assert "</think>" in doc.text

    # Nano's and Super's policy: </think> trains after a truncated trace too.
    trains_close = ReasoningConfig(
        truncate_fraction=1.0, truncate_max_chars=10, truncated_close="train"
    )
    (closed,) = format_chat(record, trains_close, "k", 0, template)
    assert _trained(closed) == ["<think>" + "x" * budget + "</think>\nFour.[end]"]

    masked = format_chat(record, ReasoningConfig(trace="mask"), "k", 0, template)
    assert isinstance(masked, list) and _trained(masked[0]) == ["Four.[end]"]

    # A trace closed by another tag cannot be masked: refused, not trained unmasked.
    other = ChatTemplate(text.replace("</think>", "</reasoning>"), "other.jinja")
    with pytest.raises(ChatTemplateError, match="renders message 1's reasoning without it"):
        format_chat(record, policy, "k", 0, other)
    # Under a policy that masks nothing of the trace, the tag does not matter.
    (full,) = format_chat(record, ReasoningConfig(), "k", 0, other)
    assert _trained(full) == ["<think>" + "x" * 100 + "</reasoning>\nFour.[end]"]
    (cut,) = format_chat(record, trains_close, "k", 0, other)
    assert _trained(cut) == ["<think>" + "x" * budget + "</reasoning>\nFour.[end]"]


def test_a_template_that_rewrites_history_is_refused_naming_the_record() -> None:
    """Reasoning shown on the last assistant turn only (Qwen3's rule, by position): rendering
    the first answer alone shows its trace, the whole conversation does not."""
    text = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' and loop.last %}{{ m.reasoning_content }}|{% endif %}"
        "{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    template = ChatTemplate(text, "qwen-like.jinja")
    record = RawRecord("src:3:14", "src", "math", {"messages": _conversation()})
    policy = ReasoningConfig(drop_previous_turns=False)
    with pytest.raises(ChatTemplateError) as info:
        format_chat(record, policy, record.key, 0, template)
    message = str(info.value)
    assert message.startswith("record src:3:14 (source src): chat template qwen-like.jinja: ")
    assert "rendering messages[:3] is not a prefix of rendering messages[:4]" in message


def test_a_conversation_the_template_raises_on_is_dropped() -> None:
    text = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    record = RawRecord("k", "src", "math", {"messages": _conversation()})
    assert format_chat(record, ReasoningConfig(), "k", 0, ChatTemplate(text, "t")) == Drop(
        "chat_template_refused"
    )


TEMPLATES = {"chatml": CHATML.read_text(encoding="utf-8"), "llama3": LLAMA3}


@pytest.mark.parametrize("which", sorted(TEMPLATES))
def test_renders_equal_transformers_apply_chat_template(which: str) -> None:
    """The same messages (as the formatter passes them: tool calls in OpenAI form, reasoning
    under both names) and tools give transformers' text, with and without the prompt."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(RECIPES / "tokenizer" / "tokenizer.json"))
    hf.chat_template = TEMPLATES[which]
    ours = ChatTemplate(TEMPLATES[which], which)
    compared = 0
    for name in ("conversational.jsonl", "swe_trajectory.jsonl", "math.jsonl"):
        for record in _records(name)[:25]:
            parsed = _parse(record.data)
            if isinstance(parsed, Drop):  # a planted defect
                continue
            turns, tools = parsed
            messages = [_template_message(t, t.reasoning) for t in turns]
            for prompt in (False, True):
                expected = hf.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=prompt
                )
                assert render(ours, messages, tools, prompt) == expected, record.key
                compared += 1
    assert compared >= 140


def _recipe(tmp_path: Path, tokenizer: str) -> Path:
    records = _records("conversational.jsonl")[:40]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r.data) + "\n" for r in records))
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: r\nseed: 5\nsources:\n"
        "  - name: chat\n    path: chat.jsonl\n    category: conversational\n    weight: 1\n"
        "    steps: [{kind: chat, reasoning: {strip_fraction: 0.2, truncate_fraction: 0.2}}]\n"
        "packing: {seq_len: 1024, window: 64}\n"
        "output: {samples_per_shard: 8}\n" + tokenizer
    )
    return path


def _errors(path: Path) -> list[str]:
    with pytest.raises(BlueprintError) as info:
        load_recipe(path)
    return [d.format().removeprefix(f"{path.parent}/") for d in info.value.diagnostics]


def test_recipe_reads_a_template_file_or_a_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "chat.jinja").write_text(CHATML.read_text())
    config = {
        "chat_template": [{"name": "default", "template": LLAMA3}],
        "bos_token": {"content": "<|begin_of_text|>", "special": True},
        "eos_token": "<|eot_id|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    plain = load_recipe(_recipe(tmp_path, ""))
    jinja = load_recipe(_recipe(tmp_path, "tokenizer: {chat_template_file: chat.jinja}\n"))
    assert jinja.chat_template is not None and jinja.chat_template.text == CHATML.read_text()
    hf = load_recipe(_recipe(tmp_path, "tokenizer: {chat_template_file: tokenizer_config.json}\n"))
    assert hf.chat_template is not None and hf.chat_template.text == LLAMA3
    assert dict(hf.chat_template.special_tokens) == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    }
    # The hash follows the template's text, which a file holds outside the recipe.
    assert len({recipe_hash(plain), recipe_hash(jinja), recipe_hash(hf)}) == 3


def test_bad_templates_fail_at_load_time_where_they_are_written(tmp_path: Path) -> None:
    errors = _errors(_recipe(tmp_path, "tokenizer: {chat_template_file: missing.jinja}\n"))
    assert errors == ["r.yaml:11: tokenizer.chat_template_file: chat template file not found"]
    errors = _errors(_recipe(tmp_path, "tokenizer: {chat_template: '{% for m in messages %}'}\n"))
    assert len(errors) == 1 and errors[0].startswith("r.yaml:11: tokenizer.chat_template: ")
    assert "line 1: Unexpected end of template" in errors[0]
    rewrites = "{% for m in messages %}{{ m.content if loop.last else '' }}{% endfor %}"
    errors = _errors(_recipe(tmp_path, f'tokenizer: {{chat_template: "{rewrites}"}}\n'))
    assert len(errors) == 1 and "is not a prefix of rendering" in errors[0]
    both = "tokenizer: {chat_template: x, chat_template_file: chat.jinja}\n"
    assert any(
        "give at most one of chat_template and chat_template_file" in e
        for e in _errors(_recipe(tmp_path, both))
    )
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    errors = _errors(_recipe(tmp_path, "tokenizer: {chat_template_file: tokenizer_config.json}\n"))
    assert len(errors) == 1 and "has no chat_template string" in errors[0]


def _published(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.parts and p.name != "manifest.json"
    }


def test_a_build_with_the_chatml_template_equals_the_builtin_whatever_the_workers(
    tmp_path: Path,
) -> None:
    (tmp_path / "chat.jinja").write_text(CHATML.read_text())
    builtin = _recipe(tmp_path, "")
    build(builtin, tmp_path / "builtin")
    templated = _recipe(tmp_path, "tokenizer: {chat_template_file: chat.jinja}\n")
    build(templated, tmp_path / "one")
    build(templated, tmp_path / "two", workers=2)
    shards = _published(tmp_path / "builtin")
    assert any(name.endswith(".tar") for name in shards)
    assert _published(tmp_path / "one") == shards
    assert _published(tmp_path / "two") == shards


def test_a_record_the_template_cannot_mask_stops_the_build_naming_it(tmp_path: Path, cli) -> None:
    """Validate's small conversations pass (they carry no tool_call_id); the first sample
    record whose tool result is followed by an answer does not."""
    text = (
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.tool_call_id is defined and loop.last %}X{% endif %}{{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    recipe = _recipe(tmp_path, f"tokenizer: {{chat_template: {json.dumps(text)}}}\n")
    load_recipe(recipe)
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "out"))
    assert status == 2
    assert f"factory: {recipe}: record chat:0:" in err
    assert "(source chat): chat template tokenizer.chat_template: rendering messages[:" in err
    assert "is not a prefix of rendering" in err
    assert not (tmp_path / "out" / "manifest.json").exists()
