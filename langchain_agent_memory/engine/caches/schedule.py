"""When each agent runs next, as far as the engine is told: the hot tier's eviction order.

Least-recently-used eviction drops the agent used longest ago, which in a graph is often the
very one whose turn comes next: a supervisor that routed to a worker a moment ago, a worker
whose tool is still running. The engine is told more where someone knows it:

- a graph's checkpointer names the agents of the tasks that run next (``runs_next``) as soon
  as a step's checkpoint is written, those of the step after (``runs_soon``: the nodes seen
  to follow those, a supervisor its workers return to), and those of tasks waiting on a
  human (``waits``: far, evicted first);
- a reply that made tool calls: its agent comes back when the tool returns (``awaits_tool``;
  kept for ``tool_ttl_s``, after which it ranks as any other);
- a request that starts for an agent consumes what was said of it (``started``); what a
  checkpoint older than that request says of it is stale and ignored (LangGraph writes a
  step's checkpoint while the next step already runs).

Agents nothing was said of rank by recency, behind those a human holds up and ahead of those
that run next or wait on a tool: requests without a graph (a server, a plain chain) see plain
LRU. What was said expires (``hint_ttl_s``): a thread abandoned mid-run pins nothing.

The schedule is its engine's loop's (``loop``), like the hot tier it orders: what a graph's or
a chat model's thread says reaches it as a message (``Worker.post``), a question as one the
loop answers (``Worker.call``, at once on the loop itself). No lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Need(IntEnum):
    """How soon an agent is needed, as the engine was told (higher: sooner; the hot tier
    evicts the lowest first, least recently used first within one)."""

    WAITING = 0  # on a human (an interrupt): far
    UNKNOWN = 1  # nothing said: by recency
    SOON = 2  # the step after the next one
    TOOL = 3  # its reply made tool calls: back when they return
    NEXT = 4  # a task of its graph runs next


@dataclass(frozen=True, slots=True)
class _Hint:
    need: Need
    until: float  # monotonic time it expires


class Loop(Protocol):
    """The thread that owns a schedule (an engine's ``Worker``)."""

    def post(self, fn: Callable[..., Any], *args: Any) -> None: ...
    def call(self, fn: Callable[..., T], *args: Any) -> T: ...


class Schedule:
    """What the engine was told of its agents' next turns, kept by ``loop`` (None: by the
    thread that uses it alone, a test's)."""

    def __init__(
        self,
        tool_ttl_s: float = 30.0,
        hint_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        follow: bool = True,
        loop: Loop | None = None,
    ) -> None:
        self.tool_ttl_s, self.hint_ttl_s, self._clock = tool_ttl_s, hint_ttl_s, clock
        #: False: what is said is ignored, eviction is least recently used (``eviction="lru"``)
        self.follow = follow
        self._post: Callable[..., None] = loop.post if loop is not None else _here
        self._call: Callable[..., Any] = loop.call if loop is not None else _here
        # The loop's alone:
        self._hints: dict[str, _Hint] = {}
        #: agent -> when (``time.time()``) its latest request started
        self._started: dict[str, float] = {}

    def runs_next(self, agent_ids: Iterable[str], as_of: float | None = None) -> None:
        """These agents' tasks run next (a graph's pending ``Send``s and nodes), as of the
        time ``as_of`` (``time.time()``; a checkpoint's): an agent whose request started
        since has run already."""
        self._post(self._say_fresh, list(agent_ids), as_of, Need.NEXT, False)

    def runs_soon(self, agent_ids: Iterable[str], as_of: float | None = None) -> None:
        """These agents run in the step after the next one (as far as the graph has shown:
        ``runs_next``'s ``as_of``); what was said of them already is not lowered."""
        self._post(self._say_fresh, list(agent_ids), as_of, Need.SOON, True)

    def waits(self, agent_ids: Iterable[str]) -> None:
        """These agents wait on a human (an interrupt): their turns are far."""
        self._post(self._say, list(agent_ids), Need.WAITING, self.hint_ttl_s)

    def awaits_tool(self, agent_id: str) -> None:
        """The agent's reply made tool calls: it comes back when they return."""
        self._post(self._say, [agent_id], Need.TOOL, self.tool_ttl_s)

    def started(self, agent_id: str) -> None:
        """A request for the agent started: what was said of its next turn is spent."""
        self._call(self._start, agent_id)

    def need(self, agent_id: str) -> Need:
        """How soon the agent is needed, as told (after all that was said before this)."""
        if not self.follow:
            return Need.UNKNOWN
        return self._call(self._need, agent_id)  # type: ignore[no-any-return]

    def eviction_order(self, lru: Sequence[str]) -> list[str]:
        """``lru`` (least recently used first) in the order to evict: least needed first,
        least recently used first among equals."""
        return sorted(lru, key=self.need)  # stable: recency kept within a need

    def told(self) -> dict[str, int]:
        """How many agents each hint stands for now (``Engine.stats``)."""
        return self._call(self._told)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ on the loop

    def _start(self, agent_id: str) -> None:
        self._hints.pop(agent_id, None)
        self._started[agent_id] = time.time()

    def _need(self, agent_id: str) -> Need:
        hint = self._hints.get(agent_id)
        if hint is None:
            return Need.UNKNOWN
        if hint.until < self._clock():
            del self._hints[agent_id]
            return Need.UNKNOWN
        return hint.need

    def _told(self) -> dict[str, int]:
        now = self._clock()
        live = [h.need for h in self._hints.values() if h.until >= now]
        return {need.name.lower(): live.count(need) for need in Need if need is not Need.UNKNOWN}

    def _say_fresh(self, agent_ids: list[str], as_of: float | None, need: Need, raise_only: bool) -> None:
        """``_say`` of those of ``agent_ids`` whose latest request started before ``as_of``."""
        fresh = [a for a in agent_ids if as_of is None or self._started.get(a, float("-inf")) <= as_of]
        self._say(fresh, need, self.hint_ttl_s, raise_only)

    def _say(self, agent_ids: list[str], need: Need, ttl_s: float, raise_only: bool = False) -> None:
        now = self._clock()
        for agent_id in agent_ids:
            held = self._hints.get(agent_id)
            if raise_only and held is not None and held.until >= now and held.need >= need:
                continue
            self._hints[agent_id] = _Hint(need, now + ttl_s)


def _here(fn: Callable[..., T], *args: Any) -> T:
    """A schedule without a loop: its user's thread keeps it."""
    return fn(*args)
