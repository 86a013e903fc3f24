"""The jobs as library calls: factory.data.build, factory.build and factory.train."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from one_stage import one_stage
from preset_stages import stage_alone
from rich.console import Console

import factory
from factory.progress import PLAIN_EVERY_S, RichProgress

Reports = list[tuple[str, int, int]]


def _recorder() -> tuple[Reports, typing.Callable[[str, int, int], None]]:
    seen: Reports = []
    return seen, lambda stage, done, total: seen.append((stage, done, total))


@pytest.fixture(scope="module")
def nano(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Nano's phase 1 alone: one run of one stage (a program's are tests/test_train_program.py's)."""
    return str(stage_alone("nano", "phase1", tmp_path_factory.mktemp("blueprints")))


@pytest.fixture(scope="module")
def proxy_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Reports]:
    """nano's recipe packed at the proxy's 256 tokens, as factory.train would build it."""
    seen, progress = _recorder()
    out = tmp_path_factory.mktemp("data") / "nano-256"
    manifest = factory.data.build("nano", out, seq_len=256, progress=progress)
    return out, manifest, seen


def test_data_build_returns_the_manifest_and_reports_its_stages(proxy_data) -> None:
    out, manifest, seen = proxy_data
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["packing"]["seq_len"] == 256  # seq_len overrides the recipe's 4096
    assert not (out / ".work").exists()  # a completed build keeps no intermediates
    assert seen[0][0] == "curate" and ("dedup", 1, 1) in seen
    shards = len(manifest["shards"])
    assert ("shards", shards, shards) in seen  # the final report ends the stage
    assert seen[-1] == ("energon", 1, 1)  # then the metadata, as on Ray


def test_data_build_refuses_a_length_beyond_the_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot pack recipe 'nano'"):
        factory.data.build("nano", tmp_path / "o", seq_len=2**25)
    assert not (tmp_path / "o").exists()


def test_build_writes_the_folder_and_reports_each_stage(tmp_path: Path) -> None:
    seen, progress = _recorder()
    records = []
    bp = one_stage("nano")  # a single-stage build (a program's: tests/test_build_program.py)
    skip = ["model", "export", "smoke", "distributed", "report"]
    result = factory.build(
        bp, out=tmp_path / "nano", progress=progress, skip=skip, on_stage=records.append
    )
    assert isinstance(result, factory.BuildResult)
    assert result.out == (tmp_path / "nano").resolve()
    assert [r.stage for r in records] == [r.stage for r in result.stages]
    plan = json.loads((result.out / "plan.json").read_text())
    assert plan["params"]["total"] == 31_577_940_288
    manifest = json.loads((result.out / "data" / "manifest.json").read_text())
    assert manifest["packing"]["seq_len"] == bp.data.seq_len
    assert (result.out / "resolved.yaml").read_text().startswith("# Resolved; ")
    assert not (result.out / "data" / ".work").exists()
    stages = [stage for stage, _, _ in seen]
    assert "curate" in stages and "shards" in stages


def test_train_refuses_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.jobs import train as job
    from factory.jobs.train_errors import BYTES_PER_PARAM, ModelTooBig

    bp = factory.load_blueprint("nano")
    with pytest.raises(ValueError, match="precision must be one of auto, emulate, te, off"):
        factory.train(bp, proxy=True, out=tmp_path / "x", precision="fp3")  # type: ignore[arg-type]
    monkeypatch.setattr(job, "_memory_bytes", lambda: 2**30)
    with pytest.raises(ModelTooBig, match="31,577,940,288 parameters") as info:
        factory.train(bp, out=tmp_path / "x")
    assert isinstance(info.value, factory.TrainRefused)
    assert info.value.need_bytes == 31_577_940_288 * BYTES_PER_PARAM
    assert not (tmp_path / "x").exists()


