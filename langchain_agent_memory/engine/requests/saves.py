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

What the queue knows of its saves is the save thread's (the first failure, whether a save
runs) or the loop's (the latest save's settling): a wait is a job queued behind the saves,
and no lock is taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any, TypeVar
from weakref import WeakSet

from ..ops.process import RUNTIME
from ..storage.remote import upload_before_exit

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Every open queue of this process, to let a store opened later (another engine on the
#: same directory) see what the replies of earlier ones said was saved (``wait_for``).
_QUEUES: WeakSet[SaveQueue] = WeakSet()


class SaveQueue:
    """One thread for one engine's saves, in submission order (no MLX op runs on it)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._thread = RUNTIME.pool("agent-memory-saves", 1)
        #: the latest save's settling on the engine's loop (``Committer``; the loop's): a
        #: wait ends after it too, so that nothing of a save runs once the process's exit
        #: has waited
        self._settled: Future[Any] | None = None
        # The save thread's:
        self._failed: BaseException | None = None  # the first since the last ``flush``
        self._running = False
        self._closed = False
        with RUNTIME.lock:
            _QUEUES.add(self)

    def submit(self, save: Callable[[], object], what: str, settled: Future[Any] | None = None) -> None:
        """Run ``save`` after every save submitted before it. A save reports its own failure
        (``failed``) before it hands it to another thread; one that raises is reported here.
        ``settled``: done once the save's outcome has been taken in where it goes (the
        loop's message), which ``wait`` waits for too."""
        if settled is not None:
            self._settled = settled

        def run() -> None:
            try:
                save()
            except BaseException as exc:  # not raised on: the future is no one's to read
                self.failed(exc, what)

        self._queue(run)

    def failed(self, error: BaseException, what: str) -> None:
        """A save's failure (on the save thread, before ``error`` goes to any other): logged,
        its traceback at debug level; kept for ``flush`` if it is the first since the last;
        and let go of its frames. Those frames, finished, still hold the save's job, its
        blocks and the agent's layer caches (a frame keeps its function, and so its closure,
        even once cleared): whatever kept the error kept them, after the agent had left the
        hot tier, and the turn's waiter is handed the error while the save thread may still
        be raising it (an asyncio future keeps the traceback it is handed). The first
        failure waits for ``flush``, which a server never calls: 78 MB for one failed
        1.5K-token turn of SmolLM2, for the process's life."""
        logger.warning("%s was not saved: %s", what, error)
        logger.debug("%s: the failure", what, exc_info=error)
        _drop_frames(error)
        self._failed = self._failed or error

    def call(self, op: Callable[[], T]) -> T:
        """Run ``op`` after every save submitted before it and return what it returns (a
        fork, a delete: its caller waits and gets its error; nothing is kept for ``flush``)."""
        return self._queue(op).result()

    def _queue(self, op: Callable[[], T]) -> Future[T]:
        def run() -> T:  # on the save thread
            self._running = True
            try:
                return op()
            finally:
                self._running = False

        return self._thread.submit(run)

    @property
    def queued(self) -> int:
        """Saves and changes submitted that have not ended yet (read without waiting: the
        save thread's backlog and the one it runs)."""
        return self._thread.backlog + self._running

    def wait(self, timeout: float | None = None) -> bool:
        """Until every save submitted so far has ended (failed or not); False if some had
        not within ``timeout`` seconds."""
        if self._closed:
            return True
        # A job queued now ends after every earlier one (one thread, in order); the loop
        # settles saves in order too.
        try:
            marker = self._thread.submit(_nothing)
        except RuntimeError:  # closed meanwhile: every save had ended first
            return True
        pending = [marker, *([self._settled] if self._settled is not None else [])]
        _, not_done = futures_wait(pending, timeout)
        return not not_done

    def flush(self) -> None:
        """``wait``, then raise the first save that failed since the last ``flush``."""
        self.wait()
        failed = self._thread.submit(self._take_failed).result()
        if failed is not None:
            raise failed

    def _take_failed(self) -> BaseException | None:
        failed, self._failed = self._failed, None
        return failed

    def close(self) -> None:
        self.wait()
        self._closed = True
        self._thread.shutdown(wait=False)
        with RUNTIME.lock:
            _QUEUES.discard(self)


def _drop_frames(error: BaseException) -> None:
    """``error`` and the errors it chains (causes and contexts) without their tracebacks."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [error]
    while chain:
        e = chain.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        chain += [e.__cause__, e.__context__]


def _nothing() -> None:
    """A job that marks a place in the save thread's queue."""


def wait_for(directory: Path) -> None:
    """Wait for the saves this process has queued into ``directory`` (a store opened there
    then reads what every earlier reply said it saved)."""
    with RUNTIME.lock:
        queues = [q for q in _QUEUES if q.directory == directory]
    for q in queues:
        q.wait()


#: Seconds the process's exit waits for the saves queued (and then for the uploads of saves
#: kept locally) before it gives up on them and says which.
EXIT_WAIT_S = 60.0


def _save_at_exit() -> None:
    """A script that ends without ``close()`` loses nothing: its replies' saves (queued on
    daemon threads, which run on during exit) finish first, then what stayed local is
    uploaded to a shared store (``upload_before_exit``), each for at most ``EXIT_WAIT_S``."""
    deadline = time.monotonic() + EXIT_WAIT_S
    with RUNTIME.lock:
        queues = list(_QUEUES)
    for q in queues:
        if not q.wait(max(0.0, deadline - time.monotonic())):
            logger.warning(
                "saves into %s were still running after %g s at exit; the agents' previous caches "
                "stand for them",
                q.directory, EXIT_WAIT_S,
            )  # fmt: skip
    upload_before_exit(time.monotonic() + EXIT_WAIT_S)


RUNTIME.at_exit(_save_at_exit)
