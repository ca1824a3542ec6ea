"""One thread for all of an engine's MLX work, callable from any thread or event loop.

MLX arrays and mlx-lm models are not made for concurrent use, and a request holds live
caches between steps; one worker thread runs every request, so callers never race and an
event loop never blocks on a prefill. While requests are in progress the thread alternates
between the jobs queued for it (new requests, prefetches) and a *step* of its stepper (the
engine's scheduler: a batched decode step and a prefill chunk). Streams cross threads
through a queue (a ``Sink`` on the worker side); a consumer that stops reading sets the
request's ``cancel`` event, which the request checks between tokens (and then commits
what it has).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from ..ops.owner import Owner
from ..ops.process import RUNTIME, run_job

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ITEM, _END, _ERROR = range(3)


class Stepper(Protocol):
    def has_work(self) -> bool: ...
    def step(self) -> None: ...


class Sink:
    """The worker's end of a stream: items, then an end or an error, for one consumer."""

    def __init__(self, put: Callable[[tuple[int, Any]], None]) -> None:
        self._put = put
        self.closed = False

    def item(self, item: Any) -> None:
        self._put((_ITEM, item))

    def end(self) -> None:
        if not self.closed:
            self.closed = True
            self._put((_END, None))

    def error(self, exc: BaseException) -> None:
        if not self.closed:
            self.closed = True
            self._put((_ERROR, exc))


#: Starts a stream on the worker thread: given the consumer's cancel event and a sink.
Start = Callable[[threading.Event, Sink], None]


_STOP: Any = object()  # a job that ends the worker's loop (``Worker.stop``)


