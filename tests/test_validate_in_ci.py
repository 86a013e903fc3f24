"""README's "Validate in CI": the GitHub Actions step and the pre-commit hook, run as written.

Both run in a throwaway checkout laid out as a user's: ``blueprints/`` (a preset,
its fragments under ``base/``, and one blueprint with a misspelt key) and
``data_recipes/``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import PRESETS, REPO

TYPO_LINE = "blueprints/typo.yaml:3: model.hiden_size: unknown key (did you mean 'hidden_size'?)"
TYPO_ANNOTATION = (
    "::error file=blueprints/typo.yaml,line=3,col=3,title=factory validate::"
    "model.hiden_size: unknown key (did you mean 'hidden_size'?)"
)
PRESET = "nemotron_h_8b"
# The environment the pre-commit hook is installed into is built from scratch: allow for it.
INSTALL_TIMEOUT_S = 600


def _readme_snippets() -> list[Any]:
    """The YAML blocks of README's "Validate in CI" section, parsed, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Validate in CI\n", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, re.S)]


def _environment(tmp_path: Path) -> dict[str, str]:
    """This interpreter's scripts first on PATH; git and pre-commit kept out of the user's
    configuration and caches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PRE_COMMIT_HOME"] = str(tmp_path / "pre-commit-home")
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    return env


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git repository of blueprints and recipes, one blueprint with a misspelt key.

    The preset is one that validates under ``--strict``: the job's step makes warnings
    errors, and Nano's long-context layout warns (tests/preset_stages.py)."""
    root = tmp_path / "configs"
    (root / "blueprints").mkdir(parents=True)
    shutil.copy(PRESETS / f"{PRESET}.yaml", root / "blueprints")
    shutil.copytree(PRESETS / "base", root / "blueprints" / "base", ignore=_not_yaml)
    shutil.copytree(REPO / "data_recipes", root / "data_recipes", ignore=_python_files)
    typo = f"extends: {PRESET}.yaml\nmodel:\n  hiden_size: 4\n"
    (root / "blueprints" / "typo.yaml").write_text(typo)
    env = _environment(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=root, env=env, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, env=env, check=True)
    return root


def _not_yaml(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".yaml")]


def _python_files(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".py") or n == "__pycache__"]


def test_the_actions_job_annotates_the_misspelt_key(checkout: Path, tmp_path: Path) -> None:
    steps = _readme_snippets()[0]["jobs"]["validate"]["steps"]
    runs = [step["run"] for step in steps if "run" in step]
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert runs[0] == f"pip install {project['name']}"
    # GitHub runs a step's `run` with bash, from the checkout.
    done = subprocess.run(
        ["bash", "-e", "-c", runs[1]],
        cwd=checkout,
        env=_environment(tmp_path),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    annotations = [line for line in done.stdout.splitlines() if line.startswith("::")]
    assert annotations == [TYPO_ANNOTATION]
    assert f"ok: blueprints/{PRESET}.yaml" in done.stdout
    assert "ok: data_recipes/nano.yaml" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_the_pre_commit_hook_fails_the_misspelt_blueprint(checkout: Path, tmp_path: Path) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("try-repo installs the hook from factory's git checkout; this is none")
    config = _readme_snippets()[1]
    # try-repo runs the hook exactly as the README's config names it, from this checkout.
    assert config["repos"][0]["hooks"] == [{"id": "factory-validate"}]
    done = subprocess.run(
        [sys.executable, "-m", "pre_commit", "try-repo", str(REPO), "factory-validate"],
        cwd=checkout,
        env=_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "- exit code: 2" in output and TYPO_LINE in output
    # The fragments under base/ are not whole blueprints: the hook leaves them out.
    assert "blueprints/base" not in output
    assert "Traceback" not in output
