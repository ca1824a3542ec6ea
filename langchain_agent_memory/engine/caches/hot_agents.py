"""The hot tier: agents whose caches are live in memory, most recently used last. It is the
engine loop's (``ops.owner``), read and written there only: no lock; other threads ask the
loop (``Worker.call``) or read what it handed them. Which agent leaves first when the
tier is full is the ``schedule``'s call (by when each runs next; LRU where it knows nothing)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from ..ops.owner import CHECK_OWNER, Owner, check_owner
from .agent_state import AgentState, HotPolicy, live_bytes
from .schedule import Schedule


class HotAgents:
    """Live agents of one engine (LRU order), kept within ``policy``, evicted in the
    ``schedule``'s order."""

    def __init__(
        self,
        policy: HotPolicy,
        pinned: Callable[[], Collection[str]],
        schedule: Schedule | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.policy = policy
        self.schedule = schedule or Schedule()
        #: agents dropped to make room (``Engine.stats``)
        self.evictions = 0
        #: agents never dropped to make room (a save of theirs is not written yet)
        self._pinned = pinned
        self._states: OrderedDict[str, AgentState] = OrderedDict()
        #: the loop that alone reads and writes this table (``ops.owner``)
        self.owner = owner

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._states

    def __getitem__(self, agent_id: str) -> AgentState:
        return self._states[agent_id]

    def ids(self, prefix: str = "") -> list[str]:
        """The live agents whose ids start with ``prefix``, least recently used first."""
        return [a for a in self._states if a.startswith(prefix)]

    def get(self, agent_id: str) -> AgentState | None:
        return self._states.get(agent_id)

    def touch(self, agent_id: str) -> AgentState | None:
        """The agent's live state, now the most recently used (None: not hot)."""
        if CHECK_OWNER:
            check_owner(self.owner, "HotAgents.touch")
        state = self._states.get(agent_id)
        if state is not None:
            self._states.move_to_end(agent_id)
        return state

    def keep(self, agent_id: str, state: AgentState, *, unless_needed_sooner: bool = False) -> bool:
        """``state`` is the agent's live cache, the most recent; past the policy's bounds the
        least needed others are dropped (``schedule``; their working copies first). This one
        goes last: its caller may yet say when it is needed (a reply that made tool calls).
        ``unless_needed_sooner`` (a prefetch): kept only if no agent it would push out is
        needed sooner than it; returns whether it was kept."""
        if CHECK_OWNER:
            check_owner(self.owner, "HotAgents.keep")
        others = self.schedule.eviction_order([a for a in self._states if a != agent_id])
        if unless_needed_sooner:
            need = self.schedule.need(agent_id)
            trial = {**self._states, agent_id: state}
            pushed = self.policy.over(trial, self._pinned(), others)
            if any(self.schedule.need(a) > need for a in pushed) or len(trial) - len(pushed) > (
                self.policy.max_agents
            ):
                return False
        self._states[agent_id] = state
        self._states.move_to_end(agent_id)
        dropped = self.policy.enforce(self._states, self._pinned(), [*others, agent_id])
        self.evictions += len(dropped)
        return True

    def drop(self, agent_id: str | None = None, *, only: AgentState | None = None) -> None:
        """Forget one agent's live cache (``only``: if it is still that one), or all."""
        if CHECK_OWNER:
            check_owner(self.owner, "HotAgents.drop")
        if agent_id is None:
            self._states.clear()
        elif only is None or self._states.get(agent_id) is only:
            self._states.pop(agent_id, None)

    def states(self) -> list[AgentState]:
        return list(self._states.values())

    def live_bytes(self) -> int:
        """Bytes the live agents' caches hold (stored form and working copies)."""
        return sum(live_bytes(state) for state in self._states.values())

    def working_copy_bytes(self) -> int:
        """Bytes of full-precision working copies the live agents keep."""
        return sum(c.work_nbytes for state in self._states.values() for c in state.layers or ())
