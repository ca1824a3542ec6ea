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
    """An exclusive lock over one cache directory, across processes (``flock`` on a lock
    file) and threads; re-entrant within a thread, so a commit can hold it around the
    writes and deletes it is made of."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        if self._depth == 0:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
            except BaseException:
                self._thread_lock.release()
                raise
            self._fd = fd
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None
        self._thread_lock.release()
