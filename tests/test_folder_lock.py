"""``factory.folder_lock``: one writer per folder, a lock that dies with its process, and a
clear line where the filesystem cannot lock at all. (The data build's and the training's
use of it are tested end to end in test_data_build_faults.py and test_train_run_folder.py.)"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.folder_lock import FolderBusy, held_folder, release, try_lock

HOLD = (
    "import sys, time\nfrom pathlib import Path\nfrom factory.folder_lock import try_lock\n"
    "try_lock(Path(sys.argv[1]), '.lock')\nprint('held', flush=True)\ntime.sleep(60)\n"
)


def test_a_second_holder_is_told_the_first_ones_pid_until_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(FolderBusy) as busy:
            try_lock(tmp_path, ".lock")
        assert busy.value.holder == str(holder.pid)
    finally:
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait()
    with held_folder(tmp_path, ".lock"):
        assert (tmp_path / ".lock").read_text().strip().isdigit()
    assert (tmp_path / ".lock").read_text() == ""  # a finished folder's bytes do not vary


def test_one_process_cannot_take_its_own_folder_twice(tmp_path: Path) -> None:
    fd = try_lock(tmp_path, ".lock")
    try:
        with pytest.raises(FolderBusy):
            try_lock(tmp_path, ".lock")  # flock locks belong to the open file, not the pid
    finally:
        release(fd)


def test_a_filesystem_without_locks_is_one_clear_oserror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError) as refused:
        try_lock(tmp_path, ".lock")
    assert refused.value.errno == errno.ENOLCK
    assert refused.value.filename == str(tmp_path / ".lock")
    assert "-o flock" in str(refused.value.strerror)


def test_a_full_disk_while_writing_the_pid_names_the_file_and_lets_the_lock_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", full)
        with pytest.raises(OSError) as refused:
            try_lock(tmp_path, ".lock")
    assert refused.value.errno == errno.ENOSPC
    assert refused.value.filename == str(tmp_path / ".lock")
    release(try_lock(tmp_path, ".lock"))  # not left held by this process
