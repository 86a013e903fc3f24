"""The held-out split of a data build: disjoint from training by document, the same bytes for
any worker count, resumable, counted apart from the mixture, and bad settings refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from factory.data.build_job import build
from factory.data.samples import generate
from factory.data.shards.heldout import heldout_sets
from factory.data.shards.manifest import verify
from factory.data.shards.shard_reader import read_samples
from factory.data.stages.heldout_split import SPLIT_VALUES, held_out, split_value
from factory.schemas.data_recipe import HeldoutSplit
from tests.shard_reference import read_shard

RECIPE = {
    "name": "held",
    "seed": 3,
    "heldout": {"fraction": 0.1},
    "sources": [
        {"name": "web", "path": "in/web.jsonl", "category": "pretrain_text", "weight": 2,
         "steps": [{"kind": "text"}]},
        {"name": "code", "path": "in/code", "category": "code", "weight": 1,
         "steps": [{"kind": "text"}], "heldout": {"tokens": 3000}},
        {"name": "math", "path": "in/math.jsonl", "category": "math", "weight": 1,
         "steps": [{"kind": "chat"}]},
        {"name": "more_math", "path": "in/more_math.jsonl", "category": "math", "epochs": 2,
         "steps": [{"kind": "chat"}], "heldout": {"fraction": 0.2}},
        {"name": "cuda", "path": "in/cuda.jsonl", "category": "cuda_kernel", "weight": 1,
         "steps": [{"kind": "chat"}], "heldout": {"fraction": 0}},
    ],
    "packing": {"seq_len": 2048, "window": 64},
    "output": {"samples_per_shard": 8},
}  # fmt: skip


def _jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _recipe(root: Path, recipe: dict) -> Path:
    path = root / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("held")
    web = list(generate("pretrain_text", 120, 1))
    _jsonl(root / "in/web.jsonl", web + web[:6])  # exact duplicates: dedup keeps one of each
    code = list(generate("code", 60, 2))
    for part in range(3):  # three units: the split's token count spans files
        _jsonl(root / f"in/code/{part}.jsonl", code[part * 20 : (part + 1) * 20])
    _jsonl(root / "in/math.jsonl", list(generate("math", 60, 3)))
    _jsonl(root / "in/more_math.jsonl", list(generate("stem_synthetic", 40, 5)))
    _jsonl(root / "in/cuda.jsonl", list(generate("cuda_kernel", 30, 4)))
    _recipe(root, RECIPE)
    return root


@pytest.fixture(scope="module")
def built(inputs: Path) -> Path:
    out = inputs / "one"
    build(inputs / "held.yaml", out)
    return out


def _published(out: Path) -> dict[str, str]:
    """sha256 of every published file (not the ``.work`` intermediates)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.relative_to(out).parts
    }


