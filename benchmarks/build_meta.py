"""How long building each preset's full graph on the meta device takes, and its peak memory.

The goal is Ultra (560B parameters) in under 10 s with under 2 GB of
resident memory: the meta device allocates no storage, so this measures the
graph construction itself. Each preset builds in a fresh process so that
imports and peak memory are its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.machine import describe

SCRIPT = """
import json, resource, time
t0 = time.perf_counter()
import factory, factory.compilation  # torch import counted here, not in the build
bp = factory.load_blueprint({name!r})
t1 = time.perf_counter()
compiled = factory.compile(bp, device="meta")
t2 = time.perf_counter()
params = sum(p.numel() for p in compiled.model.parameters())
print(json.dumps({{"import_and_load_s": t1 - t0, "build_s": t2 - t1, "params": params,
                  "plan": factory.plan(compiled.blueprint).params.total,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks build_meta")
    parser.add_argument("names", nargs="*", default=["nano", "super", "ultra"])
    args = parser.parse_args(argv)
    print(f"machine: {describe()}")
    print(
        f"{'preset':8s} {'params':>17s} {'build (s)':>10s} {'imports+load (s)':>16s} {'peak RSS (MiB)':>15s}"
    )
    for name in args.names:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(name=name)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        row = json.loads(out)
        assert row["params"] == row["plan"], "built parameter count differs from the plan"
        print(
            f"{name:8s} {row['params']:17,d} {row['build_s']:10.2f} "
            f"{row['import_and_load_s']:16.2f} {row['peak_rss_mib']:15.0f}"
        )
    return 0
