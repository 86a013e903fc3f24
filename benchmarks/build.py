"""``factory build nano|super|ultra`` end to end, each in a fresh process, stage by stage.

Goal (issue 15): each preset's whole build, every stage included, in under 5 minutes on
this 2-core machine. The limit is the goal itself; stage times come from each build's
``build.json`` so the slowest stage is named beside the total.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import describe

GOAL_S = 300.0


def run_one(name: str, out: Path, extra: list[str]) -> tuple[float, dict]:
    """Wall seconds of ``python -m factory build NAME`` and its build.json stages."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    command = [sys.executable, "-m", "factory", "build", name, "--out", str(out), *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"factory build {name} failed:\n{done.stderr[-3000:]}")
    return seconds, json.loads((out / "build.json").read_text())["stages"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks build")
    parser.add_argument("names", nargs="*", default=["nano", "super", "ultra"])
    parser.add_argument("--work", type=Path, default=None, help="build folders (default: temp)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="more `factory build` options")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="factory-bench-build-"))
    print(f"machine: {describe()}, load average {os.getloadavg()[0]:.2f}")
    stages: list[str] = []
    rows = []
    for name in args.names:
        seconds, record = run_one(name, work / name, args.args)
        stages = list(record)
        rows.append((name, seconds, record))
        slowest = max(record.values(), key=lambda r: r["seconds"])
        verdict = "met" if seconds <= GOAL_S else "MISSED"
        print(
            f"{name:6s} {seconds:7.1f} s (goal <= {GOAL_S:.0f} s: {verdict}); slowest stage "
            f"{slowest['stage']} {slowest['seconds']:.1f} s",
            flush=True,
        )
    print("\nseconds per stage:")
    print(f"{'stage':12s}" + "".join(f"{name:>9s}" for name, _, _ in rows))
    for stage in stages:
        cells = "".join(f"{record[stage]['seconds']:9.1f}" for _, _, record in rows)
        print(f"{stage:12s}{cells}")
    print(f"{'total (wall)':12s}" + "".join(f"{s:9.1f}" for _, s, _ in rows))
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0
