"""The training objective (``training.objective``): SFT trains on assistant tokens, averaged
per token or per conversation.

The losses are checked against a direct computation: per target, then per document, in
plain Python over the same logits. The done-means check runs factory's step on packed chat
documents and compares it with transformers' NemotronH on the exported model, run on each
document alone, over the assistant spans found in the token text.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from blueprint_factory import DELETE, make
from conftest import PRESETS
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import factory
import factory.data_recipes
from factory.errors import BlueprintError
from factory.graph.loss import language_model_loss, micro_batch_share, target_weights
from factory.nn.outputs import ModelOutput
from factory.runtime.batches import MicroBatch
from factory.runtime.step import forward_backward
from factory.schemas.training import ObjectiveConfig

VOCAB = 7
MTP_SCALE = 0.3


class TableModel(nn.Module):
    """Logits from a token table plus a position table; one token table per MTP depth."""

    def __init__(self, seq: int, depths: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.token = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen))
        self.position = nn.Parameter(torch.randn(seq, VOCAB, generator=gen))
        self.depths = nn.ParameterList(
            nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen)) for _ in range(depths)
        )

    def forward(
        self, ids: torch.Tensor, document_ids: torch.Tensor | None = None, logits: bool = True
    ) -> ModelOutput:
        position = self.position[: ids.shape[1]]
        logits = self.token[ids] + position
        mtp = tuple(table[ids] + position for table in self.depths)
        return ModelOutput(logits, mtp, None, {}, logits, {})


def _target_losses(
    logits: torch.Tensor, batch: MicroBatch, shift: int, tag: int
) -> dict[tuple[int, int, int], list[torch.Tensor]]:
    """Per (micro-batch tag, row, document): the cross-entropy of each kept target ``shift``
    ahead, one target at a time."""
    out: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
    rows, seq = batch.input_ids.shape
    for row in range(rows):
        for i in range(seq - shift):
            docs = batch.document_ids
            doc_i = 0 if docs is None else int(docs[row, i])
            doc_t = 0 if docs is None else int(docs[row, i + shift])
            if batch.loss_mask[row, i + shift] and doc_i == doc_t:
                label = batch.input_ids[row, i + shift].view(1)
                ce = F.cross_entropy(logits[row, i].view(1, -1).float(), label)
                out[(tag, row, doc_t)].append(ce)
    return out


def _average(per_doc: dict[tuple[int, int, int], list[torch.Tensor]], average: str) -> torch.Tensor:
    if not per_doc:
        return torch.zeros(())
    if average == "token":
        every = [ce for losses in per_doc.values() for ce in losses]
        return torch.stack(every).sum() / len(every)
    means = [torch.stack(losses).mean() for losses in per_doc.values()]
    return torch.stack(means).mean()


def _direct(model: TableModel, micro: list[MicroBatch], shift: int, average: str) -> torch.Tensor:
    """The step's loss for the head predicting ``shift`` ahead, from per-target losses."""
    per_doc: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    for tag, batch in enumerate(micro):
        out = model(batch.input_ids)
        logits = out.logits if shift == 1 else out.mtp_logits[shift - 2]
        per_doc.update(_target_losses(logits, batch, shift, tag))
    return _average(per_doc, average)


@st.composite
def micro_batches(draw: st.DrawFn, count: int) -> list[MicroBatch]:
    rows = draw(st.integers(1, 2))
    seq = draw(st.integers(4, 12))
    packed = draw(st.booleans())
    micro = []
    for _ in range(count):
        ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=rows * seq, max_size=rows * seq))
        mask = draw(st.lists(st.booleans(), min_size=rows * seq, max_size=rows * seq))
        docs = None
        if packed:
            starts = draw(st.lists(st.booleans(), min_size=rows * seq, max_size=rows * seq))
            docs = torch.tensor(starts, dtype=torch.int64).view(rows, seq).cumsum(1)
        micro.append(
            MicroBatch(
                torch.tensor(ids).view(rows, seq),
                torch.tensor(mask).view(rows, seq),
                docs,
            )
        )
    return micro


