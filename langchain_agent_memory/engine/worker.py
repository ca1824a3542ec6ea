"""One thread for all of an engine's MLX work, callable from any thread or event loop.

MLX arrays and mlx-lm models are not made for concurrent use, and a request holds live
caches between steps; one worker thread runs every request, so callers never race and an
event loop never blocks on a prefill. Streams cross threads through a queue; a consumer
that stops reading sets the request's ``cancel`` event, which the request checks between
tokens (and then commits what it has).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
#: Builds a request's iterator on the worker thread; it should stop once ``cancel`` is set.
Job = Callable[[threading.Event], Iterator[T]]

_ITEM, _END, _ERROR = range(3)


class Worker:
    """A daemon thread fed by a queue. Why not a ``ThreadPoolExecutor``, and why no stop at
    exit: a thread that has run MLX work and *ends* during interpreter shutdown makes MLX
    abort ("terminate called without an active exception", exit code 134); a daemon thread
    that is still waiting when the process ends does not. Interrupted saves are safe: every
    write is atomic (``store.atomic_write``)."""

    def __init__(self, name: str = "agent-memory-mlx") -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread_id: int | None = None
        self._thread.start()

    def _loop(self) -> None:
        self._thread_id = threading.get_ident()
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    @property
    def has_waiting(self) -> bool:
        """Whether a job is queued behind the running one (background work yields to it)."""
        return not self._jobs.empty()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    @property
    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread_id

    def iterate(self, job: Job[T]) -> Iterator[T]:
        """The items of ``job`` (run on the worker), yielded on the calling thread."""
        if self.on_worker:
            yield from job(threading.Event())
            return
        items: queue.Queue[tuple[int, Any]] = queue.Queue()
        cancel = threading.Event()
        self.submit(_drain, job, cancel, items.put)
        try:
            while (item := _unpack(items.get())) is not _DONE:
                yield item
        finally:
            cancel.set()  # the consumer stopped early (or the job ended: harmless)

    async def aiterate(self, job: Job[T]) -> AsyncIterator[T]:
        """Async twin of ``iterate``: the event loop only awaits a queue."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def put(entry: tuple[int, Any]) -> None:
            loop.call_soon_threadsafe(items.put_nowait, entry)

        self.submit(_drain, job, cancel, put)
        try:
            while (item := _unpack(await items.get())) is not _DONE:
                yield item
        finally:
            cancel.set()


_DONE = object()


def _unpack(entry: tuple[int, Any]) -> Any:
    """A queued item, ``_DONE`` at the end, or the job's exception raised here."""
    kind, item = entry
    if kind == _ERROR:
        raise item
    return _DONE if kind == _END else item


def _drain(job: Job[Any], cancel: threading.Event, put: Callable[[tuple[int, Any]], None]) -> None:
    try:
        for item in job(cancel):
            put((_ITEM, item))
        put((_END, None))
    except BaseException as exc:  # handed to the consumer, re-raised on its thread
        put((_ERROR, exc))
