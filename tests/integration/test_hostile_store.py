"""Workers under a hostile network and careless operators (issue 41), against real
PostgreSQL and SeaweedFS servers the tests start and freeze (SIGSTOP: a hung host or a
silent partition, which enforces no server-side timeout) rather than stop."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from services import PostgresServer, SeaweedServer
from workers import SYSTEM, WORKER, Proc, solo, store_is_whole

#: How long a test waits for a reply before it calls the worker hung. Far beyond the
#: store's deadline (5 s): a reply within it came while the store was still frozen.
HUNG_S = 90.0


def _call(worker: Proc, op: str, **args: Any) -> dict[str, Any]:
    """``worker(op, ...)``, failing (not hanging) if no reply comes within ``HUNG_S``."""
    out: queue.Queue[Any] = queue.Queue()

    def ask() -> None:
        try:
            out.put(worker(op, **args))
        except BaseException as exc:  # handed to the test's thread
            out.put(exc)

    threading.Thread(target=ask, daemon=True).start()
    try:
        reply = out.get(timeout=HUNG_S)
    except queue.Empty:
        raise AssertionError(f"{op}: no reply in {HUNG_S} s while the store was frozen (hung)") from None
    if isinstance(reply, BaseException):
        raise reply
    return reply


def test_a_frozen_postgres_does_not_stall_the_worker(tmp_path: Path, figures: dict[str, str]) -> None:
    """SIGSTOP the database mid-run: turns of an agent the worker holds, of a new agent and
    of an agent it must fetch all reply while it stays frozen (the store's calls give up at
    their deadline, then the circuit breaker serves from the local tier), with the text the
    worker alone gets; once thawed, the saves made meanwhile reach the store."""
    pg, s3 = PostgresServer(), SeaweedServer()  # servers of its own: this test freezes one
    made: list[Proc] = []
    try:
        store = (pg.new_database("frozen"), s3.new_bucket("frozen"))
        a = Proc(WORKER, str(tmp_path / "a"), *store, "16")
        made.append(a)
        turn1 = {g: SYSTEM + f"User: tell me about {g}.\nAssistant:" for g in ("owls", "bees", "cats")}
        first = {g: a.generate(g, turn1[g]) for g in ("owls", "bees")}
        turn2 = {g: turn1[g] + first[g]["text"] + "\nUser: go on.\nAssistant:" for g in first}
        pg.freeze()
        t0 = time.monotonic()
        second = {g: _call(a, "generate", agent=g, prompt=turn2[g], max_tokens=8) for g in turn2}
        new = _call(a, "generate", agent="cats", prompt=turn1["cats"], max_tokens=8)
        latencies = [r["ttft_s"] for r in (*second.values(), new)]
        frozen_for = time.monotonic() - t0
        stats = _call(a, "stats")
        pg.thaw()
        assert all(r["saved"] for r in (*second.values(), new))
        for g in turn2:  # the turns that ran while frozen: the worker's text alone
            assert [first[g]["text"], second[g]["text"]] == solo(tmp_path / g, [turn1[g], turn2[g]])
        assert stats["pending_saves"] >= 1
        deadline = time.monotonic() + 60
        while a("flush")["pending"]:
            assert time.monotonic() < deadline, "pending saves were not uploaded after the thaw"
            time.sleep(1)
        store_is_whole(store, a("stats")["fingerprint"])
        figures["frozen postgres"] = (
            f"3 turns while SIGSTOPped ({frozen_for:.1f} s): time to first token "
            + ", ".join(f"{t:.2f}" for t in latencies)
            + " s (store deadline 5 s); hangs 0"
        )
    finally:
        for w in made:
            w.kill()
        pg.close()
        s3.close()