@settings(max_examples=40, deadline=None)
@given(data=st.data(), average=st.sampled_from(["token", "conversation"]))
def test_one_micro_batch_every_depth_is_the_direct_average(
    data: st.DataObject, average: str
) -> None:
    (batch,) = data.draw(micro_batches(1))
    model = TableModel(batch.input_ids.shape[1], depths=2, seed=0)
    losses = language_model_loss(
        model(batch.input_ids),
        batch.input_ids,
        batch.loss_mask,
        mtp_loss_scale=MTP_SCALE,
        document_ids=batch.document_ids,
        loss_average=average,
    )
    with torch.no_grad():
        assert torch.allclose(losses.lm, _direct(model, [batch], 1, average), atol=1e-5)
        for depth, mtp in enumerate(losses.mtp, start=1):
            assert torch.allclose(mtp, _direct(model, [batch], depth + 1, average), atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), average=st.sampled_from(["token", "conversation"]))
def test_two_micro_batches_give_the_step_average_and_its_gradients(
    data: st.DataObject, average: str
) -> None:
    """Over grad accumulation the main head's loss, and the gradients, are the direct
    average's over both micro-batches' targets (documents for the conversation average).
    Each MTP depth averages its own targets within a micro-batch and enters with the
    micro-batch's share of the main head's denominator."""
    micro = data.draw(micro_batches(2))
    model = TableModel(micro[0].input_ids.shape[1], depths=2, seed=1)
    outcome = forward_backward(model, micro, MTP_SCALE, loss_average=average)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    lm = _direct(model, micro, 1, average)
    shares = [micro_batch_share(b.loss_mask, b.document_ids, average) for b in micro]
    weights = [share / max(1, sum(shares)) for share in shares]
    depths = [
        sum(w * _direct(model, [b], shift, average) for w, b in zip(weights, micro, strict=True))
        for shift in (2, 3)
    ]
    expected = lm + MTP_SCALE * torch.stack([torch.as_tensor(d) for d in depths]).mean()
    if expected.requires_grad:
        expected.backward()
    assert outcome.lm_loss == pytest.approx(lm.item(), abs=1e-5)
    assert outcome.loss == pytest.approx(expected.item(), abs=1e-5)
    for name, param in model.named_parameters():
        want = param.grad if param.grad is not None else torch.zeros_like(param)
        assert torch.allclose(got[name], want, atol=1e-5), name


def test_conversation_average_weighs_each_document_once() -> None:
    """A long and a short document: the token average leans to the long one, the
    conversation average does not; the weights are 1 / (targets of the document)."""
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    weights, documents = target_weights(mask, docs, 1, "conversation")
    assert documents == 2
    assert torch.allclose(weights, torch.tensor([[0.2] * 5 + [0.0, 1.0]]))
    tokens, count = target_weights(mask, docs, 1, "token")
    assert tokens.dtype == torch.bool and count == 6
    assert micro_batch_share(mask, docs, "conversation") == 2
    assert micro_batch_share(mask, docs, "token") == 6


