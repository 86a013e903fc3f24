"""``python -m factory.data.samples --out data_recipes/samples``: regenerate the sample corpus."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from factory.data.samples import write_samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m factory.data.samples", description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=Path("data_recipes/samples"), help="output folder"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (the shipped corpus uses 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every record count")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    paths = write_samples(args.out, seed=args.seed, scale=args.scale)
    total = sum(p.stat().st_size for p in paths.values())
    for name, path in paths.items():
        print(f"{path.stat().st_size:>10,d}  {path}  ({name})")
    print(f"{total:>10,d}  bytes in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
