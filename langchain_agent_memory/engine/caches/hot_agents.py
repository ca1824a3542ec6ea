"""The hot tier: agents whose caches are live in memory, most recently used last, under the
lock the model's steps hold (``lock``: it guards this table, the pool's memory tier and the
live layer caches). Threads other than the model's (a shared store's admissions, stats)
read it through the methods here, which take the lock."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection

from .agent_state import AgentState, HotPolicy


class HotAgents:
    """Live agents of one engine (LRU order), kept within ``policy``."""

    def __init__(self, policy: HotPolicy, pinned: Callable[[], Collection[str]]) -> None:
        self.policy = policy
        #: agents never dropped to make room (a save of theirs is not written yet)
        self._pinned = pinned
        self._states: OrderedDict[str, AgentState] = OrderedDict()
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._states

    def __getitem__(self, agent_id: str) -> AgentState:
        return self._states[agent_id]

    def get(self, agent_id: str) -> AgentState | None:
        with self.lock:
            return self._states.get(agent_id)

    def touch(self, agent_id: str) -> AgentState | None:
        """The agent's live state, now the most recently used (None: not hot)."""
        with self.lock:
            state = self._states.get(agent_id)
            if state is not None:
                self._states.move_to_end(agent_id)
            return state

    def version_of(self, agent_id: str) -> int | None:
        """The shared store's version the live copy is (None: none live, or not known)."""
        with self.lock:
            state = self._states.get(agent_id)
            return state.version if state is not None else None

    def keep(self, agent_id: str, state: AgentState) -> None:
        """``state`` is the agent's live cache, the most recent; the least recent past the
        policy's bounds are dropped (their working copies first)."""
        with self.lock:
            self._states[agent_id] = state
            self._states.move_to_end(agent_id)
            self.policy.enforce(self._states, self._pinned())

    def drop(self, agent_id: str | None = None, *, only: AgentState | None = None) -> None:
        """Forget one agent's live cache (``only``: if it is still that one), or all."""
        with self.lock:
            if agent_id is None:
                self._states.clear()
            elif only is None or self._states.get(agent_id) is only:
                self._states.pop(agent_id, None)

    def working_copy_bytes(self) -> int:
        """Bytes of full-precision working copies the live agents keep."""
        with self.lock:
            return sum(c.work_nbytes for state in self._states.values() for c in state.layers or ())