@pytest.mark.parametrize("average", ["token", "conversation"])
def test_context_parallel_shares_add_up_to_the_whole_sequence(average: str) -> None:
    """A rank's loss over its rows of the sequence divides by the whole sequence's
    denominator, so the ranks' losses add up to the one-process loss."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    mask = torch.rand(2, 16, generator=gen) > 0.3
    docs = (torch.rand(2, 16, generator=gen) > 0.7).long().cumsum(1)
    model = TableModel(16, depths=2, seed=2)
    whole = model(ids)
    full = language_model_loss(whole, ids, mask, MTP_SCALE, docs, average)
    # Megatron's head-tail split over 2 ranks: chunks (0, 3) and (1, 2) of 4.
    shares = []
    for chunks in ((0, 3), (1, 2)):
        positions = torch.cat([torch.arange(c * 4, c * 4 + 4) for c in chunks])
        part = ModelOutput(
            whole.logits[:, positions],
            tuple(t[:, positions] for t in whole.mtp_logits),
            None,
            {},
            whole.hidden,
            {},
            positions,
        )
        shares.append(language_model_loss(part, ids, mask, MTP_SCALE, docs, average))
    assert torch.allclose(shares[0].lm + shares[1].lm, full.lm, atol=1e-6)
    for depth in range(2):
        together = shares[0].mtp[depth] + shares[1].mtp[depth]
        assert torch.allclose(together, full.mtp[depth], atol=1e-6)


def test_token_average_is_the_masked_mean() -> None:
    """The token average is unchanged: the sum of kept losses over the kept count, bit for
    bit."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 10), generator=gen)
    mask = torch.rand(2, 10, generator=gen) > 0.4
    docs = (torch.rand(2, 10, generator=gen) > 0.7).long().cumsum(1)
    out = TableModel(10, depths=0, seed=5)(ids)
    kept = mask[:, 1:] & (docs[:, :-1] == docs[:, 1:])
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    expected = (ce * kept.flatten().float()).sum() / kept.sum().clamp(min=1)
    assert torch.equal(language_model_loss(out, ids, mask, document_ids=docs).lm, expected)


# --- the schema and the validate rule ------------------------------------------------------


def test_pretrain_refuses_the_conversation_average() -> None:
    with pytest.raises(ValueError, match="needs kind 'sft'"):
        ObjectiveConfig(kind="pretrain", loss_average="conversation")
    assert ObjectiveConfig().kind == "pretrain" and ObjectiveConfig().loss_average == "token"


def _diagnostics(path: Path) -> list[str]:
    with pytest.raises(BlueprintError) as caught:
        factory.load_blueprint(path)
    return [d.format() for d in caught.value.diagnostics]


def test_schema_refusal_is_located(write_yaml) -> None:
    path = write_yaml(
        f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  objective:\n"
        "    kind: pretrain\n    loss_average: conversation\n"
    )
    (line,) = _diagnostics(path)
    assert line.startswith(f"{path}:5: training.objective.loss_average: ")
    assert "needs kind 'sft'" in line


def test_sft_on_a_recipe_with_text_sources_is_refused(write_yaml) -> None:
    # Nano's sections alone (its program's own SFT stage names a chat recipe) on the mixed
    # 'nano' recipe
    path = write_yaml(
        f"extends: {PRESETS / 'nano.yaml'}\ntraining:\n  objective:\n    kind: sft\n"
        "stages: null\ndata:\n  recipe: nano\n"
    )
    (line,) = _diagnostics(path)
    assert line.startswith(f"{path}:4: training.objective.kind: ")
    for source in ("pretrain_text (text)", "code (text)", "long_context (text)"):
        assert source in line
    assert "math" not in line  # a chat source masks its prompts
    assert "[data.sft_loss_masks]" in line


def test_sft_on_a_chat_recipe_passes(write_yaml, tmp_path: Path) -> None:
    recipe = write_yaml(
        "name: chat_only\nsources:\n"
        "  - {name: talk, path: talk.jsonl, category: conversational, weight: 1,"
        " steps: [{kind: chat}]}\n"
        "  - {name: agent, path: agent.jsonl, category: swe_trajectory, weight: 1,"
        " steps: [{kind: chat}, {kind: trajectory}]}\n",
        name="chat_only.yaml",
    )
    path = write_yaml(
        f"extends: {PRESETS / 'nano.yaml'}\ndata:\n  recipe: {recipe}\n"
        "training:\n  objective:\n    kind: sft\n    loss_average: conversation\n"
        "stages: null\n"
    )
    bp = factory.load_blueprint(path)
    assert bp.training.objective == ObjectiveConfig(kind="sft", loss_average="conversation")


# --- done means: the SFT loss counts only assistant tokens, checked with transformers ---


