"""Work in order per key, different keys at once: one agent's record work (its read and
mirror, its save's upload and commit, its pending upload, its delete) runs one job after
another, while another agent's runs beside it and never waits for it.

One thread, the dispatcher, alone holds each key's queue of jobs: callers and ending jobs
send it messages (a ``SimpleQueue``), it starts a key's next job on the pool when the one
before has ended. A job runs on the pool, never on its caller's thread: no key is "held" by
anyone, so there is nothing to lock.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .process import RUNTIME, Job, run_job

T = TypeVar("T")

#: Seconds between two looks, while waiting for a job, at whether the dispatcher returned.
_LOOK_S = 1.0

#: A message to the dispatcher: (key, a job to queue), or (key, None): its running job ended.
_Message = tuple[str, Job | None]


class Lanes:
    """Jobs keyed by agent: in submission order per key, on ``size`` threads lent by the
    runtime (a key's job waits for a thread only while ``size`` other keys' jobs run)."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self._pool = RUNTIME.pool(name, size)
        self._inbox: queue.SimpleQueue[_Message | None] = queue.SimpleQueue()
        stop = functools.partial(self._inbox.put, None)
        #: the dispatcher has returned (closed, or the process exits): jobs run on their callers
        self._gone = threading.Event()
        loop = functools.partial(_dispatch, self._inbox, self._pool, self._gone)
        self._loan = RUNTIME.lend(loop, f"{name}-order", stop)
        self._closed = False

    def submit(self, key: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` after every job of ``key`` submitted before it."""
        if self._closed:
            raise RuntimeError(f"{self.name}: closed")
        future: Future[T] = Future()
        self._inbox.put((key, (future, fn, args)))
        return future

    def call(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        """``submit``, waited for. Never from a job of the same key: it would wait for itself.
        Once the dispatcher has returned, on the calling thread (in order no more)."""
        if self._gone.is_set():
            return fn(*args)
        future = self.submit(key, fn, *args)
        while True:
            try:
                return future.result(timeout=_LOOK_S)
            except TimeoutError:
                if self._gone.is_set() and future.cancel():  # never started: nothing will start it
                    return fn(*args)

    def close(self) -> None:
        """Run the jobs submitted so far, then give the threads back."""
        self._closed = True
        self._inbox.put(None)
        self._loan.join()
        self._pool.shutdown(wait=True)


def _dispatch(inbox: queue.SimpleQueue[_Message | None], pool: Any, gone: threading.Event) -> None:
    """The dispatcher's loop: each key's jobs, the running one first (its own: no lock).
    Stopped (``None``), it still runs the jobs queued, then returns."""
    try:
        _order(inbox, pool)
    finally:
        gone.set()


def _order(inbox: queue.SimpleQueue[_Message | None], pool: Any) -> None:
    waiting: dict[str, deque[Job]] = {}
    stopped = False
    while not (stopped and not waiting):
        message = inbox.get()
        if message is None:
            stopped = True
            continue
        key, job = message
        if job is not None:
            jobs = waiting.setdefault(key, deque())
            jobs.append(job)
            if len(jobs) == 1:
                pool.submit(_run_then_say, inbox, key, job)
            continue
        jobs = waiting[key]
        jobs.popleft()
        if jobs:
            pool.submit(_run_then_say, inbox, key, jobs[0])
        else:
            del waiting[key]


def _run_then_say(inbox: queue.SimpleQueue[_Message | None], key: str, job: Job) -> None:
    try:
        run_job(*job)
    finally:
        inbox.put((key, None))