class Worker:
    """One engine's MLX work, run in order on a thread lent by the process runtime (why lent,
    not a ``ThreadPoolExecutor``: ``ops.process``). At the process's exit the loop returns
    after the step or job it is running: the requests in progress end there (their agents
    keep the caches saved before), and no MLX work runs while the interpreter finalizes,
    which would abort the process. Interrupted saves are safe (see ``store``)."""

    def __init__(self, name: str = "agent-memory-mlx") -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._jobs = queue.SimpleQueue()
        self._stepper: weakref.ref[Stepper] | None = None
        self._stopped = False
        self._halted = False  # the process exits: leave now, requests in progress or not
        self._thread_id: int | None = None
        #: The cache state this loop owns (``ops.owner``): bound while the loop runs.
        self.owner = Owner()
        self._loan = RUNTIME.lend(self._run_loop, name, self._halt)

    @property
    def stepper(self) -> Stepper | None:
        """What the thread steps while requests are in progress (the engine's scheduler).
        Held weakly: the thread is a root, and an engine dropped without ``close()`` must
        still be freed (its finalizer then stops this worker: ``Engine``)."""
        return self._stepper() if self._stepper is not None else None

    @stepper.setter
    def stepper(self, stepper: Stepper | None) -> None:
        self._stepper = weakref.ref(stepper) if stepper is not None else None

    def _run_loop(self) -> None:
        try:
            self._loop()
        finally:
            self._thread_id = None
            self.owner.release()

    def _loop(self) -> None:
        self._thread_id = threading.get_ident()
        self.owner.bind()
        while not self._halted:
            stepper = self.stepper
            if stepper is not None and stepper.has_work():
                # The jobs queued now (not those they queue again), then one step.
                for _ in range(self._jobs.qsize()):
                    if (job := self._jobs.get()) is _STOP:
                        return
                    self._run(*job)
                try:
                    stepper.step()
                except BaseException:  # a step fails its own requests; never the thread
                    logger.exception("engine step failed")
                continue
            stepper = None  # not held while parked: a closed engine can then be freed
            job = self._jobs.get()
            if job is _STOP:
                return
            self._run(*job)
            del job  # not held while parked either (its closure may reach the engine)

    _run = staticmethod(run_job)

    @property
    def has_waiting(self) -> bool:
        """Whether work waits behind the running job: queued jobs, or requests in progress
        (background work such as a prefetch yields to either)."""
        return not self._jobs.empty() or (self.stepper is not None and self.stepper.has_work())

    def stop(self, wait: bool = True) -> None:
        """Give the thread back once the jobs queued before this have run (its engine was
        closed, or freed); ``wait``: until then."""
        if self._stopped:
            return
        self._stopped = True
        self._jobs.put(_STOP)  # type: ignore[arg-type]
        if wait and not self.on_worker:
            self._loan.join()  # the thread is back with the runtime, for the next engine

    def _halt(self) -> None:
        """The process exits: the loop returns after what it is running (``RUNTIME.lend``)."""
        self._halted = True
        self._jobs.put(_STOP)  # type: ignore[arg-type]

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._stopped:  # a job no thread would run: its caller would wait forever
            raise RuntimeError("this Engine was closed; create a new one")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` run by the loop, waited for: a message the loop answers (a query or
        a command on the cache state it owns). On the loop itself, or once it has stopped
        (its engine closed or freed: nothing races it any more), run here."""
        if self.on_worker or self._stopped:
            return fn(*args)
        return self.submit(fn, *args).result()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` run by the loop, not waited for (a result the I/O side hands back:
        ``Committer``); once the loop has stopped, run here."""
        if self._stopped:
            fn(*args)
        else:
            self.submit(fn, *args)

    @property
    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread_id

    def iterate(self, start: Start) -> Generator[Any, None, None]:
        """The items of the stream ``start`` opens on the worker, on the calling thread."""
        if self.on_worker:
            raise RuntimeError(
                "a stream cannot be read on the engine's own worker thread (it would wait on itself)"
            )
        items: queue.Queue[tuple[int, Any]] = queue.Queue()
        cancel = threading.Event()
        self.submit(start, cancel, Sink(items.put))
        ended = yielded = False
        try:
            while (item := _unpack(items.get())) is not _DONE:
                yielded = True
                yield item
            ended = True
        finally:
            cancel.set()  # the consumer stopped early (or the stream ended: harmless)
            if yielded and not ended:  # decoding: it stops within a step (see ``_settled``)
                _settled(lambda: items.get(timeout=SETTLE_S))

    async def aiterate(self, start: Start) -> AsyncGenerator[Any, None]:
        """Async twin of ``iterate``: the event loop only awaits a queue."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def put(entry: tuple[int, Any]) -> None:
            loop.call_soon_threadsafe(items.put_nowait, entry)

        self.submit(start, cancel, Sink(put))
        ended = yielded = False
        try:
            while (item := _unpack(await items.get())) is not _DONE:
                yielded = True
                yield item
            ended = True
        finally:
            cancel.set()
            if yielded and not ended:
                try:
                    while (await asyncio.wait_for(items.get(), SETTLE_S))[0] not in (_END, _ERROR):
                        pass
                except asyncio.TimeoutError:
                    _gave_up()


_DONE = object()


#: Seconds a closed stream waits for its request to stop (a step takes well under one;
#: a worker that hangs must not hang the consumer too).
SETTLE_S = 30.0


def _settled(get: Callable[[], tuple[int, Any]]) -> None:
    """Wait for the end of a stream whose consumer stopped while it was decoding: the
    request sees the cancel at its next token and commits what it generated, so once
    ``close()`` returns the agent's cache holds the reply so far (a stream closed during
    its prefill does not wait: that would be the whole prefill)."""
    try:
        while get()[0] not in (_END, _ERROR):
            pass
    except queue.Empty:
        _gave_up()


def _gave_up() -> None:
    logger.warning("a cancelled stream did not end within %s s; not waiting for it", SETTLE_S)


def _unpack(entry: tuple[int, Any]) -> Any:
    """A queued item, ``_DONE`` at the end, or the stream's exception raised here."""
    kind, item = entry
    if kind == _ERROR:
        raise item
    return _DONE if kind == _END else item