def test_a_launch_is_checked_once_on_any_number_of_processes(
    monkeypatch: pytest.MonkeyPatch, nano: str
) -> None:
    from factory.jobs import train as job
    from factory.jobs.train_request import TrainSettings
    from factory.schemas.blueprint import Blueprint

    worlds: list[int] = []
    check = job.check_launch

    def counted(bp: Blueprint, world: int, backend: str = "auto") -> None:
        worlds.append(world)
        check(bp, world, backend)  # type: ignore[arg-type]

    monkeypatch.setattr(job, "check_launch", counted)
    phase1 = factory.load_blueprint(nano)
    job.prepare_training(phase1, TrainSettings(), proxy=True, world_size=2)
    job.prepare_training(phase1, TrainSettings(), proxy=True, world_size=1)
    assert worlds == [2, 1]


def test_missing_transformer_engine_is_a_refusal_and_an_import_error(tmp_path: Path) -> None:
    import importlib.util

    from factory.jobs.train_errors import BackendUnavailable

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    bp = factory.load_blueprint("nano")
    with pytest.raises(BackendUnavailable, match=r"factory\[gpu\]") as info:
        factory.train(bp, proxy=True, out=tmp_path / "x", precision="te")
    assert isinstance(info.value, ImportError)
    assert not (tmp_path / "x").exists()


def test_train_on_built_data_reports_every_step(proxy_data, tmp_path: Path, nano: str) -> None:
    data = proxy_data[0]
    seen, progress = _recorder()
    bp = factory.load_blueprint(nano)
    result = factory.train(
        bp, proxy=True, steps=2, data=data, out=tmp_path / "run", progress=progress
    )
    assert isinstance(result, factory.TrainResult)
    assert result.blueprint.meta.name == "nano-proxy" and result.data == data
    assert [r.step for r in result.records] == [0, 1] and not result.diverged
    summary = json.loads((result.out / "train.json").read_text())
    assert summary["seed"] == result.seed == bp.training.seed
    assert [r["lm_loss"] for r in summary["records"]] == [r.lm_loss for r in result.records]
    assert summary["kernels"] == list(result.kernels) and result.kernels
    assert (result.out / "model" / "model.safetensors").is_file()
    assert not (result.out / "data").exists()
    assert [r for r in seen if r[0] == "train"] == [
        ("train", 0, 2),
        ("train", 1, 2),
        ("train", 2, 2),
    ]
    assert [r for r in seen if r[0] != "train"] == [
        ("compile", 0, 1),
        ("compile", 1, 1),
        ("export", 0, 1),
        ("export", 1, 1),
    ]


def test_off_a_terminal_progress_is_plain_timestamped_lines() -> None:
    """CI, Slurm, nohup and pipes get a log, not a live display's blank lines: a stage's start,
    its count every PLAIN_EVERY_S seconds, and its end with the time it took."""
    out, now = io.StringIO(), [0.0]
    with RichProgress(Console(file=out), clock=lambda: now[0]) as progress:
        progress("curate", 0, 3)
        now[0] = PLAIN_EVERY_S - 1
        progress("curate", 1, 3)  # too soon for another line
        now[0] = PLAIN_EVERY_S + 1
        progress("curate", 2, 3)
        now[0] = 200.0
        progress("curate", 3, 3)
        assert not progress.drawing  # a complete stage is closed
        progress("shards", 1, 0)  # total not known yet: open until the stage ends
        assert progress.drawing
    assert not progress.drawing
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} "
    said = [re.sub(f"^{stamp}", "", line) for line in out.getvalue().splitlines()]
    assert all(re.match(stamp, line) for line in out.getvalue().splitlines())
    assert said == [
        "curate: started (3 to do)",
        "curate: 2/3 after 31 s",
        "curate: 3/3 done in 3 min 20 s",
        "shards: started",
    ]


def test_a_log_format_forces_lines_or_bars_whatever_the_output() -> None:
    """``--log-format plain`` logs lines in a terminal; ``rich`` draws bars in a pipe."""
    terminal, pipe = io.StringIO(), io.StringIO()
    with RichProgress(Console(file=terminal, force_terminal=True), log_format="plain") as lines:
        lines("curate", 0, 2)
        assert lines.plain and lines.drawing
    assert terminal.getvalue().endswith(" curate: started (2 to do)\n")
    with RichProgress(Console(file=pipe), log_format="rich") as bars:
        assert not bars.plain
        assert RichProgress(Console(file=pipe)).plain  # auto: a pipe gets lines


