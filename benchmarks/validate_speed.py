"""How long ``factory validate`` takes on every preset, against ``python -c "import torch"``.

Both are timed as fresh processes, interleaved, in the same run, so machine
noise hits both alike. The goal is a ratio below 0.15 (issue 36; it was 0.25):
validating every preset must cost well under what merely importing torch costs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from benchmarks.machine import describe


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _compile_bytecode() -> None:
    """Write factory's bytecode, as ``pip install`` does for an installed package.

    An editable checkout run with PYTHONDONTWRITEBYTECODE (as this workplace's
    shells are) would otherwise compile every factory module from source on
    each run, while torch's wheel ships its bytecode: that compares a cold
    checkout with an installed package, not validate with import torch.
    """
    import compileall

    import factory
    import factory.kernels
    import factory.schemas

    for package in (factory, factory.schemas, factory.kernels):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks validate")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    _compile_bytecode()
    validate = [sys.executable, "-m", "factory", "validate", "--quiet"]
    torch_import = [sys.executable, "-c", "import torch"]
    _time(validate), _time(torch_import)  # warm the page cache for both
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(_time(validate))
        theirs.append(_time(torch_import))
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    from factory.loading.blueprint import preset_names
    from factory.loading.shipped import shipped_names

    print(f"machine: {describe()}")
    recipes = len(shipped_names("factory.data_recipes"))
    what = f"{len(preset_names())} presets, {recipes} recipes"
    print(f"factory validate ({what}, one process): median {ours_s:.3f} s")
    print(f"python -c 'import torch':                 median {theirs_s:.3f} s")
    print(f"ratio: {ours_s / theirs_s:.3f} (goal < 0.15), {args.repeats} repeats each")
    return 0
