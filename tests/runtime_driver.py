"""Train the tiny runtime blueprint in a child process, optionally killing it with SIGKILL.

Used by test_runtime_resume.py: ``python runtime_driver.py SPEC.json`` where the
spec names the blueprint (JSON), the data folder, the run folder, the steps,
whether to resume, the checkpoint mode, the held-out sets ``training.eval`` reads
(``heldout``: category to folder), and where to die: ``{"step": k}``
during the k-th optimizer step (after its backward pass, before its update),
or ``{"checkpoint": k}`` during the k-th checkpoint write (its files written,
not yet renamed into place).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kill: dict[str, int]) -> None:
    from factory.runtime import checkpoint, trainer

    calls = {"n": 0}
    if "step" in kill:
        original = trainer.forward_backward

        def forward_backward(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            out = original(*args, **kwargs)
            if calls["n"] == kill["step"]:
                _die()
            return out

        trainer.forward_backward = forward_backward
    if "checkpoint" in kill:
        fsync = checkpoint._fsync_tree

        def fsync_then_die(directory: Path) -> None:
            fsync(directory)
            calls["n"] += 1
            if calls["n"] == kill["checkpoint"]:
                _die()

        checkpoint._fsync_tree = fsync_then_die


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)  # the same reduction order in every process
    import factory
    from factory.runtime.fit import fit
    from factory.runtime.loader import ShardLoader
    from factory.runtime.run_options import RunOptions
    from factory.schemas.blueprint import Blueprint

    bp = Blueprint.model_validate(spec["blueprint"])
    _arm(spec.get("kill", {}))
    compiled = factory.compile(bp, seed=0, precision=spec.get("precision", "emulate"))
    options = RunOptions(
        run_dir=Path(spec["run_dir"]),
        checkpoint_every=spec.get("every", 2),
        async_checkpoint=spec.get("async", False),
        resume=spec.get("resume", False),
        heldout={category: Path(folder) for category, folder in spec.get("heldout", {}).items()},
    )
    with ShardLoader(Path(spec["data"]), bp.parallelism.micro_batch_size, seed=3) as loader:
        result = fit(compiled, loader, spec["steps"], options)
    print(json.dumps({"end": result.end, "steps": len(result.records)}))


if __name__ == "__main__":
    main()
