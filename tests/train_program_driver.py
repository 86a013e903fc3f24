"""Run ``factory train`` in this process, optionally killing it with SIGKILL on the way.

Used by test_train_program.py: ``python train_program_driver.py SPEC.json`` where the spec
holds ``argv`` (the command's arguments after ``factory``) and where to die: ``{"step": k}``
during the k-th optimizer step of the process (after its backward pass, before its update),
or ``{"export": k}`` as the k-th Hugging Face export begins (the stage's train.json written,
its model/ not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _counted(module: Any, name: str, at: int, before: bool = False) -> None:
    """Replace ``module.name`` by the same function that kills the process on call ``at``
    (``before`` it runs, or after)."""
    original, calls = getattr(module, name), {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if before and calls["n"] == at:
            _die()
        out = original(*args, **kwargs)
        if calls["n"] == at:
            _die()
        return out

    setattr(module, name, wrapper)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)  # the same reduction order in every process
    from factory.cli.app import main as factory_main
    from factory.jobs import train_rank
    from factory.runtime import trainer

    kill = spec.get("kill", {})
    if "step" in kill:
        _counted(trainer, "forward_backward", kill["step"])
    if "export" in kill:
        _counted(train_rank, "write_hf_checkpoint", kill["export"], before=True)
    sys.exit(factory_main(spec["argv"]))


if __name__ == "__main__":
    main()
