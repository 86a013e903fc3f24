"""``--executor ray`` against the local build: the same bytes, also after a lost worker or driver.

One local Ray instance (``ray.init(num_cpus=2)``) serves the module; a killed
driver is a second process joined to it, as a user's would be to a cluster.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from factory.data.build_job import build
from factory.data.samples import generate
from factory.data.stages.curate import UnitTask, curate_unit

ray = pytest.importorskip("ray")

SHIPPED = ["nano", "super", "ultra", "nemotron_h_8b", "nemotron_nano_9b_v2"]


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray instance for the module; yields its address for other drivers."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 1024**2,
        log_to_driver=False,
        logging_level="warning",
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _tree(out: Path) -> dict[str, str]:
    """sha256 of every published file (the ``.work`` intermediates are the executors' own)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.relative_to(out).parts
    }


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe over 24 input files in two sources, with duplicates across files, and a
    held-out split of each (a fraction, a token count)."""
    root = tmp_path_factory.mktemp("many")
    web = list(generate("pretrain_text", 240, 11))
    for i in range(16):
        part = web[i * 15 : (i + 1) * 15] + web[(i * 7) % 200 : (i * 7) % 200 + 3]
        (root / "web").mkdir(exist_ok=True)
        (root / "web" / f"{i:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    code = list(generate("code", 80, 12))
    for i in range(8):
        (root / "code").mkdir(exist_ok=True)
        part = code[i * 10 : (i + 1) * 10]
        (root / "code" / f"{i:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    recipe = {
        "name": "many",
        "seed": 5,
        "sources": [
            {"name": "web", "path": "web", "category": "pretrain_text", "weight": 2,
             "steps": [{"kind": "text"}, {"kind": "heuristics"}],
             "heldout": {"fraction": 0.1}},
            {"name": "code", "path": "code", "category": "code", "weight": 1,
             "steps": [{"kind": "text"}], "heldout": {"tokens": 2000}},
        ],
        "packing": {"seq_len": 256, "window": 32},
        "output": {"samples_per_shard": 8, "megatron": True},
    }  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def many_local(many_files: Path) -> dict[str, str]:
    build(many_files / "recipe.yaml", many_files / "local", workers=2)
    return _tree(many_files / "local")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_build_byte_identical_on_ray(
    cluster: str, name: str, tmp_path: Path
) -> None:
    build(name, tmp_path / "local")
    build(name, tmp_path / "ray", executor="ray")
    local, on_ray = _tree(tmp_path / "local"), _tree(tmp_path / "ray")
    assert any(k.startswith(".nv-meta/") for k in local) and "manifest.json" in local
    assert on_ray == local


def test_many_files_byte_identical_and_the_driver_reads_no_document(
    cluster: str, many_files: Path, many_local: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver holds task handles and per-file counts only: here every function that
    reads a document, a signature or a token is made to fail in the driver process
    (Ray's workers are other processes and import the real ones)."""

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("the driver read documents")

    import factory.data.stages.dedup as dedup
    import factory.data.stages.dedup_shuffle as shuffle
    import factory.data.stages.heldout_split as split
    import factory.data.stages.mixed_stream as mixed_stream
    import factory.data.stages.shard_plan as plan
    import factory.data.stages.unit_files as unit_files
    import factory.data.stages.write_shards as write

    for module, name in [
        (unit_files, "read_unit"),
        (unit_files, "read_records"),
        (
            unit_files,
            "read_sidecar",
        ),  # hashes, signatures: curate writes them, the driver never reads
        (dedup, "read_sidecar"),
        (dedup, "read_keep_mask"),
        (shuffle, "read_sidecar"),
        (plan, "read_sidecar"),
        (write, "read_records"),
        (split, "read_sidecar"),
        (split, "read_keep_mask"),
        (mixed_stream, "read_unit"),
        (mixed_stream, "unit_mask"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    manifest = build(many_files / "recipe.yaml", many_files / "ray", executor="ray")
    assert len(manifest["shards"]) > 3
    assert manifest["sources"]["web"]["dropped"]["dedup:exact"] > 0
    assert set(manifest["heldout"]) == {"pretrain_text", "code"}
    assert _tree(many_files / "ray") == many_local


def test_a_worker_killed_mid_curate_is_replaced_and_the_bytes_are_the_same(
    cluster: str,
    many_files: Path,
    many_local: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import factory.data.stages.run_stages as run_stages

    deaths = tmp_path / "deaths"
    deaths.mkdir()

    def dies_once(task: UnitTask) -> None:
        """The third unit's first attempt leaves a half-written file and kills its worker."""
        marker = deaths / f"{task.source_index}-{task.file_index}"
        if task.file_index == 2 and not marker.exists():
            marker.touch()
            task.output_path.parent.mkdir(parents=True, exist_ok=True)
            task.output_path.with_name(task.output_path.name + ".tmp999").write_bytes(b"half")
            os._exit(1)
        curate_unit(task)

    out = tmp_path / "ray"
    # The driver ships this closure to the workers by value; Ray reruns the task
    # whose worker died (its default max_retries), as it would on a lost node.
    monkeypatch.setattr(run_stages, "curate_unit", dies_once)
    build(many_files / "recipe.yaml", out, executor="ray")
    assert sorted(p.name for p in deaths.iterdir()) == ["0-2", "1-2"]
    assert _tree(out) == many_local


def test_a_driver_killed_mid_write_then_rerun_ends_identical(
    cluster: str, many_files: Path, many_local: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "ray"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from factory.data.build_job import build

        def progress(stage, done, total):
            if stage == "shards" and 2 <= done < total:
                os.kill(os.getpid(), signal.SIGKILL)

        build(Path({str(many_files / "recipe.yaml")!r}), Path({str(out)!r}),
              executor="ray", address={cluster!r}, progress=progress)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    written = sorted((out / "shards").glob("shard-*.tar"))
    assert len(written) >= 2 and not (out / "manifest.json").exists()
    build(many_files / "recipe.yaml", out, executor="ray")
    assert _tree(out) == many_local


def test_the_cli_takes_executor_ray_and_the_local_build_never_imports_ray(
    cluster: str, many_files: Path, many_local: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "cli"
    cli = [sys.executable, "-m", "factory", "data", "build", str(many_files / "recipe.yaml")]
    cli += ["--out", str(out)]
    ran = subprocess.run(
        [*cli, "--executor", "ray", "--address", cluster], capture_output=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr.decode()[-2000:]
    assert b"built" in ran.stdout and _tree(out) == many_local
    bad = subprocess.run([*cli, "--executor", "spark"], capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"spark" in bad.stderr
    lonely = subprocess.run([*cli, "--address", cluster], capture_output=True, timeout=60)
    assert lonely.returncode == 2 and b"--executor ray" in lonely.stderr
    bucket = [*cli[:-1], "s3://bucket/data", "--executor", "ray"]
    refused = subprocess.run(bucket, capture_output=True, timeout=60)
    assert refused.returncode == 2 and b"object-store" in refused.stderr
    probe = (
        "import sys; from pathlib import Path; from factory.data.build_job import build; "
        f"build(Path({str(many_files / 'recipe.yaml')!r}), Path({str(tmp_path / 'l')!r})); "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