def _chat_documents() -> list:
    """Real chat records of the shipped samples, rendered by factory's chat formatter."""
    from factory.data.steps.formatting import format_chat
    from factory.data.steps.records import RawRecord
    from factory.schemas.data_recipe import ReasoningConfig

    samples = Path(factory.data_recipes.__file__).parent / "samples"
    docs = []
    for name, count in (("conversational", 4), ("math", 3), ("multilingual_safety", 1)):
        lines = (samples / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[:count]
        for i, text in enumerate(lines):
            record = RawRecord(f"{name}-{i}", name, name, json.loads(text))
            rendered = format_chat(record, ReasoningConfig(), record.key)
            assert isinstance(rendered, list)
            docs.extend(rendered)
    return docs


def _assistant_targets(ids: list[int], tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Indices of the tokens between ``<|im_start|>assistant\\n`` and the next ``<|im_end|>``,
    that token included, found from the tokens' text alone."""
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    targets: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i] != start:
            i += 1
            continue
        header = i + 1
        while header < len(ids) and len(tokenizer.decode(ids[i + 1 : header])) < 10:
            header += 1
        role = tokenizer.decode(ids[i + 1 : header])
        close = ids.index(end, header)
        if role == "assistant\n":
            targets.extend(range(header, close + 1))
        else:
            assert not role.startswith("assistant"), role
        i = close + 1
    return targets


def test_sft_loss_counts_only_assistant_tokens_as_transformers_computes_it(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    from factory.data.shards.shard_reader import Sample
    from factory.data.stages.packing import TokenizedDoc, packed_sample
    from factory.data.steps.tokenize import DocumentTokenizer
    from factory.exports.hf import write_hf_checkpoint
    from factory.runtime.batches import collate

    tokenizer = DocumentTokenizer()
    encoded = tokenizer.encode(_chat_documents())
    seq = 512
    # Pack in order into sequences of `seq`: two micro-batches of two rows each.
    rows: list[list[TokenizedDoc]] = [[]]
    for n, doc in enumerate(encoded):
        if sum(len(d.ids) for d in rows[-1]) + len(doc.ids) > seq:
            rows.append([])
        rows[-1].append(TokenizedDoc(f"d{n}", doc.ids, doc.mask))
    assert len(rows) == 4, [sum(len(d.ids) for d in row) for row in rows]
    packed = [packed_sample(row, seq, tokenizer.pad_id) for row in rows]
    micro = [
        collate([Sample(p.tokens, p.loss_mask, p.cu_seqlens) for p in packed[k : k + 2]])
        for k in (0, 2)
    ]

    bp = make(**{"model.pattern": "M*-M-", "model.moe": DELETE, "model.vocab_size": 4096})
    compiled = factory.compile(bp, seed=7, precision="off")
    write_hf_checkpoint(compiled.model, compiled.blueprint, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf.eval()

    # Direct: each packed document run alone through transformers, cross-entropy over the
    # assistant spans of its token text.
    per_doc: list[torch.Tensor] = []
    for row in rows:
        for doc in row:
            ids = doc.ids.tolist()
            targets = _assistant_targets(ids, tokenizer.tokenizer)
            assert targets and 0 not in targets
            assert doc.mask.nonzero()[0].tolist() == targets  # factory's mask: these alone
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0]
            where = torch.tensor(targets)
            per_doc.append(
                F.cross_entropy(logits[where - 1], torch.tensor(ids)[where], reduction="none")
            )
    token_average = torch.cat(per_doc).mean()
    conversation_average = torch.stack([losses.mean() for losses in per_doc]).mean()
    assert not torch.isclose(token_average, conversation_average, atol=1e-4)

    # factory: the training step on the packed micro-batches.
    assigned = sum(len(losses) for losses in per_doc)
    assert sum(int(batch.target_mask.sum()) for batch in micro) == assigned
    for average, expected in (("token", token_average), ("conversation", conversation_average)):
        compiled.model.zero_grad()
        outcome = forward_backward(compiled.model, micro, 0.0, loss_average=average)
        assert outcome.lm_loss == pytest.approx(float(expected), abs=1e-5), average
        assert outcome.loss == pytest.approx(float(expected), abs=1e-5), average
