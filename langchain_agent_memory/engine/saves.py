"""Saves off the model's thread: block writes, checksums, fsync and the index transaction
of every finished request run here, one after another, while the worker thread goes on
with the next steps of every other agent.

Why: on the H200 a cold 32K-token turn of an 8B model spent 5.8-7.5 s saving at 4 bits
after its last token, on the worker, under the lock the model steps take: its reply
waited for it, and so did every other agent's decode. Now a request ends with what only
the worker can do (the new tokens quantized into the agent's stored form, the new blocks'
tensors evaluated and viewed from the host, ``freeze_blocks``); the reply leaves, and the
write follows here.

Semantics: the agent's next request in this process starts from its live caches at once;
its record is published only after its blocks are durable (``BlockPool.save_agent``, the
same protocol as before: a crash leaves the previous record or the new one, each with all
of its blocks); saves run in the order requests finished. ``flush`` waits for every save
queued so far and raises the first that failed since the last ``flush``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from weakref import WeakSet

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Every open queue of this process, to let a store opened later (another engine on the
#: same directory) see what the replies of earlier ones said was saved (``wait_for``).
_QUEUES: WeakSet[SaveQueue] = WeakSet()
_QUEUES_LOCK = threading.Lock()


class SaveQueue:
    """One thread for one engine's saves, in submission order (no MLX op runs on it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-memory-saves")
        self._lock = threading.Lock()
        self._last: Future[Any] | None = None
        self._failed: BaseException | None = None
        with _QUEUES_LOCK:
            _QUEUES.add(self)

    def submit(self, save: Callable[[], T], what: str) -> Future[T]:
        """Run ``save`` after every save submitted before it; a failure is logged (naming
        ``what``) and kept for ``flush``."""

        def run() -> T:
            try:
                return save()
            except BaseException as exc:
                logger.warning("%s was not saved: %s", what, exc)
                with self._lock:
                    self._failed = self._failed or exc
                raise

        with self._lock:
            self._last = future = self._pool.submit(run)
        return future

    def wait(self) -> None:
        """Until every save submitted so far has ended (failed or not)."""
        with self._lock:
            last = self._last
        if last is not None:
            # A later one ends after every earlier one (one thread, in order).
            last.exception()

    def flush(self) -> None:
        """``wait``, then raise the first save that failed since the last ``flush``."""
        self.wait()
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._last is None or self._last.done()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        with _QUEUES_LOCK:
            _QUEUES.discard(self)


def wait_for(directory: Path) -> None:
    """Wait for the saves this process has queued into ``directory`` (a store opened there
    then reads what every earlier reply said it saved)."""
    with _QUEUES_LOCK:
        queues = [q for q in _QUEUES if q.directory == directory]
    for q in queues:
        q.wait()
