"""The process's long-lived threads: lent to whatever runs MLX work, taken back, never ended.

Why lend rather than start a thread per engine, and why never end one:

- mlx gives every thread that evaluates on the CPU a native thread per stream it uses (its
  default stream, the side streams of ``runtime.side_streams``), and MKL an OpenMP team;
  none of them ends with the Python thread (mlx 0.32: not with ``mx.clear_streams``
  either). A process that opened and closed engines by the hundred (a test suite, a server
  swapping models, a notebook) piled up idle native threads: ~48 per model in the model
  matrix, which ran three times slower by its end.
- A thread that has run MLX work and *ends* during interpreter shutdown makes mlx abort
  ("terminate called without an active exception", exit code 134); a daemon thread that is
  still waiting when the process ends does not. So these threads are daemons that wait for
  their next loan: the save thread of a script that ends without ``close()`` runs its
  last saves at exit (``saves``) and then just waits.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class MlxThreads:
    """Daemon threads, each lent to one loop at a time (an engine's worker, its saves)."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()
        self.started = 0

    def lend(self, loop: Callable[[], None], name: str) -> None:
        """Run ``loop`` on an idle thread, or a new one where none is idle; the thread is
        idle again when ``loop`` returns."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self.started += 1
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put(functools.partial(_named, name, loop))

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            with self._lock:
                self._idle.append(inbox)


def _named(name: str, loop: Callable[[], None]) -> None:
    threading.current_thread().name = name
    loop()


THREADS = MlxThreads()


def run_job(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """``fn(*args)`` into ``future`` (unless it was cancelled)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


class SerialThread:
    """Jobs run one after another in submission order on a thread lent by ``THREADS``; the
    thread goes back at ``stop`` (after the jobs queued before it) or when this is freed."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # The loop holds the queue, not this object: dropped, it is freed and its thread goes back.
        THREADS.lend(functools.partial(_run_jobs, self._jobs), name)
        self._stop = weakref.finalize(self, self._jobs.put, None)
        # Not at exit: a thread woken while the interpreter finalizes is ended by it, and an
        # MLX thread that ends then aborts the process (the module's docstring).
        self._stop.atexit = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if not self._stop.alive:
            raise RuntimeError("this thread's jobs were stopped")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """No more jobs; the thread goes back once those queued have run."""
        self._stop()


def _run_jobs(jobs: queue.SimpleQueue[Job | None]) -> None:
    while (job := jobs.get()) is not None:
        run_job(*job)
        del job  # not held while waiting for the next (its closure may hold an engine)
