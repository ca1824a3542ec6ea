"""Resume a 3-agent LangGraph graph after a process restart, from AgentMemorySaver.

Three agents, each with its own >= 2K-token context (a licensing assistant holding the
Apache License 2.0, two Python tutors holding different parts of the Python reference),
answer one question per phase in turn. Phases 1 and 2 run in one process, which then exits.
A second, separate process resumes the thread from the saver for phase 3 and prints, per
agent, the time to first token (as the node sees it: from its call to the first streamed
chunk):

- resumed: the thread as the first process left it (caches reloaded from disk),
- resumed without prefetch: the same step on a fork of the thread, prefetch off,
- cold: the same step from a copy of the checkpoints with no KV cache (a full prefill).

Each is its own new process (nothing in memory), the same step with the same prompts, run
one after the other by this script.

    python examples/resume_after_restart.py [--cache-dir DIR] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import operator
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from langchain_agent_memory import AgentMemorySaver, ChatAgentMemory, corpus

THREAD = "resume-demo"
QUESTIONS = [
    "Give a one-sentence summary of your text.",
    "Name one rule your text sets out.",
    "What is the most important word in your text?",
]


def contexts() -> dict[str, str]:
    docs = corpus.python_docs_topic
    return {
        "lawyer": "You are a licensing assistant. Use this license:\n\n" + corpus.apache_license(),
        "tutor": "You are a Python tutor. Use this reference:\n\n"
        + "\n\n".join(docs(t) for t in ("try", "while", "pass")),
        "reviewer": "You review Python code. Use this reference:\n\n"
        + "\n\n".join(docs(t) for t in ("import", "lambda", "break")),
    }


class State(TypedDict):
    phase: int
    lawyer: Annotated[list[AnyMessage], operator.add]
    tutor: Annotated[list[AnyMessage], operator.add]
    reviewer: Annotated[list[AnyMessage], operator.add]
    timings: Annotated[list[dict], operator.add]


def build(cache_dir: Path, max_tokens: int, prefetch: bool = True):  # type: ignore[no-untyped-def]
    llm = ChatAgentMemory(cache_dir=str(cache_dir), max_tokens=max_tokens)
    saver = AgentMemorySaver(cache_dir=cache_dir, prefetch=prefetch)

    def agent(name: str, system: str):  # type: ignore[no-untyped-def]
        def run(state: State) -> dict:
            question = HumanMessage(QUESTIONS[state["phase"]])
            t0 = time.perf_counter()
            reply, first_token_s = None, 0.0
            # Streamed, to time the first token as the node sees it (queueing included).
            for chunk in llm.stream([SystemMessage(system), *state[name], question]):  # type: ignore[literal-required]
                if reply is None:
                    first_token_s = time.perf_counter() - t0
                reply = chunk if reply is None else reply + chunk
            assert reply is not None
            usage = reply.usage_metadata or {}
            row = {
                "agent": name,
                "phase": state["phase"] + 1,
                "prompt_tokens": usage.get("input_tokens", 0),
                "cache_read": usage.get("input_token_details", {}).get("cache_read", 0),
                "cache": reply.response_metadata["cache"],
                "ttft_s": round(first_token_s, 4),
            }
            return {name: [question, reply], "timings": [row]}

        return run

    g = StateGraph(State)
    previous = START
    for name, system in contexts().items():
        g.add_node(name, agent(name, system))
        g.add_edge(previous, name)
        previous = name
    g.add_edge(previous, END)
    return g.compile(checkpointer=saver), saver, llm


def phase_input(phase: int) -> dict:
    return {"phase": phase, "lawyer": [], "tutor": [], "reviewer": [], "timings": []}


FORK = f"{THREAD}-fork"


def run_first_process(cache_dir: Path, max_tokens: int) -> list[dict]:
    app, saver, _ = build(cache_dir, max_tokens)
    for thread in (THREAD, FORK):
        saver.delete_thread(thread)  # a fresh start
    cfg = {"configurable": {"thread_id": THREAD}}
    for phase in (0, 1):
        app.invoke(phase_input(phase), cfg)
    saver.copy_thread(THREAD, FORK)  # the same state, resumed later without prefetch
    return app.get_state(cfg).values["timings"]


def run_phase_3(cache_dir: Path, max_tokens: int, thread: str, prefetch: bool) -> list[dict]:
    app, _, _ = build(cache_dir, max_tokens, prefetch=prefetch)
    t0 = time.perf_counter()
    values = app.invoke(phase_input(2), {"configurable": {"thread_id": thread}})
    rows = [r for r in values["timings"] if r["phase"] == 3]
    return [*rows, {"agent": "(whole phase)", "wall_s": round(time.perf_counter() - t0, 3)}]


def checkpoints_only(cache_dir: Path, target: Path) -> None:
    """A cache directory with the checkpoints and no KV cache: the cold baseline."""
    import sqlite3

    target.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(cache_dir / "checkpoints.sqlite")
    dst = sqlite3.connect(target / "checkpoints.sqlite")
    src.backup(dst)
    src.close()
    dst.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--process", choices=["first", "phase3"], help=argparse.SUPPRESS)
    ap.add_argument("--thread", default=THREAD, help=argparse.SUPPRESS)
    ap.add_argument("--no-prefetch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process == "first":
        print(json.dumps(run_first_process(args.cache_dir, args.max_tokens)))
        return
    if args.process == "phase3":
        print(json.dumps(run_phase_3(args.cache_dir, args.max_tokens, args.thread, not args.no_prefetch)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))

    def process(what: str, cache_dir: Path, *extra: str) -> list[dict]:
        cmd = [sys.executable, __file__, "--process", what, "--cache-dir", str(cache_dir)]
        cmd += ["--max-tokens", str(args.max_tokens), *extra]
        with console.status(f"a new process: {what} {' '.join(extra)}"):
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp) / "cache"
        results = {"first": process("first", cache_dir)}
        checkpoints_only(cache_dir, Path(tmp) / "cold")  # phases 1-2, no KV cache
        results["resumed"] = process("phase3", cache_dir)
        results["no prefetch"] = process("phase3", cache_dir, "--thread", FORK, "--no-prefetch")
        results["cold"] = process("phase3", Path(tmp) / "cold")
    first = Table(title="first process: phases 1-2 (then it exits)")
    for col in ("agent", "phase", "prompt tokens", "cache read", "cache", "TTFT s"):
        first.add_column(col, justify="right")
    for r in results["first"]:
        first.add_row(
            r["agent"],
            str(r["phase"]),
            str(r["prompt_tokens"]),
            str(r["cache_read"]),
            r["cache"],
            f"{r['ttft_s']:.2f}",
        )
    console.print(first)
    table = Table(title="a new process: phase 3 resumed from the saver vs the same step cold")
    for col in ("agent", "prompt tokens", "resumed TTFT s", "no prefetch s", "cold s", "cold / resumed"):
        table.add_column(col, justify="right")
    by_agent = {run: {r["agent"]: r for r in results[run]} for run in ("resumed", "no prefetch", "cold")}
    for agent in by_agent["resumed"]:
        res, nopf, cold = (by_agent[run].get(agent, {}) for run in ("resumed", "no prefetch", "cold"))
        if "wall_s" in res:
            walls = (res["wall_s"], nopf["wall_s"], cold["wall_s"])
            table.add_row(
                "whole phase (wall)", "", *(f"{w:.2f}" for w in walls), f"{walls[2] / walls[0]:.1f}x"
            )
            continue
        table.add_row(
            agent,
            str(res["prompt_tokens"]),
            f"{res['ttft_s']:.3f} ({res['cache']})",
            f"{nopf['ttft_s']:.3f} ({nopf['cache']})",
            f"{cold['ttft_s']:.2f} ({cold['cache']})",
            f"{cold['ttft_s'] / res['ttft_s']:.0f}x",
        )
    console.print(table)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
