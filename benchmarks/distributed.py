"""Workers sharing agents through PostgreSQL + an S3-compatible store (``storage.remote``),
against real servers this script starts (PostgreSQL 15, SeaweedFS; ``tests/services.py``).

    .venv/bin/python benchmarks/distributed.py [--contexts 2000,4000,7800] [--repeats 3]
        [--throughput-s 20]

1. Resume latency (time to first token, ~15 new tokens, SmolLM2 on this CPU), side by side:
   ``cold`` (no cache), ``same worker`` (its own disk: the live copy dropped), ``other
   worker`` (another engine with an empty cache directory: record from Postgres, blocks
   from the object store), and ``local store`` (the same resume with no shared store).
2. Save latency per turn: ``save_s`` of the same turns on a local and on a shared store.
3. Throughput: turns per second of 1, 2 and 4 worker processes on one machine, each
   running turns on agents of its own (this machine has 2 cores: past 2 they contend).
4. A frozen store: turns back to back on one worker (an agent it holds, a new agent each
   time) before, during and after ``--frozen-s`` seconds of PostgreSQL under SIGSTOP (a
   hung host, which enforces no server-side timeout): each turn's latency, bounded by the
   store's deadline (5 s) once, then served from the local tier, not by the freeze. An
   agent decodes all along on the same worker (its replies streamed back to back): the
   longest gap between its tokens shows whether the others' waits on the store reach the
   model's thread (they must not: ``engine/requests/admissions.py``).

    .venv/bin/python benchmarks/distributed.py --only frozen      # part 4 alone

Writes results/distributed.json and .png; prints tables. Ratios count; absolute times
only on this shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the real servers the tests start
WORKER = HERE.parent / "tests" / "integration" / "shared_worker.py"

from services import PostgresServer, SeaweedServer  # noqa: E402

from langchain_agent_memory import corpus  # noqa: E402
from langchain_agent_memory.engine.engine import Engine, GenerationParams  # noqa: E402

PARAMS = GenerationParams(max_tokens=8)
SYSTEMS = ("cold", "same worker", "other worker", "local store")
SAVES = ("first, local", "first, shared", "follow-up, local", "follow-up, shared")


def _prompt(engine: Engine, tokens: int, salt: str) -> str:
    text = corpus.apache_license() * 8
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix of the corpus that tokenizes to <= tokens
        mid = (lo + hi + 1) // 2
        if engine.count_tokens(text[:mid]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return f"[{salt}] " + text[:lo]


def latency(contexts: list[int], repeats: int, store: tuple[str, str]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="agent-memory-bench-"))
    shared = {"store": store[0], "blocks": store[1]}
    a = Engine("smollm2-135m", cache_dir=root / "a", **shared)
    b = Engine("smollm2-135m", cache_dir=root / "b", **shared)
    local = Engine("smollm2-135m", cache_dir=root / "local")
    rows: dict[str, Any] = {}
    try:
        for n in contexts:
            got: dict[str, list[float]] = {k: [] for k in SYSTEMS}
            # first turn (every block written) and a follow-up turn (the new blocks only)
            saves: dict[str, list[float]] = {k: [] for k in SAVES}
            for r in range(repeats):
                print(f"  context {n}: repeat {r + 1}/{repeats}", flush=True)
                base = _prompt(a, n, f"{n}-{r}")
                follow = "\nQuestion: what does section 4 ask of a redistributor?\nAnswer:"
                agent = f"bench:{n}:{r}"
                first = a.generate(agent, base, PARAMS)
                saves["first, shared"].append(first.timings.save_s)
                turn2 = base + first.text + follow
                # (another first block: no block of the stored turn is shared with it)
                got["cold"].append(a.generate(f"cold:{n}:{r}", "~" + turn2, PARAMS).timings.ttft_s)
                # the same worker from its own disk, then another (nothing of it on its disk)
                a.admin.drop_hot(agent)
                got["same worker"].append(_warm(a, agent, turn2, saves["follow-up, shared"], drop_pool=True))
                got["other worker"].append(_warm(b, agent, turn2, saves["follow-up, shared"]))
                first_local = local.generate(agent, base, PARAMS)
                saves["first, local"].append(first_local.timings.save_s)
                local.admin.drop_hot(agent)
                turn2_local = base + first_local.text + follow
                got["local store"].append(
                    _warm(local, agent, turn2_local, saves["follow-up, local"], drop_pool=True)
                )
            rows[str(n)] = {
                "ttft_s": {k: statistics.median(v) for k, v in got.items()},
                "save_s": {k: statistics.median(v) for k, v in saves.items()},
            }
    finally:
        for e in (a, b, local):
            e.close()
    return rows


def _warm(engine: Engine, agent: str, prompt: str, saves: list[float], drop_pool: bool = False) -> float:
    if drop_pool:
        engine.admin.clear_memory()  # from disk, not the in-memory tier
    result = engine.generate(agent, prompt, PARAMS)
    assert str(result.outcome).startswith("warm"), result.outcome
    saves.append(result.timings.save_s)
    return result.timings.ttft_s


def throughput(workers: int, seconds: float, store: tuple[str, str]) -> float:
    """Turns per second of ``workers`` processes, each on 2 agents of its own."""
    root = Path(tempfile.mkdtemp(prefix="agent-memory-tput-"))
    prompt = corpus.apache_license()[:3000]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(root / f"w{i}"), *store, "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    for p in procs:
        assert p.stdout is not None and json.loads(p.stdout.readline()) == {"ready": True}
    for i, p in enumerate(procs):
        assert p.stdin is not None
        p.stdin.write(json.dumps({"op": "turns", "agents": 2, "prompt": f"[w{i}] " + prompt}) + "\n")
        p.stdin.flush()
    time.sleep(seconds / 4)  # warm-up: first turns are cold
    counts0 = [_latest_turn(p) for p in procs]
    t0 = time.monotonic()
    time.sleep(seconds)
    counts1 = [_latest_turn(p) for p in procs]
    elapsed = time.monotonic() - t0
    for p in procs:
        p.kill()
        p.wait()
    return sum(c1 - c0 for c0, c1 in zip(counts0, counts1, strict=True)) / elapsed


def frozen(
    seconds: float, pg: PostgresServer, store: tuple[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each turn's (start, phase, agent kind, wall seconds) around ``seconds`` of a frozen
    PostgreSQL, and each gap between two tokens of the agent decoding meanwhile."""
    root = Path(tempfile.mkdtemp(prefix="agent-memory-frozen-"))
    engine = Engine("smollm2-135m", cache_dir=root / "w", store=store[0], blocks=store[1])
    base = corpus.apache_license()[:2500]
    turns: list[dict[str, Any]] = []
    t0 = time.monotonic()
    now = {"phase": "before"}
    done = threading.Event()

    def decode_on() -> None:
        """Replies streamed back to back; each gap between two tokens of one reply."""
        counting = base + "\nCount to 300: 1, 2, 3, 4,"
        while not done.is_set():
            last = None
            for _ in engine.stream("decoder", counting, GenerationParams(max_tokens=48)):
                stamp = time.monotonic()
                if last is not None:
                    gaps.append({"t": stamp - t0, "phase": now["phase"], "gap_s": stamp - last})
                last = stamp

    gaps: list[dict[str, Any]] = []
    decoder = threading.Thread(target=decode_on, daemon=True)

    def run(phase: str, until: float) -> None:
        now["phase"] = phase
        while time.monotonic() < until:
            for kind in ("held", "new"):
                agent = "held" if kind == "held" else f"new{len(turns)}"
                prompt = (engine.admin.cached_text(agent) or base) + f"\nQ{len(turns)}: and then?\nA:"
                start = time.monotonic()
                engine.generate(agent, prompt, PARAMS)
                wall = time.monotonic() - start
                turns.append({"t": start - t0, "phase": phase, "kind": kind, "wall_s": wall})
                print(f"  {phase:6s} {kind:4s} {wall:6.2f} s", flush=True)

    try:
        engine.generate("held", base, PARAMS)
        decoder.start()
        run("before", time.monotonic() + 10)
        pg.freeze()
        try:
            run("frozen", time.monotonic() + seconds)
        finally:
            pg.thaw()
        run("after", time.monotonic() + 15)
        done.set()
        decoder.join()
        engine.flush()
    finally:
        engine.close()
    return turns, gaps


