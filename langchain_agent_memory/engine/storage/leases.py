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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter

from ..errors import CommitConflictError
from ..ops.process import RUNTIME, Loan
from .catalog import Catalog
from .objects import RemoteUnavailableError

logger = logging.getLogger(__name__)

#: Seconds between two looks at a lease another worker holds (a catalog round trip each).
POLL_S = 0.05


class Leases:
    """The leases this worker's requests hold in one catalog, for one model (fingerprint)."""

    def __init__(
        self, catalog: Catalog, fingerprint: str, holder: str, lease_s: float, handoff_wait_s: float
    ) -> None:
        self.catalog, self.fingerprint, self.holder = catalog, fingerprint, holder
        self.lease_s, self.handoff_wait_s = lease_s, handoff_wait_s
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._heart: Loan | None = None
        self._closed = threading.Event()
        #: Hand-offs that waited for another worker's lease, and how long in all.
        self.waits = 0
        self.waited_s = 0.0

    def take(self, agent_id: str) -> int | None:
        """A request of this worker on ``agent_id`` starts: count it, then take the lease,
        waiting up to ``handoff_wait_s`` while another worker holds it (its save in flight,
        or its request running). Returns the version of the agent's record (None: none).
        ``RemoteUnavailableError`` leaves the request counted: end it with ``done``."""
        with self._lock:
            # Counted before the row is taken: a save of this worker that commits meanwhile
            # then keeps the row for this request (``others``).
            self._held[agent_id] += 1
            if not self._closed.is_set() and (self._heart is None or not self._heart.is_alive()):
                self._heart = RUNTIME.lend(self._beat, "agent-memory-leases", self._closed.set)
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
        with self._lock:
            if self._held[agent_id] > 1:
                self._held[agent_id] -= 1
                return False
            self._held.pop(agent_id, None)
            return True

    def others(self, agent_id: str, own: int) -> bool:
        """Whether requests of this worker besides ``own`` of them hold ``agent_id`` (a
        commit then keeps the row)."""
        with self._lock:
            return self._held[agent_id] > own

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

    def _beat(self) -> None:
        """Renew the rows of the requests in flight (off the model's thread)."""
        while not self._closed.wait(self.lease_s / 3):
            with self._lock:
                agents = [a for a, n in self._held.items() if n > 0]
                if not agents:  # none held: the thread ends (``take`` starts another)
                    self._heart = None
                    return
            for agent_id in agents:
                if self._closed.is_set():
                    return
                self._renew(agent_id)

    def close(self) -> None:
        """Stop the heartbeat and wait for it (a renewal in flight ends by its deadline)."""
        self._closed.set()
        with self._lock:
            heart = self._heart
        if heart is not None:
            heart.join()
