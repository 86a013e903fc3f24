"""How long ``factory validate`` takes on every preset, against ``python -c "import torch"``.

Both are timed as fresh processes, interleaved, in the same run, so machine
noise hits both alike. The goal is a ratio below 0.25: validating
every preset must cost well under what merely importing torch costs.
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks validate")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    validate = [sys.executable, "-m", "factory", "validate", "--quiet"]
    torch_import = [sys.executable, "-c", "import torch"]
    _time(validate), _time(torch_import)  # warm the page cache for both
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(_time(validate))
        theirs.append(_time(torch_import))
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    from factory.loading.load import preset_names

    print(f"machine: {describe()}")
    print(f"factory validate ({len(preset_names())} presets, one process): median {ours_s:.3f} s")
    print(f"python -c 'import torch':                 median {theirs_s:.3f} s")
    print(f"ratio: {ours_s / theirs_s:.3f} (goal < 0.25), {args.repeats} repeats each")
    return 0
