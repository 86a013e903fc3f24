"""``factory train`` with a full disk under one checkpoint: ``python full_disk_driver.py TMP_NAME ARGS``.

Every file DCP writes into a folder named ``TMP_NAME`` (``.step_00000008.tmp``)
goes to ``/dev/full``, whose writes fail with ENOSPC as a full file system's do;
everything else is written as usual. Then the factory command line runs with ARGS.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from factory.cli.app import main


def _fill_disk_under(folder_name: str) -> None:
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def full_under_folder(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        if "w" in mode and folder_name in Path(path).parts:
            with open("/dev/full", "wb") as stream:
                yield stream
        else:
            with create_stream(self, path, mode) as stream:
                yield stream

    FileSystem.create_stream = full_under_folder  # type: ignore[method-assign]


if __name__ == "__main__":
    _fill_disk_under(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
