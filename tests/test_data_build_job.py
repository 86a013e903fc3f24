"""The data build end to end: determinism, resume after SIGKILL, bad input, verify, manifest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from factory.data.samples import benchmark_items, generate

RECIPE = {
    "name": "tiny",
    "seed": 3,
    "sources": [
        {
            "name": "web",
            "path": "in/web.jsonl",
            "category": "pretrain_text",
            "weight": 3,
            "steps": [{"kind": "text"}, {"kind": "heuristics"}],
        },
        {
            "name": "math",
            "path": "in/math.jsonl",
            "category": "math",
            "weight": 1,
            "steps": [{"kind": "chat", "reasoning": {"strip_fraction": 0.1}}],
        },
        {
            "name": "swe",
            "path": "in/swe",
            "category": "swe_trajectory",
            "tokens": "20K",
            "steps": [{"kind": "chat"}, {"kind": "trajectory"}],
        },
        {
            "name": "cuda",
            "path": "in/cuda.jsonl.gz",
            "category": "cuda_kernel",
            "weight": 1,
            "steps": [{"kind": "chat"}, {"kind": "cuda_kernel", "min_speedup": 1.0}],
        },
    ],
    "decontam": {"benchmarks": ["in/bench.jsonl"]},
    "packing": {"seq_len": 512, "window": 64},
    "output": {"samples_per_shard": 16, "megatron": True},
}


def _jsonl(path: Path, records: list[dict], gz: bool = False) -> None:
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes(gzip.compress(text.encode(), mtime=0) if gz else text.encode())


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    web = list(generate("pretrain_text", 120, 1))
    _jsonl(root / "in/web.jsonl", web + web[:5])  # five exact duplicates across the file
    math = list(generate("math", 60, 2))
    # a malformed line and a non-object line, to be quarantined
    (root / "in").mkdir(exist_ok=True)
    lines = [json.dumps(r) for r in math] + ['{"messages": [', "[1, 2, 3]"]
    (root / "in/math.jsonl").write_text("\n".join(lines) + "\n")
    swe = list(generate("swe_trajectory", 40, 3))
    _jsonl(root / "in/swe/a.jsonl", swe[:20])
    _jsonl(root / "in/swe/b.jsonl", swe[20:])
    _jsonl(root / "in/cuda.jsonl.gz", list(generate("cuda_kernel", 40, 4)), gz=True)
    _jsonl(root / "in/bench.jsonl", benchmark_items())
    (root / "recipe.yaml").write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    return root


def _build(recipe: Path, out: Path, workers: int = 1) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "factory",
        "data",
        "build",
        str(recipe),
        "--out",
        str(out),
        "--workers",
        str(workers),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every published file (not the .work intermediates), by relative path."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.parts
    }


@pytest.fixture(scope="module")
def built(recipe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "data"
    result = _build(recipe_dir / "recipe.yaml", out)
    assert result.returncode == 0, result.stderr
    return out


def test_output_layout_and_manifest(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    assert set(manifest["sources"]) == {"web", "math", "swe", "cuda"}
    assert manifest["shards"] and all(s["name"].startswith("shards/") for s in manifest["shards"])
    web = manifest["sources"]["web"]
    assert web["steps"]["read"]["documents_in"] == 125
    assert web["dropped"]["dedup:exact"] >= 5
    assert manifest["sources"]["math"]["quarantined"] == {"malformed_json": 1, "not_an_object": 1}
    assert any(k.startswith("trajectory:") for k in manifest["sources"]["swe"]["dropped"])
    assert any(k.startswith("cuda_kernel:") for k in manifest["sources"]["cuda"]["dropped"])
    assert manifest["sources"]["swe"]["mix"]["target_tokens"] == 20_000
    for name in (
        ".nv-meta/dataset.yaml",
        ".nv-meta/split.yaml",
        ".nv-meta/.info.json",
        "megatron/tiny.bin",
        "megatron/tiny.idx",
        "quarantine.jsonl",
    ):
        assert (built / name).is_file(), name
    quarantine = (built / "quarantine.jsonl").read_text().splitlines()
    assert len(quarantine) == 2 and all("reason" in json.loads(q) for q in quarantine)


def test_token_counts_decrease_step_by_step(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    for source in manifest["sources"].values():
        for step, row in source["steps"].items():
            if step in ("mix", "read", "text", "chat"):
                continue
            assert row["documents_out"] <= row["documents_in"], step
            if row["tokens_in"] is None:  # before tokenization: documents only
                assert row["tokens_out"] is None, step
                continue
            assert row["tokens_out"] <= row["tokens_in"], step


def test_steps_before_tokenizing_count_documents_not_tokens(built: Path) -> None:
    """Filters run before the tokenizer, so their dropped documents are never tokenized:
    their rows say so (null tokens), documents are still counted, drops still by reason."""
    manifest = json.loads((built / "manifest.json").read_text())
    assert "tokenize" in manifest["token_counts"]
    web = manifest["sources"]["web"]["steps"]
    for step in ("read", "text", "heuristics", "decontam"):
        assert web[step]["tokens_in"] is None and web[step]["tokens_out"] is None, step
    assert web["heuristics"]["documents_out"] == web["decontam"]["documents_in"]
    assert web["decontam"]["documents_out"] == web["tokenize"]["documents_in"]
    assert web["tokenize"]["tokens_out"] == web["tokenize"]["tokens_in"] > 0
    assert web["tokenize"]["tokens_out"] == web["dedup"]["tokens_in"]


def test_webdataset_reads_the_shards(built: Path) -> None:
    import webdataset as wds

    manifest = json.loads((built / "manifest.json").read_text())
    first = str(built / manifest["shards"][0]["name"])
    sample = next(iter(wds.WebDataset(first, shardshuffle=False).decode()))
    tokens, mask, cu = sample["tokens.npy"], sample["loss_mask.npy"], sample["cu_seqlens.npy"]
    assert tokens.shape == mask.shape == (512,)
    assert cu[0] == 0 and cu[-1] <= 512 and (cu[1:] > cu[:-1]).all()
    assert len(sample["json"]["doc_keys"]) == len(cu) - 1


def test_same_bytes_whatever_the_worker_count(
    recipe_dir: Path, built: Path, tmp_path: Path
) -> None:
    result = _build(recipe_dir / "recipe.yaml", tmp_path / "two", workers=2)
    assert result.returncode == 0, result.stderr
    assert _snapshot(tmp_path / "two") == _snapshot(built)


def test_resume_after_sigkill_is_byte_identical(
    recipe_dir: Path, built: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    expected = _snapshot(built)
    for delay in (0.5, 1.5, 3.0):
        cmd = [
            sys.executable,
            "-m",
            "factory",
            "data",
            "build",
            str(recipe_dir / "recipe.yaml"),
            "--out",
            str(out),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    result = _build(recipe_dir / "recipe.yaml", out)
    assert result.returncode == 0, result.stderr
    assert _snapshot(out) == expected
    assert not [p for p in out.rglob("*.tmp*")]


def test_a_build_killed_while_removing_its_work_folder_is_rebuilt_whole(
    recipe_dir: Path, built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill while the finished build removes ``.work`` leaves part of it: the units and
    plans gone, ``dedup.json`` still there. The rerun must not trust what is left (it used
    to skip the dedup and then miss a keep mask)."""
    import shutil

    from factory.data.build_job import build

    out = tmp_path / "out"
    real_rmtree = shutil.rmtree

    def killed_midway(path: Path, ignore_errors: bool = False) -> None:
        if Path(path).name != ".work":
            return real_rmtree(path, ignore_errors=ignore_errors)
        for part in ("units", "plan"):
            real_rmtree(Path(path) / part)
        raise KeyboardInterrupt  # where SIGKILL would have stopped it

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            build(recipe_dir / "recipe.yaml", out)
    assert (out / ".work" / "dedup.json").is_file()
    build(recipe_dir / "recipe.yaml", out)
    assert _snapshot(out) == _snapshot(built)


