"""One of two processes sharing a cache directory (``test_two_processes.py``).

``app``: an application's engine running agent turns: new agents whose prompts share a
system prompt (their first blocks are found on disk, shared by content) and earlier agents
reloaded from disk. ``cleanup``: a maintenance process that meanwhile deletes every cache
it finds and now and then runs an agent of its own on the same system prompt, so the two
write, reuse and free the same blocks at the same time.
Both print a JSON summary at the end.

    python concurrent_child.py (app|cleanup) CACHE_DIR SECONDS [STORE_URL BLOCKS_URL]

With a shared store (``test_shared_store.py``) each process has its own cache directory,
the cleanup also collects garbage (grace 2 s: blocks are deleted soon after nothing names
them), and the invariant is checked in PostgreSQL: no record names a block the store lacks.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams

SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:1400]
PARAMS = GenerationParams(max_tokens=2)


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(
    role: str, cache_dir: str, seconds: float, store: str | None = None, blocks: str | None = None
) -> None:
    warnings = _Count()
    logging.getLogger("langchain_agent_memory").addHandler(warnings)
    # Almost nothing kept in memory: blocks are read from, checked on and written to disk,
    # where the other process is deleting them.
    engine = Engine(
        "smollm2-135m", cache_dir=cache_dir, hot_budget_bytes=1, hot_agents=1, store=store, blocks=blocks
    )
    rng = random.Random(role)
    ops: dict[str, int] = {}
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        turn += 1
        if role == "app":
            if turn % 3:  # a new agent: its first blocks are found on disk (shared by content)
                agent, prompt = f"app:{turn}", SYSTEM
            else:  # an earlier agent, reloaded from disk (as after a restart)
                agent = f"app:{turn - rng.randint(1, 2)}"
                engine.admin.drop_hot(agent)
                prompt = engine.admin.cached_text(agent) or SYSTEM
            result = engine.generate(agent, prompt + f"\nQ{turn}: clause {rng.randrange(1, 9)}?\nA:", PARAMS)
            key = f"app turns ({result.outcome})"
            ops[key] = ops.get(key, 0) + 1
        else:  # delete every cache it finds, keep one of its own alive now and then
            for record in engine.admin.agent_records():
                ops["cleanup deletes"] = ops.get("cleanup deletes", 0) + int(
                    engine.admin.delete(record.agent_id)
                )
            if store:
                collected = engine.admin.store.upkeep.collect_garbage(grace_s=2).blocks_collected
                ops["cleanup blocks collected"] = ops.get("cleanup blocks collected", 0) + collected
            if turn % 5 == 0:
                engine.generate("cleanup:probe", SYSTEM + f"\nQ: section {turn}?\nA:", PARAMS)
                ops["cleanup turns"] = ops.get("cleanup turns", 0) + 1
        if store:  # the invariant, in one snapshot of the system of record
            dangling = engine.admin.store.catalog.dangling(engine.fingerprint)
            if dangling:
                key = "records naming a missing block"
                ops[key] = ops.get(key, 0) + dangling
            continue
        with engine.admin.store.locked():  # the invariant, seen from either process at any time
            for record in engine.admin.agent_records():
                if not all(engine.admin.store.blocks.has(h) for h in record.blocks):
                    ops["records naming a missing block"] = ops.get("records naming a missing block", 0) + 1
    print(json.dumps({"ops": ops, "warnings": warnings.lines}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), *sys.argv[4:6])
