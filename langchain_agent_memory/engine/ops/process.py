"""The process runtime: what lives as long as the process, owned in one place and ended by
one call (``RUNTIME.shutdown``; users call ``langchain_agent_memory.engine.shutdown``) or
by the interpreter's exit.

It owns:

- **The threads.** Every thread the engine starts is lent by ``RUNTIME.lend`` (an engine's
  worker, its saves, the store's I/O, lease heartbeats, database watchdogs, the hash and
  read pools: ``LentPool``), named after what it runs and listed by ``threads``.
- **The stocks**: objects made once on first use and kept for the process (``stock``): the
  hash and read pools, the digest and staging buffers of block reads, the loaded models
  (each a future its maker fills: ``model.loading``), the engine registry. ``shutdown`` ends
  them, the latest made first.
- **The engines open** (``track``): ``shutdown`` closes them first, since they hold threads
  and stocks.

Why lend rather than start a thread per engine, and why never end one while the process
runs on (only ``shutdown`` does):

- mlx gives every thread that evaluates on the CPU a native thread per stream it uses (its
  default stream, the side streams of ``runtime.side_streams``), and MKL an OpenMP team;
  none of them ends with the Python thread (mlx 0.32: not with ``mx.clear_streams``
  either). A process that opened and closed engines by the hundred (a test suite, a server
  swapping models, a notebook) piled up idle native threads: ~48 per model in the model
  matrix, which ran three times slower by its end.
- A thread that is inside MLX when the interpreter finalizes aborts the process
  ("terminate called without an active exception", exit code 134: the interpreter ends a
  daemon thread that wakes then by unwinding its stack, and MLX's C++ frames do not let
  it through); so may one that has run MLX work and *ends* then. A daemon thread that
  waits on a queue does not wake. So these threads are daemons that wait for their next
  loan, and the interpreter's exit first runs the exit hooks (``at_exit``: the saves still
  queued are written), then stops every loan (each says how: ``lend``'s ``stop``; an
  engine's loop leaves a reply it is decoding where it is) and waits for them to be back
  on their queues, so that none is inside MLX, or wakes by a timer, while the interpreter
  finalizes. ``shutdown`` ends the threads themselves while the interpreter is whole.

The one lock (``lock``, re-entrant: a stock's maker may lend threads) guards the runtime's
own tables (threads, loans, stocks, open engines, exit hooks) and the short critical sections
of what lives as long as the process besides: the picks of the buffer stocks
(``cuda_memory``, ``gather``), the compiled kernels' shape tables (``fast_ops``), the open
save queues (``saves``), a session's one probe thread (``pg_session``). A stock's maker runs
under it, so makers are quick (a model's is a future: the load runs after, outside it).
Nothing holds it across I/O or a model's work; no cache state is under it. It is one of the
engine's three locks (``docs/concepts/concurrency.md``).
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Protocol, TypeVar

from .runtime import release_memory

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The name of a runtime thread that waits for its next loan.
IDLE_NAME = "agent-memory-idle"


class Closable(Protocol):
    def close(self) -> None: ...


class Loan:
    """One loan of a runtime thread: ``loop`` runs on it until it returns (then the thread
    is idle again, before ``join`` returns: the next loan finds it). ``stop`` makes the loop
    return soon, whatever it is doing (called once, at the process's exit)."""

    def __init__(self, name: str, loop: Callable[[], None], stop: Callable[[], object]) -> None:
        self.name = name
        self.loop: Callable[[], None] | None = loop
        self.stop = stop
        self.done = threading.Event()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Until the loop has returned; False if it had not within ``timeout`` seconds."""
        return self.done.wait(timeout)


Inbox = queue.SimpleQueue[Loan | None]


class ProcessRuntime:
    """The process's threads, stocks and open engines (the module's docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._threads: dict[threading.Thread, Inbox] = {}
        self._idle: list[threading.Thread] = []
        #: The name of the last loan each thread served (``lend`` prefers one of the same name).
        self._served: dict[threading.Thread, str] = {}
        self._loans: set[Loan] = set()
        self._stocks: dict[str, tuple[Any, Callable[[Any], object]]] = {}
        self._open: weakref.WeakSet[Closable] = weakref.WeakSet()
        self._exit_hooks: list[Callable[[], object]] = []
        #: Threads started since the process began (a plateau, not a count of loans).
        self.started = 0

    # ------------------------------------------------------------------ threads

    def lend(self, loop: Callable[[], None], name: str, stop: Callable[[], object]) -> Loan:
        """Run ``loop`` on an idle thread, or a new one where none is idle, under ``name``.
        ``stop`` makes it return soon: from a wait (a timer's, a queue's) and from the MLX
        work it is doing (at the process's exit: the module's docstring)."""
        loan = Loan(name, loop, stop)
        with self.lock:
            self._loans.add(loan)
            if self._idle:
                # A thread back to the work it did last: the native threads MLX and BLAS gave
                # it are made already (an engine's loop on a thread that only ever saved or
                # uploaded would get a new set, and a long process would pile them up).
                same = [t for t in self._idle if self._served.get(t) == name]
                thread = same[-1] if same else self._idle[-1]
                self._idle.remove(thread)
            else:
                inbox: Inbox = queue.SimpleQueue()
                thread = threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True)
                self._threads[thread] = inbox
                self.started += 1
                thread.start()
            self._threads[thread].put(loan)
        return loan

    def _serve(self, inbox: Inbox) -> None:
        me = threading.current_thread()
        while (loan := inbox.get()) is not None:
            me.name = loan.name
            loop = loan.loop
            loan.loop = None  # held by this frame only: gone once it returns
            try:
                assert loop is not None
                loop()
            except BaseException:  # the loop's own failure; the thread serves the next loan
                logger.exception("thread %s failed", loan.name)
            finally:
                del loop  # not held while idle (it may reach an engine)
                me.name = IDLE_NAME
                with self.lock:
                    self._loans.discard(loan)
                    self._served[me] = loan.name
                    self._idle.append(me)
                loan.done.set()
        with self.lock:
            del self._threads[me]
            self._served.pop(me, None)

    def pool(self, name: str, size: int) -> LentPool:
        """``size`` threads lent to one pool until its ``shutdown``."""
        return LentPool(self, name, size)

    def shared_pool(self, name: str, size: int) -> LentPool:
        """The process's one pool named ``name`` (a stock: made on first use)."""
        return self.stock(name, lambda: self.pool(name, size), LentPool.shutdown)

    def threads(self) -> list[threading.Thread]:
        """The runtime's threads alive, lent or idle."""
        with self.lock:
            return [t for t in self._threads if t.is_alive()]

    @property
    def on_runtime_thread(self) -> bool:
        with self.lock:
            return threading.current_thread() in self._threads

    # ------------------------------------------------------------------ stocks and engines

    def stock(self, name: str, make: Callable[[], T], end: Callable[[T], object]) -> T:
        """The process's one ``name``: made by ``make`` on first use, ended by ``end`` at
        ``shutdown`` (and made again by a later use)."""
        with self.lock:
            held = self._stocks.get(name)
            if held is None:
                held = self._stocks[name] = (make(), end)
            return held[0]  # type: ignore[no-any-return]

    def stocks(self, prefix: str) -> list[Any]:
        """The stocks whose names start with ``prefix``, as made now."""
        with self.lock:
            return [held[0] for name, held in self._stocks.items() if name.startswith(prefix)]

    def drop(self, match: Callable[[str, Any], bool]) -> int:
        """End the stocks ``match(name, stock)`` picks (a later use makes them again); how
        many."""
        with self.lock:
            gone = [name for name, held in self._stocks.items() if match(name, held[0])]
            ended = [self._stocks.pop(name) for name in gone]
        while ended:
            _end(*ended.pop())
        return len(gone)

    def track(self, engine: Closable) -> None:
        """Close ``engine`` at ``shutdown`` if it is still open then (held weakly)."""
        with self.lock:
            self._open.add(engine)

    def at_exit(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` when the interpreter exits (its threads still waiting)."""
        with self.lock:
            self._exit_hooks.append(hook)

    def _exit(self) -> None:
        with self.lock:
            hooks = list(self._exit_hooks)
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("exit hook %r failed", hook)
        self._stop_loans(EXIT_STOP_S)

    def _stop_loans(self, wait_s: float) -> None:
        """Every loan stopped and waited for (``wait_s`` in all): its thread is then back on
        its queue, where the interpreter's finalizing does not reach it."""
        with self.lock:
            loans = list(self._loans)
        for loan in loans:
            try:
                loan.stop()
            except Exception:
                logger.exception("stopping thread %s failed", loan.name)
        deadline = time.monotonic() + wait_s
        late = [loan.name for loan in loans if not loan.join(max(0.0, deadline - time.monotonic()))]
        if late:
            logger.warning(
                "threads still running %g s after the exit stopped them: %s (the process may abort "
                "if one is inside MLX as the interpreter ends)",
                wait_s, ", ".join(late),
            )  # fmt: skip

    # ------------------------------------------------------------------ the end

    def shutdown(self, wait_s: float = 30.0) -> None:
        """End what the process holds: every engine still open is closed (one with requests
        in progress raises, and nothing more is ended), then every stock, the latest made
        first (the loaded models, the registry and its engines, the pools and buffers),
        then every thread; memory goes back to the system. A thread still lent after
        ``wait_s`` (its owner, say a store opened by hand, was never closed) is named in a
        warning and left running. Later use starts afresh."""
        if self.on_runtime_thread:
            raise RuntimeError("shutdown() on one of the runtime's own threads would wait for itself")
        with self.lock:
            engines = list(self._open)
        while engines:
            engines.pop().close()
        with self.lock:
            stocks = list(self._stocks.values())
            self._stocks.clear()
        while stocks:
            _end(*stocks.pop())
        with self.lock:
            loans = list(self._loans)
        for loan in loans:
            if not loan.join(wait_s):
                logger.warning("thread %s is still lent at shutdown (its owner was never closed)", loan.name)
        with self.lock:
            idle, self._idle = self._idle, []
            for thread in idle:
                self._threads[thread].put(None)
        for thread in idle:
            thread.join()
        gc.collect()  # a model's modules hold cycles: free them now, then give the memory back
        release_memory()


def _end(made: T, end: Callable[[T], object]) -> None:
    end(made)


class LentPool(Executor):
    """An executor whose ``size`` threads are lent by the runtime for its lifetime (all at
    once: how many it holds never depends on timing); one thread runs its jobs in
    submission order. The threads go back at ``shutdown`` (after the jobs queued before
    it), or when the pool is freed."""

    def __init__(self, runtime: ProcessRuntime, name: str, size: int) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # The loops hold the queue, not this object: dropped, it is freed and its threads go back.
        # A stop ends one thread once the jobs queued before it have run.
        stop = functools.partial(self._jobs.put, None)
        self._loans = [
            runtime.lend(functools.partial(_run_jobs, self._jobs), name, stop) for _ in range(size)
        ]
        self._stop = weakref.finalize(self, _stop_jobs, self._jobs, size)
        # Not at exit: a thread woken while the interpreter finalizes is ended by it, and an
        # MLX thread that ends then aborts the process (the module's docstring).
        self._stop.atexit = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if not self._stop.alive:
            raise RuntimeError(f"{self.name}: its jobs were stopped")
        future: Future[T] = Future()
        self._jobs.put((future, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return future

    @property
    def backlog(self) -> int:
        """Jobs queued and not started yet (read without waiting)."""
        return self._jobs.qsize()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more jobs; the threads go back once those queued have run (``wait``: until
        then)."""
        self._stop()
        if wait:
            for loan in self._loans:
                loan.join()


Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


def _run_jobs(jobs: queue.SimpleQueue[Job | None]) -> None:
    while (job := jobs.get()) is not None:
        run_job(*job)
        del job  # not held while waiting for the next (its closure may hold an engine)


def _stop_jobs(jobs: queue.SimpleQueue[Job | None], threads: int) -> None:
    for _ in range(threads):
        jobs.put(None)


def run_job(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """``fn(*args)`` into ``future`` (unless it was cancelled)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


#: Seconds the process's exit waits for its loans to stop, after the exit hooks (a step of
#: decode, a save's write, a database call: each ends by its own deadline sooner).
EXIT_STOP_S = 15.0

RUNTIME = ProcessRuntime()
atexit.register(RUNTIME._exit)
