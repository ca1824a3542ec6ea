"""What a block store says about itself without waiting on anything (``Engine.status``):
the readiness probe and the agents' list read it on a server's event loop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """One engine's store, as of now."""

    #: a store shared by workers (PostgreSQL + objects); False: this host's directory alone
    shared: bool
    #: whether the shared store answered its last call (False: the circuit is open, and this
    #: worker serves from its own copies); a local store is always reachable
    reachable: bool = True
    #: saves kept on this worker that the shared store has not taken yet, and their bytes
    pending_saves: int = 0
    pending_bytes: int = 0
    #: saves (and forks, deletes) the engine has queued and not written yet
    queued_saves: int = 0
