"""On the GPU machine: install factory and the wheels it lacks from ``.gpu_wheels/`` (made by
``python -m benchmarks gpu --prepare``), offline. Standard library only: it runs before
anything the project depends on can be imported.

``pip install --no-index --find-links .gpu_wheels -r .gpu_wheels/requirements.txt`` keeps
what the machine already has and installs the rest from the folder; ``--no-deps -r
.gpu_wheels/without-deps.txt`` adds the kernel packages built without CUDA (mamba-ssm: their
declared dependencies are for the CUDA extension and other kernels, which factory does not
use); then ``pip install --no-index --find-links .gpu_wheels --no-deps -e .`` installs factory
itself (pip's isolated build takes setuptools from the folder too), and the command starts
again in a fresh interpreter, which sees the editable install.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / ".gpu_wheels"
WITHOUT_DEPS = FOLDER / "without-deps.txt"
"""The kernel packages built without CUDA (``gpu_prepare.WITHOUT_CUDA``), installed with --no-deps."""


def install_offline_if_needed() -> None:
    """On the device: install factory and what it lacks from ``.gpu_wheels/`` when factory is
    not installed and the folder travelled with the tree."""
    try:
        importlib.metadata.version("nemotron-factory")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    if not (FOLDER / "requirements.txt").is_file():
        print("gpu: factory is not installed and .gpu_wheels/ is missing "
              "(run python -m benchmarks gpu --prepare where there is a network)", file=sys.stderr)  # fmt: skip
        return
    offline = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
               "--no-index", "--find-links", str(FOLDER)]  # fmt: skip
    env = {**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    subprocess.run([*offline, "-r", str(FOLDER / "requirements.txt")], check=True, env=env)
    if WITHOUT_DEPS.is_file():
        subprocess.run([*offline, "--no-deps", "-r", str(WITHOUT_DEPS)], check=True, env=env)
    subprocess.run([*offline, "--no-deps", "-e", str(REPO)], check=True, env=env)
    # The editable install maps factory.kernels and factory.schemas through a finder that a
    # .pth file registers at interpreter start: this process started before it existed.
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
