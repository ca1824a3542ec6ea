"""Which nodes a graph runs after which, learned from its checkpoints: the step after next.

A checkpoint names the nodes its thread runs next (``linker.next_nodes``), and only those.
Written while that step already runs, it tells the hot tier little it could still act on;
what lets it keep an agent is knowing a step further: a supervisor whose worker is running
comes back when the worker is done. ``StepOrder`` notes, over every thread of the saver,
which nodes followed which, and answers with the nodes seen to follow the next ones.
"""

from __future__ import annotations

import threading
from collections.abc import Set


class StepOrder:
    """Successions of nodes seen in checkpoints (thread-safe; a few names per node)."""

    def __init__(self) -> None:
        self._after: dict[str, set[str]] = {}  # node -> nodes seen in the step after it
        self._last: dict[str, frozenset[str]] = {}  # thread -> the nodes its last checkpoint named
        self._lock = threading.Lock()

    def saw(self, thread: str, nodes: Set[str]) -> set[str]:
        """``thread``'s next step runs ``nodes``: note that they followed its previous step's,
        and return the nodes seen to follow these (the step after next), less these."""
        with self._lock:
            for before in self._last.get(thread, ()):
                self._after.setdefault(before, set()).update(nodes)
            self._last[thread] = frozenset(nodes)
            soon: set[str] = set()
            for node in nodes:
                soon |= self._after.get(node, set())
            return soon - set(nodes)

    def forget(self, thread: str) -> None:
        """The thread ended or was deleted: its last step follows nothing."""
        with self._lock:
            self._last.pop(thread, None)