def _documents(folder: Path) -> list[tuple[str, str]]:
    """(document key, sha256 of its tokens) of every packed document of a built folder (the
    recipe packs to 2048, which no test document passes, so none is cut into pieces)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    documents = []
    for shard in manifest["shards"]:
        for sample in read_shard(folder / shard["name"]):
            bounds = sample.cu_seqlens.tolist()
            for key, start, end in zip(sample.doc_keys, bounds[:-1], bounds[1:], strict=True):
                digest = hashlib.sha256(sample.tokens[start:end].tobytes()).hexdigest()
                documents.append((key.split("#")[0], digest))  # key#n: an upsampled copy
    return documents


def test_heldout_documents_are_never_in_training_shards(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    sets = heldout_sets(built)
    assert set(sets) == {"pretrain_text", "code", "math"}  # cuda's fraction 0 holds none out
    training = _documents(built)
    train_keys, train_hashes = {k for k, _ in training}, {h for _, h in training}
    for category, held in sets.items():
        documents = _documents(held.folder)
        assert len(documents) == held.documents > 0
        assert not {h for _, h in documents} & train_hashes, category
        assert not {k for k, _ in documents} & train_keys, category
        assert sum(int(n) for n in read_samples(held.folder)[1].sum(axis=1)) <= held.tokens
        assert verify(held.folder) == []
        listed = manifest["heldout"][category]
        assert listed["folder"] == f"heldout/{category}"
        assert sum(s["documents"] for s in listed["sources"].values()) == held.documents
    assert set(manifest["heldout"]["math"]["sources"]) == {"math", "more_math"}


def test_heldout_tokens_are_outside_the_mixture(built: Path) -> None:
    """The training counts (per source, per category, the packed tokens) hold no held-out
    token, and each source's documents are split exactly between the two sides."""
    manifest = json.loads((built / "manifest.json").read_text())
    sources = manifest["sources"]
    trained = sum(s["after"]["tokens"] for s in sources.values())
    assert trained == manifest["packing"]["tokens"]
    assert trained == sum(c["tokens"] for c in manifest["categories"].values())
    for name, entry in sources.items():
        steps = entry["steps"]
        if name == "cuda":
            assert "heldout" not in entry and "heldout" not in steps
            continue
        held = entry["heldout"]
        assert steps["heldout"]["documents_in"] == steps["dedup"]["documents_out"]
        assert (
            steps["heldout"]["documents_out"] + held["documents"] == steps["dedup"]["documents_out"]
        )
        assert steps["heldout"]["tokens_out"] + held["tokens"] == steps["dedup"]["tokens_out"]
        assert entry["mix"]["available_tokens"] == steps["heldout"]["tokens_out"]
    assert sources["code"]["heldout"]["declared"] == {"tokens": 3000}
    assert sources["web"]["heldout"]["declared"] == {"fraction": 0.1}
    # Token count: documents in hash order until 3000 tokens, so at least that many.
    assert sources["code"]["heldout"]["tokens"] >= 3000


def test_same_bytes_whatever_the_worker_count(inputs: Path, built: Path) -> None:
    out = inputs / "two"
    build(inputs / "held.yaml", out, workers=2)
    assert _published(out) == _published(built)
    assert any(name.startswith("heldout/code/shards/") for name in _published(out))


