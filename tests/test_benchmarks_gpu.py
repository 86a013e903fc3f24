"""``python -m benchmarks gpu``: its dry run (CPU, tiny sizes, Triton interpreter, gloo) keeps
every section of the GPU command working between the rare sessions that have a GPU; the
test selection, the JUnit reading and ``--prepare``'s requirement list are checked here
without a device or a network."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu, gpu_prepare, gpu_tests

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("triton") is None and not (
    sys.platform == "linux" or "CI" in os.environ
):
    pytest.skip("triton is a dev dependency on Linux only", allow_module_level=True)


def _benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "gpu", *args],
        # Every section is bounded by its dry-run budget: a loaded machine may need them all.
        cwd=REPO, env=env, capture_output=True, text=True,
        timeout=len(gpu.SECTIONS) * gpu.DRY_RUN_BUDGET_S + 120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One dry run of every section (about two minutes on two cores), shared by the checks."""
    out = tmp_path_factory.mktemp("gpu")
    done = _benchmark("--dry-run", "--all", "--out", str(out))
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    return {"done": done, "results": results, "markdown": (out / "results.md").read_text("utf-8")}


def test_the_dry_run_runs_every_section_in_order_and_passes(dry_run: dict[str, Any]) -> None:
    assert dry_run["done"].returncode == 0, dry_run["done"].stdout + dry_run["done"].stderr
    results = dry_run["results"]
    assert results["dry_run"] is True
    assert list(results["sections"]) == list(gpu.SECTIONS)
    for name, section in results["sections"].items():
        assert section["status"] == "ok", (name, section["error"])
        assert not section["results"].get("failures"), name
    for number, section in enumerate(results["sections"].values(), start=1):
        assert f"### {number}. {section['title']} (ok" in dry_run["markdown"]


def test_the_cuda_only_tests_are_selected_and_skip_on_cpu(dry_run: dict[str, Any]) -> None:
    tests = dry_run["results"]["sections"]["tests"]["results"]
    assert (
        "tests/test_graph_documents.py::test_varlen_documents_equal_the_masked_path_on_cuda"
        in tests["selection"]
    )
    # A parametrized function selected once skips once per case.
    assert tests["outcome"]["skipped"] >= len(tests["selection"]) > 0
    assert tests["outcome"]["passed"] == tests["outcome"]["failed"] == 0


def test_every_kernel_is_measured_and_bit_exact(dry_run: dict[str, Any]) -> None:
    kernels = dry_run["results"]["sections"]["kernels"]["results"]["kernels"]
    assert {k["case"] for k in kernels} >= {"nvfp4 quantize", "nvfp4 fake-quant to bf16"}
    for kernel in kernels:
        assert kernel["bit_exact"] is True
        assert kernel["shape"] == [64, 64] and kernel["bytes_moved"] > 64 * 64
        assert kernel["seconds"] > 0 and kernel["share_of_hbm_peak"] is None
    assert "| nvfp4 quantize | 64x64 bf16 |" in dry_run["markdown"]


def test_the_kernel_report_heads_the_results(dry_run: dict[str, Any]) -> None:
    kernels = dry_run["results"]["kernels"]
    assert any("ssd scan" in line for line in kernels), kernels
    assert len(kernels) == len(set(kernels))
    head = dry_run["markdown"].split("### 1.")[0]
    assert all(line in head for line in kernels)


def test_each_call_fits_one_device_call_and_the_rest_runs_on_request() -> None:
    calls = [gpu.DEFAULT, gpu.SECOND_CALL, gpu.ON_REQUEST]
    assert sorted(name for call in calls for name in call) == sorted(gpu.SECTIONS)
    for call in (gpu.DEFAULT, gpu.SECOND_CALL):
        budgets = [importlib.import_module(gpu.SECTIONS[name]).BUDGET_S for name in call]
        assert sum(budgets) <= gpu.DEVICE_CALL_S, call
        assert list(call) == [name for name in gpu.SECTIONS if name in call]


def test_the_train_step_compares_eager_compiled_the_baseline_and_the_prediction(
    dry_run: dict[str, Any],
) -> None:
    train = dry_run["results"]["sections"]["train_step"]["results"]
    assert train["blueprint"]["name"] == "gpu-1b-proxy"
    assert set(train["steps"]) == {"ours eager", "ours compiled"}
    assert all(s["tokens_per_s"] > 0 and s["mfu"] is None for s in train["steps"].values())
    rate = train["steps"]["ours compiled"]["tokens_per_s"]
    assert train["over_baseline"] == pytest.approx(rate / train["baseline"]["tokens_per_s"])
    assert {"M", "E", "*"} <= set(train["layer_types"])
    assert all(t["forward_s"] > 0 and t["backward_s"] > 0 for t in train["layer_types"].values())
    assert train["prediction"]["gpu"] == "h100" and train["prediction"]["step_s"] > 0