_LAST_TURN: dict[int, int] = {}  # worker pid -> the last turn count it printed


def _latest_turn(proc: subprocess.Popen[str]) -> int:
    """The last turn count the worker printed (reads what is buffered, without blocking)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    buf = b""
    while select.select([fd], [], [], 0.05)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    for line in buf.decode().splitlines():
        if line.startswith('{"turn"') and line.endswith("}"):  # whole lines only
            _LAST_TURN[proc.pid] = json.loads(line)["turn"]
    return _LAST_TURN.get(proc.pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2000,4000,7800")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throughput-s", type=float, default=20.0)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--frozen-s", type=float, default=30.0)
    ap.add_argument("--only", choices=["frozen"], help="run one part (results/distributed-frozen.json)")
    args = ap.parse_args()
    pg, s3 = PostgresServer(), SeaweedServer()
    rows: dict[str, Any] = {}
    tput: dict[str, float] = {}
    try:
        if args.only is None:
            print("latency", flush=True)
            rows = latency([int(c) for c in args.contexts.split(",")], args.repeats,
                           (pg.new_database("latency"), s3.new_bucket("latency")))  # fmt: skip
            for w in (int(x) for x in args.workers.split(",")):
                print(f"throughput: {w} workers", flush=True)
                tput[str(w)] = throughput(
                    w, args.throughput_s, (pg.new_database(f"tput{w}"), s3.new_bucket(f"tput{w}"))
                )
        print(f"a frozen store: {args.frozen_s:g} s of SIGSTOP", flush=True)
        turns, gaps = frozen(args.frozen_s, pg, (pg.new_database("frozen"), s3.new_bucket("frozen")))
    finally:
        pg.close()
        s3.close()
    _report_frozen(turns, gaps, args.frozen_s)
    if args.only == "frozen":
        return
    print("\nTime to first token, s (median; SmolLM2, this CPU)")
    print(f"{'context':>8} " + " ".join(f"{k:>13}" for k in SYSTEMS) + "  other/same  cold/other")
    for n, row in rows.items():
        t = row["ttft_s"]
        ratios = f"  {t['other worker'] / t['same worker']:10.2f}  {t['cold'] / t['other worker']:10.2f}"
        print(f"{n:>8} " + " ".join(f"{t[k]:13.3f}" for k in SYSTEMS) + ratios)
    print("\nSave per turn, s (median): " + ", ".join(SAVES))
    for n, row in rows.items():
        print(f"{n:>8} " + " ".join(f"{row['save_s'][k]:17.3f}" for k in SAVES))
    print("\nThroughput, turns/s (2 agents per worker, ~700-token contexts, 4-bit KV)")
    for w, t in tput.items():
        print(f"{w:>3} workers: {t:.2f}")
    out = {"latency": rows, "throughput_turns_per_s": tput, "machine": "this CPU (2 cores), SmolLM2-135M"}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "distributed.json").write_text(json.dumps(out, indent=2))
    _plot(rows, tput)


def _report_frozen(turns: list[dict[str, Any]], gaps: list[dict[str, Any]], seconds: float) -> None:
    print(f"\nTurn latency, s, around {seconds:g} s of a frozen PostgreSQL (SmolLM2, this CPU)")
    print("phase   turns  median    max   decoding agent: tokens  median gap  longest gap")
    for phase in ("before", "frozen", "after"):
        w = [t["wall_s"] for t in turns if t["phase"] == phase]
        g = [t["gap_s"] for t in gaps if t["phase"] == phase] or [0.0]
        print(f"{phase:7s} {len(w):5d} {statistics.median(w):7.2f} {max(w):6.2f}   "
              f"{len(g):22d} {statistics.median(g):11.3f} {max(g):12.3f}")  # fmt: skip
    out = {"frozen_s": seconds, "store_deadline_s": 5.0, "turns": turns, "decode_gaps": gaps,
           "machine": "this CPU (2 cores), SmolLM2-135M"}  # fmt: skip
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "distributed-frozen.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    start = min(t["t"] for t in turns if t["phase"] == "frozen")
    ax.axvspan(start, start + seconds, color="0.85", label="PostgreSQL frozen (SIGSTOP)")
    for kind, style in (("held", "C0o"), ("new", "C1s")):
        ax.plot([t["t"] for t in turns if t["kind"] == kind],
                [t["wall_s"] for t in turns if t["kind"] == kind], style, label=f"{kind} agent")  # fmt: skip
    ax.plot([t["t"] for t in gaps], [t["gap_s"] for t in gaps], "C2.", ms=2,
            label="gap between tokens of a decoding agent")  # fmt: skip
    ax.axhline(5.0, color="k", ls=":", lw=1, label="store deadline")
    ax.set(xlabel="seconds", ylabel="turn, s", title="turns of one worker while its store hangs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "distributed-frozen.png", dpi=120)


def _plot(rows: dict[str, Any], tput: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [int(n) for n in rows]
    for k in SYSTEMS:
        ax1.plot(xs, [rows[str(n)]["ttft_s"][k] for n in xs], marker="o", label=k)
    ax1.set(xlabel="context tokens", ylabel="time to first token, s", title="resume on another worker")
    ax1.legend()
    ax2.bar(list(tput), list(tput.values()))
    ax2.set(xlabel="worker processes (one 2-core machine)", ylabel="turns / s", title="throughput")
    fig.tight_layout()
    fig.savefig(HERE / "results" / "distributed.png", dpi=120)


if __name__ == "__main__":
    main()