def test_a_work_folder_of_another_format_is_removed_not_read(
    recipe_dir: Path, built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``.work`` from a factory whose work files differ (format 1 held pickles) is removed
    whole, so none of its files is ever read."""
    import factory.data.build_job as build_job

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(build_job, "WORK_FORMAT", build_job.WORK_FORMAT - 1)
        build_job.build(recipe_dir / "recipe.yaml", out, keep_work=True)
    planted = out / ".work" / "units" / "web" / "planted"
    planted.write_bytes(b"left by the other format")
    build_job.build(recipe_dir / "recipe.yaml", out, keep_work=True)
    assert not planted.exists()
    assert _snapshot(out) == _snapshot(built)


def test_verify_catches_a_flipped_byte(built: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    ok = subprocess.run(
        [sys.executable, "-m", "factory", "data", "verify", str(copy)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    manifest = json.loads((copy / "manifest.json").read_text())
    victim = copy / manifest["shards"][-1]["name"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = subprocess.run(
        [sys.executable, "-m", "factory", "data", "verify", str(copy)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert manifest["shards"][-1]["name"] in bad.stderr


def test_bad_recipe_fails_up_front(tmp_path: Path, cli) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nsources:\n  - name: a\n    path: nowhere.jsonl\n    category: math\n"
        "    weight: 1\n    steps: [{kind: text}]\n"
    )
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 2
    assert "r.yaml:4: sources[0].path: no input files at 'nowhere.jsonl'" in err
    assert not (tmp_path / "o").exists()


def test_unknown_recipe_key_gets_did_you_mean(tmp_path: Path, cli) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nsead: 3\nsources: []\n")
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 2
    assert "r.yaml:2: sead: unknown key (did you mean 'seed'?)" in err


def test_steps_must_start_with_a_format(tmp_path: Path, cli) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nsources:\n  - name: a\n    path: x.jsonl\n    category: math\n"
        "    weight: 1\n    steps: [{kind: heuristics}, {kind: text}]\n"
    )
    status, _, err = cli("data", "build", str(recipe), "--out", str(tmp_path / "o"))
    assert status == 2
    assert "sources[0]" in err and "must start with a format step" in err


def test_inspect_draws_shares(built: Path, tmp_path: Path, cli) -> None:
    status, out, err = cli("data", "inspect", str(built), "--png", str(tmp_path / "s.png"))
    assert status == 0, err
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pretrain_text" in out