def test_ours_and_transformers_hold_the_same_weights(dry_run: dict[str, Any]) -> None:
    theirs = dry_run["results"]["sections"]["transformers"]["results"]
    assert set(theirs["steps"]) == {"ours eager", "theirs eager"}
    assert theirs["max_logit_difference"] < 0.1  # the same weights, BF16 rounding apart
    assert theirs["flops_per_token"]["ours"] > theirs["flops_per_token"]["theirs"]  # MTP


def test_the_nano_slice_trains_in_both_recipes_beside_the_plan(dry_run: dict[str, Any]) -> None:
    nano = dry_run["results"]["sections"]["nano_slice"]["results"]
    assert nano["blueprint"]["pattern"] == "MEMEM*E"  # a dry run's: one period of the slice
    assert set(nano["runs"]) == {"bf16", "fp8"}
    for name, run in nano["runs"].items():
        assert run["tokens_per_s"] > 0 and run["first_step_s"] > 0, name
        assert run["mfu"] is None and "peak_memory_bytes" not in run  # no CUDA device
        assert run["planned_memory_bytes"] > 0 and run["prediction"]["tokens_per_s"] > 0
        assert run["compiled"] or run["compile_refused"]
    assert nano["runs"]["bf16"]["compiled"] is True
    assert nano["runs"]["fp8"]["linears_per_format"].get("fp8", 0) > 0
    assert "| bf16 | compiled |" in dry_run["markdown"]


def test_each_layer_type_is_timed_against_its_kernels_and_floor(dry_run: dict[str, Any]) -> None:
    layers = dry_run["results"]["sections"]["layers"]["results"]
    assert layers["mm"]["flops_per_s"] > 0
    assert set(layers["layers"]) == {"M", "*", "E"}
    for symbol, layer in layers["layers"].items():
        assert layer["block_eager_s"] > 0 and layer["floor_s"] > 0, symbol
        assert layer["kernels"] and all(t > 0 for t in layer["kernels"].values()), symbol
    assert layers["layers"]["M"]["block_compiled_s"] > 0  # a static-shape block compiles


def test_moe_paths_match_the_reference_on_both_routings(dry_run: dict[str, Any]) -> None:
    moe = dry_run["results"]["sections"]["moe"]["results"]
    assert moe["skewed"]["load_max_over_mean"] > moe["balanced"]["load_max_over_mean"]
    for routing in ("balanced", "skewed"):
        assert moe[routing]["bmm"]["relative_error"] < 5e-2
        grouped = moe[routing]["grouped_mm"]
        assert grouped == "not available" or grouped["relative_error"] < 5e-2


def test_precision_attention_and_nccl_sections_record_their_checks(
    dry_run: dict[str, Any],
) -> None:
    sections = dry_run["results"]["sections"]
    precision = sections["precision"]["results"]
    assert precision["linears_per_format"]["nvfp4"].get("nvfp4", 0) > 0
    assert precision["linears_per_format"]["mxfp8"].get("mxfp8", 0) > 0
    assert set(precision["over_bf16"]) == {"nvfp4", "mxfp8"}
    attention = sections["attention"]["results"]["256"]
    for path in ("factory", "sdpa mask", "flex", "flex compiled block"):
        assert attention[path]["relative_error"] < 2e-2
    assert attention["varlen"] == "not available"  # CUDA only
    assert sections["attention"]["results"]["nano_heads"] == [32, 2, 128]
    nccl = sections["nccl"]["results"]
    assert nccl["backend"] == "gloo" and nccl["checkpoint_round_trip"] == "equal"
    assert 0 < nccl["dtensor_parameters"] <= nccl["parameters"]


def test_a_section_past_its_budget_is_recorded_and_the_next_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "DRY_RUN_BUDGET_S", 0.01)
    monkeypatch.chdir(REPO)
    status = gpu.main(["--dry-run", "--only", "tests,moe", "--out", str(tmp_path)])
    assert status == 1
    sections = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))["sections"]
    assert [s["status"] for s in sections.values()] == ["timed out", "timed out"]
    assert "budget" in (tmp_path / "results.md").read_text(encoding="utf-8")


