"""Files that are never seen half-written, and a lock over a directory across processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: Temporary files of ``atomic_write`` start with this (and are hidden: a leading dot).
TEMP_PREFIX = "."


def atomic_write(path: Path, write: Callable[[str], object], suffix: str = ".tmp") -> int:
    """Write ``path`` through ``write(temp_path)``, then fsync and rename: readers see the
    old file or the new one, never a torn one. Returns the size written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return size


def atomic_write_bytes(path: Path, data: bytes) -> int:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


class DirectoryLock:
    """An exclusive lock over one cache directory, across processes and threads (``flock`` on
    a lock file); re-entrant within a thread, so a commit can hold it around the writes and
    deletes it is made of. NOTE: each thread locks through a descriptor of its own, and
    ``flock`` refuses a second descriptor of the file while one holds it, in this process as
    in any other: no thread lock is needed beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mine = threading.local()  # .fd, .depth: this thread's hold

    def __enter__(self) -> None:
        mine = self._mine
        depth = getattr(mine, "depth", 0)
        if depth == 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            mine.fd = fd
        mine.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        mine = self._mine
        mine.depth -= 1
        if mine.depth == 0:
            os.close(mine.fd)  # closing the descriptor releases the flock
            mine.fd = None