def test_a_build_stopped_while_writing_heldout_shards_resumes_to_the_same_bytes(
    inputs: Path, built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import factory.data.stages.write_shards as write_shards

    real = write_shards.write_planned_shard

    def stopped(out: Path, *args: object) -> dict:
        if "heldout" in Path(out).parts and Path(out).name == "math":
            raise KeyboardInterrupt  # where SIGKILL would have stopped it
        return real(out, *args)

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(write_shards, "write_planned_shard", stopped)
        with pytest.raises(KeyboardInterrupt):
            build(inputs / "held.yaml", out)
    assert (out / ".work" / "split.json").is_file() and not (out / "manifest.json").exists()
    build(inputs / "held.yaml", out)
    assert _published(out) == _published(built)


def test_the_seed_decides_the_split(inputs: Path, built: Path, tmp_path: Path) -> None:
    reseeded = _recipe(tmp_path, {**RECIPE, "seed": 4, "name": "reseeded"})
    (tmp_path / "in").symlink_to(inputs / "in")
    build(reseeded, tmp_path / "out")
    before = {k for k, _ in _documents(heldout_sets(built)["pretrain_text"].folder)}
    after = {k for k, _ in _documents(heldout_sets(tmp_path / "out")["pretrain_text"].folder)}
    assert before != after


def test_a_token_count_takes_documents_in_hash_order() -> None:
    from factory.data.stages.heldout_split import _threshold

    values = np.array([50, 10, 40, 10, 30], dtype=np.uint64)  # two equal contents (10)
    lengths = np.array([5, 3, 7, 3, 2], dtype=np.int64)
    threshold = _threshold(HeldoutSplit(tokens=8), values, lengths)
    # 10, 10 (6 tokens), then 30 (8): reached at value 30
    assert held_out(values, threshold).tolist() == [False, True, False, True, True]
    # equal contents go together: 5 tokens ask for both 10s (6), never one of them
    assert held_out(values, _threshold(HeldoutSplit(tokens=5), values, lengths)).sum() == 2
    everything = _threshold(HeldoutSplit(tokens=1000), values, lengths)
    assert everything == SPLIT_VALUES and held_out(values, everything).all()
    fraction = _threshold(HeldoutSplit(fraction=0.25), values, lengths)
    assert fraction == SPLIT_VALUES // 4


def test_the_split_value_depends_on_content_and_seed_only() -> None:
    a, b = b"a" * 16, b"b" * 16
    assert split_value(0, a) == split_value(0, a)
    assert len({split_value(0, a), split_value(1, a), split_value(0, b)}) == 3
    values = np.array(
        [split_value(7, i.to_bytes(16, "little")) for i in range(4000)], dtype=np.uint64
    )
    share = held_out(values, int(0.1 * SPLIT_VALUES)).mean()
    assert 0.08 < share < 0.12  # a fraction of documents, not of anything else


@pytest.mark.parametrize(
    ("heldout", "message"),
    [
        ({"fraction": 1.0}, "sources[0].heldout.fraction: "),
        ({"fraction": -0.1}, "sources[0].heldout.fraction: "),
        ({"fraction": 0.1, "tokens": 10}, "sources[0].heldout: "),
        ({}, "sources[0].heldout: "),
        ({"tokens": 0}, "sources[0].heldout.tokens: "),
        ({"fracton": 0.1}, "did you mean 'fraction'?"),
    ],
)
def test_malformed_splits_fail_validation_at_their_line(
    tmp_path: Path, cli, heldout: dict, message: str
) -> None:
    _jsonl(tmp_path / "web.jsonl", list(generate("pretrain_text", 5, 1)))
    source = {"name": "web", "path": "web.jsonl", "category": "pretrain_text", "weight": 1,
              "steps": [{"kind": "text"}], "heldout": heldout}  # fmt: skip
    recipe = _recipe(tmp_path, {"name": "bad", "sources": [source]})
    status, _, err = cli("validate", str(recipe))
    assert status == 2
    assert "bad.yaml:" in err and message in err, err


def test_a_split_that_leaves_nothing_to_train_on_is_refused_at_its_line(
    inputs: Path, tmp_path: Path, cli
) -> None:
    greedy = {**RECIPE, "name": "greedy", "sources": [dict(s) for s in RECIPE["sources"]]}
    greedy["sources"][1]["heldout"] = {"tokens": "1M"}
    recipe = _recipe(inputs, greedy)
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 2
    lines = recipe.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "tokens: 1M" in text)
    assert f"greedy.yaml:{line - 1}: sources[1].heldout: source 'code': " in err, err
    assert "takes all" in err and "none is left to train on" in err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_split_too_small_to_take_a_document_warns(inputs: Path, tmp_path: Path, cli) -> None:
    stingy = {**RECIPE, "name": "stingy", "heldout": {"fraction": 1e-9}}
    recipe = _recipe(inputs, stingy)
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 0, err
    assert "source 'web' held out no document" in err
    sets = heldout_sets(tmp_path / "o")
    assert "pretrain_text" not in sets and "code" in sets


def test_verify_checks_the_heldout_sets_too(built: Path, tmp_path: Path, cli) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    status, _, err = cli("data", "verify", str(copy))
    assert status == 0, err
    victim = copy / "heldout" / "code" / "shards" / "shard-000000.tar"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    status, _, err = cli("data", "verify", str(copy))
    assert status == 1
    assert "bad shard: heldout/code/shards/shard-000000.tar" in err


def test_a_rebuild_without_a_split_leaves_no_stale_heldout_set(
    inputs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    build(inputs / "held.yaml", out)
    assert (out / "heldout" / "code" / "manifest.json").is_file()
    plain = {**RECIPE, "name": "plain", "heldout": None}
    plain["sources"] = [{k: v for k, v in s.items() if k != "heldout"} for s in RECIPE["sources"]]
    manifest = build(_recipe(inputs, plain), out)
    assert manifest["heldout"] == {} and not (out / "heldout").exists()
    assert heldout_sets(out) == {}
    assert all(
        "heldout" not in s and "heldout" not in s["steps"] for s in manifest["sources"].values()
    )
