"""Which nodes a graph runs after which, learned from its checkpoints: the step after next.

A checkpoint names the nodes its thread runs next (``linker.next_nodes``), and only those.
Written while that step already runs, it tells the hot tier little it could still act on;
what lets it keep an agent, or load it before its turn, is knowing a step further: a
supervisor whose worker is running comes back when the worker is done.

``StepOrder`` notes, over every thread of the saver (node names are the graph's), which
nodes followed which, and predicts the step after next from the last two steps: after
``w3 -> sup`` came ``w4`` last time, so while the supervisor runs after ``w3``, ``w4`` is
soon. Where that pair was never seen, the nodes seen after the next step alone are taken,
unless there are more than ``fan_limit`` of them: a supervisor seen to route to eleven
workers predicts none of them (loading all eleven would evict the ones that are needed).
"""

from __future__ import annotations

import threading
from collections.abc import Set

Step = frozenset[str]


class StepOrder:
    """Successions of nodes seen in checkpoints (thread-safe; a few names per node)."""

    def __init__(self, fan_limit: int = 2) -> None:
        self.fan_limit = fan_limit
        self._after: dict[str, set[str]] = {}  # node -> nodes seen in the step after it
        self._after_pair: dict[tuple[Step, Step], Step] = {}  # (step, next step) -> the one after, last seen
        self._last: dict[str, tuple[Step, Step]] = {}  # thread -> its last two steps (oldest first)
        self._lock = threading.Lock()

    def saw(self, thread: str, nodes: Set[str]) -> set[str]:
        """``thread``'s next step runs ``nodes``: note that they followed its previous steps,
        and return the nodes predicted for the step after (less these)."""
        step: Step = frozenset(nodes)
        with self._lock:
            # An empty step is a run that ended (nothing pending): the thread's next run
            # follows it as a step of its own, so the first node of every run is predicted
            # too (after ``review -> end -> sup`` came ``w1``). A thread never seen has none.
            last = self._last.get(thread)
            before, previous = last if last is not None else (None, None)
            for node in previous or ():
                self._after.setdefault(node, set()).update(step)
            if before is not None and previous is not None:
                self._after_pair[(before, previous)] = step
            self._last[thread] = (previous if previous is not None else frozenset(), step)
            soon = self._after_pair.get((previous, step)) if previous is not None else None
            if soon is None:
                seen: set[str] = set()
                for node in step:
                    seen |= self._after.get(node, set())
                soon = frozenset(seen) if len(seen - step) <= self.fan_limit else frozenset()
            return set(soon - step)

    def forget(self, thread: str) -> None:
        """The thread ended or was deleted: its last step follows nothing."""
        with self._lock:
            self._last.pop(thread, None)
