"""``factory eval``: on an HF export it is transformers' own loss on the same tokens; on a run
folder it is what the run's ``training.eval`` recorded; bad input exits 2 naming the flag."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from heldout_fixtures import CATEGORIES, add_heldout_sets
from runtime_helpers import STEPS, tiny_blueprint

import factory
from factory.data.shards.heldout import heldout_sets
from factory.exports.hf import write_hf_checkpoint
from factory.jobs.evaluate import EvalRefused, evaluate_model, prepare_eval
from factory.jobs.train_errors import CannotLaunch
from factory.jobs.train_request import RUN_FILE
from factory.report.run_metrics import read_metrics
from factory.runtime.batches import build_shards
from factory.runtime.evaluation import heldout_micro_batches

transformers = pytest.importorskip("transformers")

TOKENS = 6 * 64  # six samples of each set
RUN_STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_shards(tiny_blueprint(), tmp_path_factory.mktemp("eval-data"))
    return add_heldout_sets(out)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # transformers computes unquantized: the export of the graph without its NVFP4 policy.
    compiled = factory.compile(tiny_blueprint(), seed=5, precision="off")
    folder = tmp_path_factory.mktemp("eval-export")
    write_hf_checkpoint(compiled.model, compiled.blueprint, folder)
    return folder


def _transformers_sums(hf: torch.nn.Module, folder: Path) -> tuple[float, int]:
    """(summed next-token cross-entropy, targets) of transformers' model on the same samples,
    each packed document run alone (as our graph keeps them apart), a target counted where
    the sample's loss mask marks it and it is of the same document."""
    total, count = 0.0, 0
    for batch in heldout_micro_batches(folder, TOKENS, 1):
        ids, mask, docs = batch.input_ids[0], batch.loss_mask[0], batch.document_ids[0]
        for document in torch.unique(docs):
            where = (docs == document).nonzero().flatten()
            first, last = int(where[0]), int(where[-1]) + 1
            if last - first < 2:
                continue
            segment = ids[first:last].unsqueeze(0)
            with torch.no_grad():
                logits = hf(segment).logits[0, :-1].double()
            kept = mask[first + 1 : last]
            losses = torch.nn.functional.cross_entropy(logits, segment[0, 1:], reduction="none")
            total += float(losses[kept].sum())
            count += int(kept.sum())
    return total, count


