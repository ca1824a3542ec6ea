"""The owner check: an engine's cache state (the hot tier, the pool's memory tier, live layer
caches, the saves not written yet, the decoded prefixes a fan-out shares) belongs to its loop
thread (``requests.worker``), which alone reads and writes it; other threads send the loop
messages (``Worker.submit``) and get immutable results back. No lock guards that state, so a
mutation from another thread is a race: with the check on (the test suite sets
``AGENT_MEMORY_OWNER_CHECK=raise`` before the package is imported), each mutator asks
``check_owner`` first and a stray thread raises ``OwnerError`` where it mutates. Off (the
default, production), a mutator pays one test of the module's ``CHECK_OWNER``.

``AGENT_MEMORY_OWNER_CHECK=record`` writes each stray mutation (thread, mutator, caller) to
standard error instead of raising: the map of who still mutates from where.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

#: The environment variable that turns the check on ("raise", "record"; unset: off).
OWNER_CHECK_ENV = "AGENT_MEMORY_OWNER_CHECK"

_MODE = os.environ.get(OWNER_CHECK_ENV, "")

#: Whether mutators check their thread (read once, at import: a constant for the hot path).
CHECK_OWNER = _MODE in ("raise", "record")


class OwnerError(AssertionError):
    """Cache state was mutated off its loop thread (a race the check caught)."""


class Owner:
    """The thread that owns one engine's cache state: the loop's, from ``bind`` (its first
    job) to ``release`` (its end). Unbound, nothing is checked (an engine being built or
    closed, a pool a command-line tool opened alone)."""

    __slots__ = ("thread_id",)

    def __init__(self) -> None:
        self.thread_id: int | None = None

    def bind(self) -> None:
        self.thread_id = threading.get_ident()

    def release(self) -> None:
        self.thread_id = None

    @property
    def on_loop(self) -> bool:
        return self.thread_id is None or threading.get_ident() == self.thread_id


def check_owner(owner: Owner | None, what: str) -> None:
    """Raise ``OwnerError`` (or, recording, log) unless the calling thread owns ``owner``'s
    state; callers test ``CHECK_OWNER`` first, so that production pays nothing more."""
    if owner is None or owner.on_loop:
        return
    thread = threading.current_thread().name
    if _MODE == "record":
        caller = "".join(traceback.format_stack(limit=6)[:-1])
        sys.stderr.write(f"OWNER-CHECK {what} on thread {thread!r}\n{caller}\n")
        return
    raise OwnerError(f"{what} ran on thread {thread!r}, not on the engine's loop, which owns cache state")
