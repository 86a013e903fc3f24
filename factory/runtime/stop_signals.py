"""SIGTERM and SIGINT during training: a request to stop at the next step boundary.

Slurm, Kubernetes and torchrun send SIGTERM, and wait a while, before they kill
a process; a terminal sends SIGINT. While :func:`catching_stop_signals` is
active, the first of these only records which signal came; the trainer asks
:attr:`StopSignals.received` between steps, agrees on it with the other ranks,
checkpoints and ends the run (``factory.runtime.trainer``). A second signal
ends the process at once, as the signal's default action would have, unless
the process runs under torchrun's agent: the agent forwards the signal it
received to every rank, so a rank that got it directly too sees it twice, and
the agent itself escalates to SIGKILL after its shutdown timeout.

This module does not import torch.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["STOP_SIGNALS", "StopSignals", "catching_stop_signals", "exit_status"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every worker's environment."""


def exit_status(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process the signal ended (143
    for SIGTERM, 130 for SIGINT), so schedulers and scripts read a stop as a stop."""
    return 128 + signum


class StopSignals:
    """Which stop signal this process received first (``received``; 0: none yet)."""

    def __init__(self, repeats_exit: bool) -> None:
        self.received = 0
        self.repeats_exit = repeats_exit

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum
        elif self.repeats_exit:  # the user insists: die as the signal's default action would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


@contextmanager
def catching_stop_signals(enabled: bool = True) -> Iterator[StopSignals]:
    """Record SIGTERM and SIGINT instead of dying, for the length of the block.

    Handlers can only be set from the main thread; elsewhere (or with ``enabled`` False)
    nothing is caught and ``received`` stays 0.
    """
    stop = StopSignals(repeats_exit=UNDER_TORCHRUN not in os.environ)
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.signal(signum, stop.handle) for signum in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