@pytest.mark.parametrize(
    "command", [["train", "nano"], ["build", "nano"], ["data", "build", "nano"]]
)
def test_every_command_with_progress_takes_a_log_format(cli, command: list[str]) -> None:
    status, out, _ = cli(*command, "--help")
    assert status == 0 and "--log-format" in out
    status, _, err = cli(*command, "--out", "unused", "--log-format", "fancy")
    assert status == 2 and "fancy" in err


def test_off_a_terminal_training_logs_a_timestamped_line_per_few_steps() -> None:
    """The run's first and last steps, every 10 steps or 30 s (whichever first), each with
    the loss, learning rate, gradient norm, tokens/s and ETA; events and rollbacks too."""
    from types import SimpleNamespace

    from factory.runtime.callbacks import Event, Rollback
    from factory.runtime.display import StepDisplay
    from factory.runtime.history import RunHistory

    out, now = io.StringIO(), [0.0]
    kernels = ["kernels: mamba ssd scan: PyTorch chunked"]
    display = StepDisplay(False, 10, log_every_s=30.0, console=Console(file=out),
                          clock=lambda: now[0], first_lines=lambda trainer: kernels)  # fmt: skip
    trainer = SimpleNamespace(
        ranks=SimpleNamespace(is_main=True), steps=25, position=SimpleNamespace(step=0)
    )
    outcome = SimpleNamespace(tokens=2048)
    display.pre_train(trainer)
    for step in range(25):
        now[0] += 41.0 if step == 13 else 2.0  # one slow step: 30 s passed since the last line
        record = SimpleNamespace(lm_loss=6.0 - step / 10, lr=3e-4, grad_norm=1.25, seconds=2.0)
        trainer.position.step = step + 1
        display.post_step(trainer, record, outcome)
        if step == 3:
            display.on_event(trainer, Event(4, 4, "loss_spike", "warn", "loss 9.1 > 3 x median"))
            display.on_rollback(trainer, Rollback(5, 4, 2, 16, 3))
    display.post_train(trainer, RunHistory())
    lines = out.getvalue().splitlines()
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} "
    assert all(re.match(stamp, line) for line in lines), lines
    said = [re.sub(f"^{stamp}", "", line) for line in lines]
    assert said == [
        "train: kernels: mamba ssd scan: PyTorch chunked",
        "train: step 1/25, loss 6.0000, lr 3.00e-04, grad norm 1.250, 1,024 tok/s, ETA 48 s",
        "train: [warn] loss_spike: loss 9.1 > 3 x median",
        "train: rollback from step 4 to 2, 16 samples skipped",
        "train: step 10/25, loss 5.1000, lr 3.00e-04, grad norm 1.250, 1,024 tok/s, ETA 30 s",
        "train: step 14/25, loss 4.7000, lr 3.00e-04, grad norm 1.250, 1,024 tok/s, ETA 53 s",
        "train: step 20/25, loss 4.1000, lr 3.00e-04, grad norm 1.250, 1,024 tok/s, ETA 20 s",
        "train: step 25/25, loss 3.6000, lr 3.00e-04, grad norm 1.250, 1,024 tok/s, ETA 0 s",
    ]


