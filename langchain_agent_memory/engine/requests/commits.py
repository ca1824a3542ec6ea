"""Who hears an engine's requests and commits: ``Engine.subscribe`` hands out a
``Subscription``; a checkpointer rewinds a resumed thread's agents before a request and
keeps each agent's history from its commits. Who is subscribed is the engine's loop's to
change (a message: ``Worker.call``); the other threads read the tuple it last made."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..ops.process import RUNTIME
from ..results import GenerationParams
from ..storage.blocks import AgentRecord

logger = logging.getLogger(__name__)

OnCommit = Callable[[AgentRecord], None]
BeforeRequest = Callable[[str, GenerationParams], None]
T = TypeVar("T")


class Loop(Protocol):
    """The thread that changes the subscriptions (an engine's ``Worker``)."""

    def call(self, fn: Callable[..., T], *args: Any) -> T: ...


class Subscription:
    """A subscriber's calls from one engine until ``close()`` (or the ``with`` block ends)."""

    def __init__(
        self, feed: CommitFeed, on_commit: OnCommit | None, before_request: BeforeRequest | None
    ) -> None:
        self._feed, self.on_commit, self.before_request = feed, on_commit, before_request

    def close(self) -> None:
        self._feed.drop(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CommitFeed:
    """Calls subscribers: ``before_request`` on the caller's thread before a request is
    queued; ``on_commit`` with each new agent record, in commit order, on a thread of its own
    (a checkpointer's fsync'ing writes never hold up the model's thread or the saves)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: the subscriptions, replaced (never changed) by the loop
        self._subs: tuple[Subscription, ...] = ()
        self._notify = RUNTIME.pool("agent-memory-commits", 1)

    def subscribe(
        self, on_commit: OnCommit | None = None, before_request: BeforeRequest | None = None
    ) -> Subscription:
        sub = Subscription(self, on_commit, before_request)
        self._loop.call(self._add, sub)
        return sub

    def _add(self, sub: Subscription) -> None:
        self._subs = (*self._subs, sub)

    def drop(self, sub: Subscription) -> None:
        self._loop.call(self._drop, sub)

    def _drop(self, sub: Subscription) -> None:
        self._subs = tuple(s for s in self._subs if s is not sub)

    def before_request(self, agent_id: str, params: GenerationParams) -> None:
        for sub in self._subs:
            if sub.before_request is not None:
                sub.before_request(agent_id, params)

    def committed(self, record: AgentRecord) -> None:
        """A save stored ``record`` (on the save thread)."""
        listeners = [s.on_commit for s in self._subs if s.on_commit is not None]
        for listener in listeners:
            self._notify.submit(_deliver, listener, record)

    def settle(self) -> None:
        """Wait until every commit so far has been delivered."""
        self._notify.submit(lambda: None).result()

    def close(self) -> None:
        self._notify.shutdown(wait=True)  # the listeners see every commit before the index closes


def _deliver(listener: OnCommit, record: AgentRecord) -> None:
    try:
        listener(record)
    except Exception:  # a listener's failure is its own; the commit stands
        logger.exception("commit listener %r failed on agent %r", listener, record.agent_id)
