"""This worker's leases on agents in a shared store: which worker runs an agent now.

A lease is a row of the catalog (``am_leases``: agent, holder, expiry) that a request takes
when it starts (``take``) and that ends with the request: given back when it ends without
a commit (``done`` then ``give_back``), deleted by the commit of its save otherwise. While
any request of this worker holds an agent, a heartbeat renews the row every ``lease_s / 3``;
a dead worker's row expires within ``lease_s``.

Two rules make a hand-off between workers warm and keep a lease alive as long as a request
of this worker runs:

- **Wait for a save in flight.** A worker answers a turn and its save commits a second or
  so later (the save thread); a load balancer may send the next turn to another worker
  within milliseconds. That worker's ``take`` finds the lease held (the save holds it until
  its commit) and waits, up to ``handoff_wait_s``, for it to be given back; it then reads
  the committed record and resumes warm instead of prefilling everything.
- **One row, counted requests.** The row names the worker, and this worker counts its
  requests on the agent. A save's commit deletes the row only when no other request of
  this worker holds the agent (turn 2 running while turn 1's save commits keeps it); a
  request that ends without a commit gives the row back only when it was the last. A
  request that starts between that decision and the delete takes the row again at once
  (``renew_if_held``).

The counts are the heartbeat's, one thread that does no I/O itself (its renewals run on the
store's I/O threads): a request's start, its end and a commit's question are messages it
answers at once. No lock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from ..errors import CommitConflictError
from ..ops.process import RUNTIME
from .catalog import Catalog
from .objects import RemoteUnavailableError

logger = logging.getLogger(__name__)

#: Seconds between two looks at a lease another worker holds (a catalog round trip each).
POLL_S = 0.05


#: Seconds between two looks, while waiting for the heartbeat's answer, at whether it stopped.
_LOOK_S = 1.0

#: A message to the heartbeat: (what to run on its counts, its arguments, the answer's future).
_Message = tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]


class Leases:
    """The leases this worker's requests hold in one catalog, for one model (fingerprint);
    renewals and give-backs run on ``io`` (the store's I/O threads)."""

    def __init__(
        self,
        catalog: Catalog,
        fingerprint: str,
        holder: str,
        lease_s: float,
        handoff_wait_s: float,
        io: Executor,
    ) -> None:
        self.catalog, self.fingerprint, self.holder = catalog, fingerprint, holder
        self.lease_s, self.handoff_wait_s = lease_s, handoff_wait_s
        self._io = io
        self._held: Counter[str] = Counter()  # the heartbeat's alone
        self._inbox: queue.SimpleQueue[_Message | None] = queue.SimpleQueue()
        self._gone = threading.Event()  # the heartbeat has stopped
        self._heart = RUNTIME.lend(self._beat, "agent-memory-leases", self._stop)
        #: Hand-offs that waited for another worker's lease, and how long in all.
        self.waits = 0
        self.waited_s = 0.0

    def _ask(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run by the heartbeat on its counts, waited for (it answers at once:
        it never waits on the network). Once it has stopped (closed, or the process exits),
        nothing renews any more and the counts are their callers'."""
        if self._gone.is_set():
            return fn(*args)
        answer: Future[Any] = Future()
        self._inbox.put((fn, args, answer))
        while True:
            try:
                return answer.result(timeout=_LOOK_S)
            except TimeoutError:
                # Stopped before it took this one (``cancel``: only a message it never ran).
                if self._gone.is_set() and answer.cancel():
                    return fn(*args)

    def take(self, agent_id: str) -> int | None:
        """A request of this worker on ``agent_id`` starts: count it, then take the lease,
        waiting up to ``handoff_wait_s`` while another worker holds it (its save in flight,
        or its request running). Returns the version of the agent's record (None: none).
        ``RemoteUnavailableError`` leaves the request counted: end it with ``done``."""
        # Counted before the row is taken: a save of this worker that commits meanwhile then
        # keeps the row for this request (``others``).
        self._ask(self._count, agent_id)
        started = time.monotonic()
        while True:
            taken, version = self.catalog.begin(self.fingerprint, agent_id, self.holder, self.lease_s)
            waited = time.monotonic() - started
            if taken or waited >= self.handoff_wait_s:
                break
            time.sleep(POLL_S)
        if waited >= POLL_S:
            self.waits += 1
            self.waited_s += waited
        if not taken:
            logger.warning(
                "agent %r: another worker has held it for %.1f s (a request running there, or its "
                "save in flight); this request goes on from what is stored now (handoff_wait_s=%g)",
                agent_id, waited, self.handoff_wait_s,
            )  # fmt: skip
        elif waited >= POLL_S:
            logger.info("agent %r: waited %.2f s for another worker's save to commit", agent_id, waited)
        return version

    def done(self, agent_id: str) -> bool:
        """A request of this worker on ``agent_id`` ended; whether it was the last one (the
        row may then go)."""
        return self._ask(self._uncount, agent_id)  # type: ignore[no-any-return]

    def others(self, agent_id: str, own: int) -> bool:
        """Whether requests of this worker besides ``own`` of them hold ``agent_id`` (a
        commit then keeps the row)."""
        return self._ask(self._more_than, agent_id, own)  # type: ignore[no-any-return]

    def give_back(self, agent_id: str) -> None:
        """Delete the row of a request that ended without a commit (the last of this worker's
        on the agent); one that started meanwhile takes it again."""
        with contextlib.suppress(RemoteUnavailableError):
            self.catalog.end(self.fingerprint, agent_id, self.holder)
        self.renew_if_held(agent_id)

    def renew_if_held(self, agent_id: str, own: int = 0) -> None:
        """Take the row again if requests of this worker besides ``own`` of them hold the
        agent (its row was just deleted by a commit or a give-back decided before such a
        request started)."""
        if self.others(agent_id, own):
            self._renew(agent_id)

    def _renew(self, agent_id: str) -> None:
        with contextlib.suppress(RemoteUnavailableError, CommitConflictError):
            self.catalog.begin(self.fingerprint, agent_id, self.holder, self.lease_s)

    # ------------------------------------------------------------------ the heartbeat's

    def _count(self, agent_id: str) -> None:
        self._held[agent_id] += 1

    def _uncount(self, agent_id: str) -> bool:
        if self._held[agent_id] > 1:
            self._held[agent_id] -= 1
            return False
        self._held.pop(agent_id, None)
        return True

    def _more_than(self, agent_id: str, own: int) -> bool:
        return self._held[agent_id] > own

    def _beat(self) -> None:
        """Answer the messages; every ``lease_s / 3`` renew the rows of the requests in
        flight (on the I/O threads: a hung database holds up no answer here)."""
        due = time.monotonic() + self.lease_s / 3
        try:
            while True:
                try:
                    message = self._inbox.get(timeout=max(0.0, due - time.monotonic()))
                except queue.Empty:
                    due = time.monotonic() + self.lease_s / 3
                    for agent_id in [a for a, n in self._held.items() if n > 0]:
                        with contextlib.suppress(RuntimeError):  # the store is closing
                            self._io.submit(self._renew, agent_id)
                    continue
                if message is None:
                    return
                fn, args, answer = message
                if not answer.set_running_or_notify_cancel():  # its asker gave up on this thread
                    continue
                try:
                    answer.set_result(fn(*args))
                except BaseException as exc:
                    answer.set_exception(exc)
        finally:
            self._gone.set()  # later questions are answered by their askers

    def _stop(self) -> None:
        self._inbox.put(None)

    def close(self) -> None:
        """Stop the heartbeat and wait for it (a renewal in flight ends by its deadline)."""
        self._stop()
        self._heart.join()
