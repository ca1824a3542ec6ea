"""A worker process on a shared store, for the distributed tests: one Engine (SmolLM2, or
MODEL) with
its own local cache directory in front of PostgreSQL + an object store, driven by JSON
commands on stdin, one per line, each answered by one JSON line on stdout.

    python shared_worker.py CACHE_DIR STORE_URL BLOCKS_URL [KV_BITS [MODEL]]

Commands: {"op": "generate", "agent": A, "prompt": P, "max_tokens": N[, "wait_saved": false]}
(answered once the save is durable, as an orchestrator handing the agent on would; false:
at once, as a server replies), {"op": "delete",
"agent": A}, {"op": "fork", "agent": A, "to": B}, {"op": "flush"}, {"op": "gc", "grace": S},
{"op": "stats"}, {"op": "check"}, {"op": "record", "agent": A}, {"op": "quit"}, and loops for
the crash and race tests:
{"op": "turns", "agents": N, "prompt": P} (turns on N agents until killed), {"op": "churn",
"agent": A, "seconds": S} (fork A, extend and delete forks), {"op": "gcloop", "seconds": S, "grace": G}."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback

from langchain_agent_memory.engine.engine import Engine, GenerationParams


def main() -> None:
    cache_dir, store, blocks = sys.argv[1:4]
    kv_bits = None if len(sys.argv) < 5 or sys.argv[4] == "16" else int(sys.argv[4])
    model = sys.argv[5] if len(sys.argv) > 5 else "smollm2-135m"
    engine = Engine(model, cache_dir=cache_dir, kv_bits=kv_bits, store=store, blocks=blocks)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = run(engine, cmd)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
        if cmd["op"] == "quit":
            break
    engine.close()


def run(engine: Engine, cmd: dict) -> dict:
    op = cmd["op"]
    store = engine.admin.store
    if op == "generate":
        params = GenerationParams(max_tokens=cmd.get("max_tokens", 8))
        result = engine.generate(cmd["agent"], cmd["prompt"], params)
        return {
            "text": result.text,
            "outcome": str(result.outcome),
            "reused": result.reused_tokens,
            "prompt_tokens": result.prompt_tokens,
            "saved": result.wait_saved() if cmd.get("wait_saved", True) else "pending",
            "ttft_s": result.timings.ttft_s,
        }
    if op == "record":  # the store's record of an agent (read through this worker)
        record = store.records.get(cmd["agent"])
        return {"text": record.text if record else None, "blocks": len(record.blocks) if record else 0}
    if op == "delete":
        return {"deleted": engine.admin.delete(cmd["agent"])}
    if op == "fork":
        record = store.records.get(cmd["agent"])
        engine.admin.set_agent(cmd["to"], record)
        return {"forked": True}
    if op == "flush":
        return {"pending": store.replication.pending.flush()}
    if op == "gc":
        return dataclasses.asdict(store.upkeep.collect_garbage(cmd.get("grace")))
    if op == "stats":
        leases = getattr(store, "leases", None)
        waits = {"handoff_waits": leases.waits, "handoff_waited_s": leases.waited_s} if leases else {}
        return {**dataclasses.asdict(store.stats), **waits, "fingerprint": engine.fingerprint}
    if op == "check":
        return {
            "dangling": store.catalog.dangling(engine.fingerprint),
            "agents": len(list(store.records.list())),
        }
    if op == "turns":  # until killed: every turn extends one of N agents' caches
        params = GenerationParams(max_tokens=2)
        n = 0
        while True:
            agent = f"crash:{n % cmd['agents']}"
            reply = engine.generate(
                agent, (engine.admin.cached_text(agent) or cmd["prompt"]) + f" Q{n}?", params
            )
            reply.wait_saved()  # a turn is reported once its save is durable (kills land mid-save)
            n += 1
            print(json.dumps({"turn": n}), flush=True)
    if op == "churn":  # fork an agent, extend the forks, delete older ones
        params = GenerationParams(max_tokens=2)
        base = store.records.get(cmd["agent"])
        end, n = time.monotonic() + cmd["seconds"], 0
        while time.monotonic() < end:
            fork = f"{cmd['agent']}#fork{n}"
            engine.admin.set_agent(fork, base)
            engine.generate(fork, base.text + f" And then {n}?", params)
            if n >= 2:
                engine.admin.delete(f"{cmd['agent']}#fork{n - 2}")
            n += 1
        return {"forks": n}
    if op == "gcloop":
        end, collected, rounds = time.monotonic() + cmd["seconds"], 0, 0
        while time.monotonic() < end:
            collected += store.upkeep.collect_garbage(grace_s=cmd["grace"]).blocks_collected
            rounds += 1
        return {"collected": collected, "rounds": rounds}
    if op == "quit":
        return {"bye": True}
    raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    main()