def test_a_piped_train_logs_its_steps(proxy_data, tmp_path: Path, nano: str) -> None:
    """Run as a job runs it, output piped: no blank line, and a timestamped line for the
    first and the last step with the loss, learning rate, gradient norm, tokens/s and ETA."""
    done = subprocess.run(
        [sys.executable, "-m", "factory", "train", nano, "--proxy", "--steps", "2",
         "--data", str(proxy_data[0]), "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert lines and all(line.strip() for line in lines), lines
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} "
    numbers = r"loss \d+\.\d{4}, lr [\d.e+-]+, grad norm \d+\.\d{3}, [\d,]+ tok/s, ETA \d+ s"
    for step in (1, 2):
        pattern = f"{stamp}train: step {step}/2, {numbers}$"
        assert any(re.match(pattern, line) for line in lines), lines
    # The kernel report comes first, one line per layer type's operation and block, and
    # train.json records the same lines.
    kernels = json.loads((tmp_path / "run" / "train.json").read_text())["kernels"]
    assert any(k.startswith("kernels: mamba ") for k in kernels), kernels
    assert "kernels: moe block: eager" in kernels  # training.compile is off
    said = [re.sub(f"^{stamp}train: ", "", line) for line in lines if re.match(stamp, line)]
    first_step = next(i for i, line in enumerate(said) if line.startswith("step 1/2"))
    assert said[first_step - len(kernels) : first_step] == kernels


def _in_a_terminal(args: list[str], timeout: float = 600) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as stdout and stderr: its status and output."""
    import os
    import pty
    import select

    master, terminal = pty.openpty()
    child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal's last descriptor
                    break
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(master)
        if child.poll() is None:
            child.kill()
    return child.wait(), b"".join(chunks).decode(errors="replace")


def test_log_format_plain_logs_lines_in_a_terminal(proxy_data, tmp_path: Path, nano: str) -> None:
    status, output = _in_a_terminal(
        [sys.executable, "-m", "factory", "train", nano, "--proxy", "--steps", "2",
         "--data", str(proxy_data[0]), "--out", str(tmp_path / "run"), "--log-format", "plain"]
    )  # fmt: skip
    assert status == 0, output[-2000:]
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} "
    assert re.search(f"(?m)^{stamp}train: step 2/2, loss ", output), output[-2000:]
    assert "\x1b[?25l" not in output  # no live display hid the cursor


def test_off_a_terminal_each_build_stage_is_a_timestamped_line(cli, tmp_path: Path) -> None:
    skip = ["--skip", "model", "--skip", "export", "--skip", "data", "--skip", "smoke"]
    skip += ["--skip", "distributed", "--skip", "report"]
    status, _, err = cli("build", "nano", "--out", str(tmp_path / "nano"), *skip)
    assert status == 0, err
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} "
    stages = [line for line in err.splitlines() if re.match(f"{stamp}. (validate|plan) ", line)]
    assert len(stages) == 2, err


def test_a_piped_data_build_logs_its_stages(tmp_path: Path) -> None:
    """Run as a job runs it, output piped: every line of the log says something."""
    out = tmp_path / "shards"
    done = subprocess.run(
        [sys.executable, "-m", "factory", "data", "build", "nano", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert lines and all(line.strip() for line in lines), done.stderr
    assert any(line.endswith("curate: started (11 to do)") for line in lines), done.stderr
    assert any(" shards: " in line and " done in " in line for line in lines), done.stderr


def test_precision_help_names_every_backend() -> None:
    from factory.cli.train_cmd import PRECISION_HELP
    from factory.compilation import PrecisionBackend

    assert all(name in PRECISION_HELP for name in typing.get_args(PrecisionBackend))


def test_jobs_resolve_without_importing_torch() -> None:
    script = (
        "import sys, factory\n"
        "factory.train, factory.build, factory.TrainResult, factory.data.build\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dir_and_help_list_the_public_api() -> None:
    """``dir(factory)`` names every export before any is read (without importing torch), and
    ``help(factory)`` documents each, with the first line of its own docstring."""
    script = (
        "import sys, factory\n"
        "listed = [n for n in dir(factory) if not n.startswith('_')]\n"
        "assert listed == sorted(factory.__all__), listed\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "import pydoc\n"
        "page = pydoc.render_doc(factory, renderer=pydoc.plaintext)\n"
        "for name in ('load_blueprint', 'plan', 'build', 'train', 'export_hf'):\n"
        "    first = getattr(factory, name).__doc__.strip().splitlines()[0]\n"
        "    assert first in page, (name, first)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
