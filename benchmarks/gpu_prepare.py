"""``python -m benchmarks gpu --prepare``: the wheels the GPU machine lacks, in ``.gpu_wheels/``.

The GPU machine has Python 3.12, PyTorch, Triton and transformers (with what they depend
on) and no network; the working tree that travels there is at most 64 MiB, ignored
folders included. So, here, with the network:

1. the requirements the GPU command needs: the project's own dependencies, its ``torch``
   extra, and pytest, hypothesis (section 1's tests) and setuptools (the editable install's
   build backend, which pip's isolated build fetches from the folder);
2. their closure, read from this environment's installed metadata (markers evaluated for
   CPython 3.12 on x86-64 Linux), all of it: it is small (about 8 MiB), and the versions
   the machine has of what it shares with torch and transformers are unknown;
3. each one pinned to the version installed here (the versions the tests ran with) where
   that meets the project's bound, else the newest release within the bound,
   downloaded as a CPython 3.12 manylinux wheel (``pip download --only-binary=:all:
   --no-deps``), or, for a pure-Python package published only as a source archive, built
   into a wheel here (``pip wheel --no-deps``);
4. the field's kernel packages of the ``gpu`` extra that need no CUDA toolchain
   (:data:`WITHOUT_CUDA`: mamba-ssm), built here into wheels without their CUDA extensions
   and listed in ``.gpu_wheels/without-deps.txt``: the device installs them without their
   declared dependencies (tilelang, quack-kernels...; what their Triton kernels import,
   einops, is in :data:`ALSO_NEEDED`);
5. the folder's size checked against :data:`LIMIT_BYTES`, with the top-level requirements
   written to ``.gpu_wheels/requirements.txt``.

On the device, ``python -m benchmarks gpu`` installs from the folder
(``benchmarks.gpu_install``).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks.gpu_install import FOLDER, REPO, WITHOUT_DEPS

LIMIT_BYTES = 40 * 2**20
"""Room left for the tree (~10 MiB) under the device's 64 MiB."""

ON_DEVICE = ("torch", "triton", "transformers")
"""What the GPU machine has, as its lender describes it (with CUDA 13, no network)."""

EXTRAS = ("torch",)
ALSO_NEEDED = ("pytest>=8", "hypothesis>=6.100", "setuptools>=77", "einops>=0.8")
WITHOUT_CUDA = {"mamba-ssm": {"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"}}
"""Packages of the ``gpu`` extra whose Triton kernels factory runs (``factory.kernels.
mamba_ssm_triton``), with the environment that builds them without their CUDA extension:
a pure-Python wheel of a few hundred kB, where the extension would need nvcc."""
DEVICE_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
    "platform_system": "Linux", "platform_machine": "x86_64", "extra": "",
}  # fmt: skip
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux_2_28_x86_64"]  # fmt: skip

Requires = Callable[[str], list[str] | None]
"""A distribution's requirement strings (``importlib.metadata.requires``), None if unknown."""


def top_level(pyproject: dict) -> list[str]:
    """The requirement strings the GPU command needs that the machine does not bring."""
    project = pyproject["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    wanted += ALSO_NEEDED
    present = {canonicalize_name(n) for n in ON_DEVICE}
    return [r for r in wanted if canonicalize_name(Requirement(r).name) not in present]


def _applies(requirement: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether ``requirement`` holds on the device, for a parent installed with ``extras``."""
    marker: Marker | None = requirement.marker
    if marker is None:
        return True
    return any(marker.evaluate({**DEVICE_ENVIRONMENT, "extra": e}) for e in ("", *extras))


def closure(roots: Iterable[str], requires: Requires) -> set[str]:
    """Canonical names of ``roots`` and everything they require on the device, transitively
    (with what the extras a requirement names pull in)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if not _applies(requirement) or name in seen:
            continue
        seen.add(name)
        for line in requires(name) or []:
            child = Requirement(line)
            if _applies(child, requirement.extras):
                child.marker = None
                todo.append(child)
    return seen


def to_download(pyproject: dict, requires: Requires) -> list[str]:
    """Canonical names to download: the whole closure of what the command needs. Packages the
    machine may already have (typing-extensions, packaging, pyyaml through torch and
    transformers) are packed too, because its versions are unknown and ours may need newer
    ones; the offline install keeps those that satisfy the requirements."""
    return sorted(closure(top_level(pyproject), requires))


def _installed_requires(name: str) -> list[str] | None:
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return None


def pin(name: str, pyproject: dict, installed: Callable[[str], str | None]) -> str:
    """``name==<the version installed here>`` when that meets the project's own bound on it
    (in what :func:`top_level` lists or the ``gpu`` extra); else the bound (the newest release
    within it)."""
    wanted = top_level(pyproject) + pyproject["project"]["optional-dependencies"].get("gpu", [])
    bounds = {canonicalize_name(r.name): r.specifier for r in map(Requirement, wanted)}
    version, bound = installed(name), bounds.get(name)
    if version is not None and (bound is None or bound.contains(version, prereleases=True)):
        return f"{name}=={version}"
    return f"{name}{bound or ''}"


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fetch(pin: str) -> str:
    """Download one wheel into the folder; build it here when only a source archive exists."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    done = subprocess.run([*pip, "download", *PLATFORM, "--no-deps", "-d", str(FOLDER), pin],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode == 0:
        return "wheel"
    built = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(FOLDER), pin],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode != 0:
        raise RuntimeError(f"{pin}: no wheel for the device and none built here:\n{built.stderr}")
    return "built here"


def _build_without_cuda(pin: str, env: dict[str, str]) -> str:
    """Build one wheel here with ``env`` (no CUDA extension). Without build isolation: the
    build imports torch, which the isolated environment would download whole."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                            "-w", str(FOLDER), pin],
                           capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip
    if built.returncode != 0:
        raise RuntimeError(f"{pin}: the build without CUDA failed:\n{built.stderr}")
    return "built here without CUDA"


def prepare() -> int:
    """Fill ``.gpu_wheels/``; print what came from where and the folder's size."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    names = to_download(pyproject, _installed_requires)
    shutil.rmtree(FOLDER, ignore_errors=True)
    FOLDER.mkdir()
    for name in names:
        wanted = pin(name, pyproject, _installed_version)
        print(f"prepare: {wanted}: {_fetch(wanted)}", flush=True)
    kernels = [pin(name, pyproject, _installed_version) for name in WITHOUT_CUDA]
    for name, wanted in zip(WITHOUT_CUDA, kernels, strict=True):
        print(f"prepare: {wanted}: {_build_without_cuda(wanted, WITHOUT_CUDA[name])}", flush=True)
    WITHOUT_DEPS.write_text("\n".join(kernels) + "\n", "utf-8")
    (FOLDER / "requirements.txt").write_text("\n".join(top_level(pyproject)) + "\n", "utf-8")
    size = sum(f.stat().st_size for f in FOLDER.iterdir())
    print(f"prepare: {len(names) + len(kernels)} packages, {size / 2**20:.1f} MiB in {FOLDER.name}/ "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB)")  # fmt: skip
    if size > LIMIT_BYTES:
        print("prepare: over the limit: the tree would not travel", file=sys.stderr)
        return 1
    return 0