def test_an_unknown_section_is_a_usage_error(tmp_path: Path) -> None:
    assert gpu.main(["--dry-run", "--only", "nope", "--out", str(tmp_path)]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_the_real_run_says_so(tmp_path: Path) -> None:
    done = _benchmark("--out", str(tmp_path))
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr


CUDA_TESTS = """
import pytest, torch

pytestmark_unrelated = 1

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_marked(): ...

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")
def test_skipped_with_cuda(): ...

def test_skips_in_its_body():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

@pytest.mark.skipif(not HAVE_TE, reason="needs TE")
def test_other_skip(): ...

def test_plain(): ...
"""


def test_the_selection_takes_tests_that_skip_without_cuda_only() -> None:
    assert gpu_tests.cuda_only_tests(CUDA_TESTS, "tests/t.py") == [
        "tests/t.py::test_marked",
        "tests/t.py::test_skips_in_its_body",
    ]
    module_wide = "pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='')\n"
    source = module_wide + "def test_a(): ...\ndef helper(): ...\n"
    assert gpu_tests.cuda_only_tests(source, "t.py") == ["t.py::test_a"]


def test_the_junit_report_gives_counts_and_names(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="tests.t" name="ok"/>'
        '<testcase classname="tests.t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.t" name="gone"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    outcome = gpu_tests.read_junit(report)
    assert (outcome["passed"], outcome["failed"], outcome["skipped"]) == (1, 1, 1)
    assert outcome["failed_tests"] == ["tests.t::bad"]
    assert outcome["skipped_tests"] == ["tests.t::gone: needs CUDA"]


PYPROJECT = {
    "project": {
        "dependencies": ["pydantic>=2.7,<3", "rich>=13"],
        "optional-dependencies": {
            "torch": ["torch>=2.5,<3", "safetensors>=0.4"],
            "data": ["x"],
            "gpu": ["transformer-engine[pytorch]>=2.7", "mamba-ssm>=2.2"],
        },
    }
}
METADATA = {
    "pydantic": [
        "pydantic-core==2.1",
        "typing-extensions>=4.14",
        'email-validator; extra == "email"',
    ],
    "pydantic-core": ["typing-extensions>=4.6"],
    "rich": ["pygments>=2", 'colorama; sys_platform == "win32"', "markdown-it-py[plugins]"],
    "markdown-it-py": ["mdurl", 'mdit-py-plugins; extra == "plugins"'],
    "mdit-py-plugins": ["markdown-it-py"],  # a cycle
    "pytest": ["pluggy", 'tomli; python_version < "3.11"'],
}


def test_prepare_packs_the_closure_of_what_the_device_lacks() -> None:
    top = gpu_prepare.top_level(PYPROJECT)
    assert top[:3] == ["pydantic>=2.7,<3", "rich>=13", "safetensors>=0.4"]  # no torch
    assert set(top[3:]) == set(gpu_prepare.ALSO_NEEDED)
    names = gpu_prepare.to_download(PYPROJECT, METADATA.get)
    assert set(names) == {
        "pydantic", "pydantic-core", "typing-extensions", "rich", "pygments", "markdown-it-py",
        "mdurl", "mdit-py-plugins", "safetensors", "pytest", "pluggy", "hypothesis", "setuptools",
        "einops",
    }  # fmt: skip
    assert names == sorted(names)


def test_prepare_pins_what_is_installed_here_within_the_projects_bounds() -> None:
    versions = {"pydantic": "2.9.0", "setuptools": "65.5.0"}.get
    assert gpu_prepare.pin("pydantic", PYPROJECT, versions) == "pydantic==2.9.0"
    assert gpu_prepare.pin("setuptools", PYPROJECT, versions) == "setuptools>=77"
    assert gpu_prepare.pin("mdurl", PYPROJECT, versions) == "mdurl"


def test_prepare_builds_the_kernel_packages_without_cuda_at_the_installed_version() -> None:
    """mamba-ssm is not in the closure (its declared dependencies are tilelang, quack-kernels
    and the like); it is built here with the variables that skip its CUDA extension, pinned to
    the version the tests ran with, within the ``gpu`` extra's bound."""
    assert "mamba-ssm" not in gpu_prepare.to_download(PYPROJECT, METADATA.get)
    assert gpu_prepare.WITHOUT_CUDA["mamba-ssm"]["MAMBA_SKIP_CUDA_BUILD"] == "TRUE"
    installed = {"mamba-ssm": "2.3.2.post1"}.get
    assert gpu_prepare.pin("mamba-ssm", PYPROJECT, installed) == "mamba-ssm==2.3.2.post1"
    assert gpu_prepare.pin("mamba-ssm", PYPROJECT, {}.get) == "mamba-ssm>=2.2"


def test_device_install_adds_the_kernel_packages_without_their_dependencies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import gpu_install

    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "requirements.txt").write_text("pydantic>=2.7\n")
    (folder / "without-deps.txt").write_text("mamba-ssm==2.3.2.post1\n")
    monkeypatch.setattr(gpu_install, "FOLDER", folder)
    monkeypatch.setattr(gpu_install, "WITHOUT_DEPS", folder / "without-deps.txt")

    def not_installed(name: str) -> str:
        raise gpu_install.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_install.importlib.metadata, "version", not_installed)
    calls: list[list[str]] = []
    monkeypatch.setattr(gpu_install.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    restarts: list[list[str]] = []  # the command starts again, seeing the editable install
    monkeypatch.setattr(gpu_install.os, "execv", lambda path, argv: restarts.append(argv))
    gpu_install.install_offline_if_needed()
    assert restarts == [[sys.executable, *sys.orig_argv[1:]]]
    assert [c[-2:] for c in calls] == [
        ["-r", str(folder / "requirements.txt")],
        ["-r", str(folder / "without-deps.txt")],
        ["-e", str(gpu_install.REPO)],
    ]
    assert all("--no-index" in c for c in calls) and "--no-deps" in calls[1]