def test_eval_of_an_hf_export_is_transformers_loss_on_the_same_tokens(
    data: Path, export: Path
) -> None:
    result = evaluate_model(export, data, tokens=TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    hf.eval()
    ours = {r.category: r for r in result.records}
    sums, counts = 0.0, 0
    for category, held in heldout_sets(data).items():
        total, count = _transformers_sums(hf, held.folder)
        assert ours[category].tokens == count
        assert ours[category].loss == pytest.approx(total / count, rel=1e-5)
        sums, counts = sums + total, counts + count
    assert ours[None].tokens == counts
    assert ours[None].loss == pytest.approx(sums / counts, rel=1e-5)
    assert sorted(ours[None].mtp_losses) == ["1", "2"]  # the export keeps the MTP heads


def test_the_cli_prints_a_table_and_json(cli, data: Path, export: Path) -> None:
    os.environ["COLUMNS"] = "200"
    status, out, err = cli("eval", str(export), "--data", str(data), "--tokens", str(TOKENS))
    assert status == 0, err
    for name in (*CATEGORIES, "all", "perplexity"):
        assert name in out
    status, out, err = cli(
        "eval", str(export), "--data", str(data), "--json", "--set", "code", "--tokens", "128"
    )
    assert status == 0, err
    printed = json.loads(out)
    assert [r["category"] for r in printed["results"]] == ["code", None]
    code = printed["results"][0]
    assert code["perplexity"] == pytest.approx(math.exp(code["loss"]))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["{tmp}/nowhere", "--data", "{data}"], "MODEL_OR_RUN"),
        (["{tmp}", "--data", "{data}"], "MODEL_OR_RUN"),  # neither a run nor an HF folder
        (["{export}"], "--data"),  # an HF folder needs data
        (["{export}", "--data", "{tmp}"], "--data"),  # no manifest.json
        (["{export}", "--data", "{data}", "--set", "maths"], "--set"),
        (["{export}", "--data", "{data}", "--step", "3"], "--step"),
        (["{export}", "--data", "{data}", "--tokens", "0"], "--tokens"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(
    cli, tmp_path: Path, data: Path, export: Path, args: list[str], named: str
) -> None:
    filled = [a.format(tmp=tmp_path, data=data, export=export) for a in args]
    status, _, err = cli("eval", *filled)
    assert status == 2
    assert f"factory eval: {named}:" in err


@pytest.fixture(scope="module")
def run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    evaluation = {"interval": 2, "tokens": TOKENS}
    training = {"steps": RUN_STEPS, "checkpoint_interval": 2, "eval": evaluation}
    bp = tiny_blueprint(training=training)
    out = tmp_path_factory.mktemp("eval-run") / "run"
    factory.train(bp, out=out, data=data, precision="emulate")
    return out


def test_eval_of_a_run_is_what_its_training_recorded(run: Path) -> None:
    recorded = read_metrics(run).heldout
    assert sorted({r.step for r in recorded}) == [2, RUN_STEPS]
    assert json.loads((run / RUN_FILE).read_text())["precision"] == "emulate"
    for step in (2, RUN_STEPS):
        result = evaluate_model(run, step=step)  # the data it trained on, its tokens
        at_step = [r for r in recorded if r.step == step]
        assert [(r.category, r.tokens) for r in result.records] == [
            (r.category, r.tokens) for r in at_step
        ]
        for ours, theirs in zip(result.records, at_step, strict=True):
            assert ours.loss == pytest.approx(theirs.loss, rel=1e-12, abs=0)
            assert ours.mtp_losses == pytest.approx(theirs.mtp_losses, rel=1e-12)


def test_a_run_without_that_checkpoint_names_step(run: Path) -> None:
    with pytest.raises(EvalRefused, match=r"--step: .* has no checkpoint of step 1"):
        prepare_eval(run, step=1)


def test_training_refuses_a_set_the_build_lacks(data: Path, tmp_path: Path) -> None:
    bp = tiny_blueprint(training={"steps": STEPS, "eval": {"interval": 4, "sets": ["maths"]}})
    with pytest.raises(
        CannotLaunch, match=r"training.eval.sets: .* no held-out set 'maths'"
    ) as exc:
        factory.train(bp, out=tmp_path / "run", data=data)
    assert exc.value.path == "training.eval.sets"
    assert not (tmp_path / "run").exists()


def test_training_refuses_evaluation_on_a_build_without_heldout_sets(
    tmp_path: Path, data: Path
) -> None:
    bp = tiny_blueprint(training={"steps": STEPS, "eval": {"interval": 4}})
    plain = data / "heldout" / "web"  # a built folder that has no held-out sets of its own
    with pytest.raises(CannotLaunch, match="has no held-out sets") as exc:
        factory.train(bp, out=tmp_path / "run", data=plain)
    assert exc.value.path == "training.eval.sets"


def test_eval_reads_the_heldout_sets_a_recipe_build_sets_aside(
    export: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The shipped recipe holds out documents per source: the build's own sets, as the data
    build writes them, are what factory eval reads."""
    built = build_shards(tiny_blueprint(), tmp_path_factory.mktemp("eval-recipe-build"))
    sets = heldout_sets(built)
    assert sets  # the recipe sets documents aside
    result = evaluate_model(export, built, tokens=256)
    assert [r.category for r in result.records] == [*sets, None]
    for record in result.records[:-1]:
        assert 0 < record.tokens <= sets[record.category].tokens
        assert math.isfinite(record.loss)
