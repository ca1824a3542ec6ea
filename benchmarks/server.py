"""The OpenAI-compatible server, measured from a client: time to first token over HTTP,
across a server restart, and concurrent streaming clients.

    .venv/bin/python benchmarks/server.py [--model smollm2-135m] [--sizes 1000 2500 5000]

1. For each context size, one agent (``X-Agent-ID``) whose system prompt holds that many
   tokens of the Python reference manual: turn 1 (cold), turn 2 (hot: same server
   process), then the server is restarted (SIGTERM, a new process) and turn 3 runs twice
   side by side: on the agent (warm: its cache from disk), on a new agent whose messages
   differ in the first word (cold: full prefill), and on a new agent with the same
   messages (it shares the first agent's stored blocks). Time to first token is measured by the client
   (``openai`` package, streaming: request sent -> first content delta) and by the server
   (``agent_memory.time_to_first_token_s``).
2. Concurrent clients: 1, 2 and 4 ``AsyncOpenAI`` streams of ``--tokens`` tokens each, on
   warm agents; aggregate generated tokens per second (the engine batches their decode
   steps into one forward pass).

Writes benchmarks/results/server.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHARS_PER_TOKEN = 3.9  # SmolLM2 on the Python reference manual (sizes are then reported exactly)
QUESTIONS = ("What is this text about?", "Give one example from it.", "Summarise it in one line.")


def start(model: str, cache_dir: Path, port: int) -> subprocess.Popen[bytes]:
    from langchain_agent_memory.testing.server_process import start_server

    return start_server(["--model", model, "--cache-dir", str(cache_dir), "--log-level", "warning"], port)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def streamed(client: Any, model: str, agent: str, messages: list[dict], tokens: int) -> dict[str, Any]:
    """One streamed request: client-side TTFT, the reply, and the server's account."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Agent-ID": agent},
    )
    first, text, server, usage = None, "", {}, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        extra = chunk.model_extra or {}
        server = extra.get("agent_memory", server)
        usage = chunk.usage or usage
    return {
        "client_ttft_s": first if first is not None else time.perf_counter() - t0,
        "request_s": time.perf_counter() - t0,
        "server_ttft_s": server.get("time_to_first_token_s"),
        "cache": server.get("cache"),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None,
        "reply": text,
    }


async def concurrent(base_url: str, model: str, n: int, tokens: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count from 1 to 300, separated by commas."}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Agent-ID": f"concurrent-{i}"},
        )
        count = 0
        async for chunk in stream:
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return count

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"clients": n, "tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2500, 5000])
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per client in the concurrency runs")
    a = ap.parse_args()

    import openai
    from rich.console import Console
    from rich.table import Table

    from langchain_agent_memory import corpus

    console = Console(width=max(Console().width, 120))
    docs = corpus.python_docs()
    from langchain_agent_memory.testing.server_process import free_port

    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)
    rows: dict[int, dict[str, Any]] = {}
    conversations: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        proc = start(a.model, cache, port)
        try:
            for size in a.sizes:
                system = {"role": "system", "content": docs[: int(size * CHARS_PER_TOKEN)]}
                messages = [system, {"role": "user", "content": QUESTIONS[0]}]
                cold = streamed(client, a.model, f"agent-{size}", messages, a.reply_tokens)
                messages += [{"role": "assistant", "content": cold["reply"]}]
                messages += [{"role": "user", "content": QUESTIONS[1]}]
                hot = streamed(client, a.model, f"agent-{size}", messages, a.reply_tokens)
                messages += [{"role": "assistant", "content": hot["reply"]}]
                messages += [{"role": "user", "content": QUESTIONS[2]}]
                conversations[size] = messages
                rows[size] = {"turn1_cold": cold, "turn2_hot": hot}
                console.print(
                    f"{cold['prompt_tokens']} tokens: turn 1 cold {cold['client_ttft_s']:.2f} s, "
                    f"turn 2 hot {hot['client_ttft_s']:.2f} s"
                )
        finally:
            stop_server(proc)
        console.print("server restarted")
        proc = start(a.model, cache, port)
        try:
            for size in a.sizes:
                warm = streamed(client, a.model, f"agent-{size}", conversations[size], a.reply_tokens)
                # The same conversation with a different first word: nothing to reuse.
                first = conversations[size][0]
                other = [{**first, "content": "Read: " + first["content"]}, *conversations[size][1:]]
                fresh = streamed(client, a.model, f"fresh-{size}", other, a.reply_tokens)
                # A new agent with the same conversation: it shares the first agent's blocks.
                shared = streamed(client, a.model, f"sharer-{size}", conversations[size], a.reply_tokens)
                rows[size] |= {"turn3_warm_after_restart": warm, "turn3_cold": fresh, "turn3_shared": shared}
                console.print(
                    f"{warm['prompt_tokens']} tokens: turn 3 after restart {warm['client_ttft_s']:.2f} s "
                    f"({warm['cache']}), cold {fresh['client_ttft_s']:.2f} s, "
                    f"new agent sharing the prefix {shared['client_ttft_s']:.2f} s ({shared['cache']})"
                )
            conc = []
            for n in (1, 2, 4):  # first pass warms each agent; the second is measured
                asyncio.run(concurrent(base_url, a.model, n, 2))
            for n in (1, 2, 4):
                conc.append(asyncio.run(concurrent(base_url, a.model, n, a.tokens)))
                console.print(f"{n} concurrent client(s): {conc[-1]['tokens_per_s']:.1f} tok/s")
        finally:
            stop_server(proc)

    table = Table(title=f"server, {a.model}: time to first token seen by an openai client (streaming)")
    for col in (
        "prompt tokens (turn 3)",
        "turn 1 cold",
        "turn 2 hot",
        "turn 3 after restart",
        "turn 3 cold",
        "restart vs cold",
        "new agent, shared prefix",
        "server TTFT (restart / cold)",
    ):
        table.add_column(col, justify="right")
    for r in rows.values():
        w, c = r["turn3_warm_after_restart"], r["turn3_cold"]
        table.add_row(
            str(w["prompt_tokens"]), f"{r['turn1_cold']['client_ttft_s']:.2f} s",
            f"{r['turn2_hot']['client_ttft_s']:.2f} s", f"{w['client_ttft_s']:.2f} s ({w['cache']})",
            f"{c['client_ttft_s']:.2f} s", f"{c['client_ttft_s'] / w['client_ttft_s']:.0f}x",
            f"{r['turn3_shared']['client_ttft_s']:.2f} s",
            f"{w['server_ttft_s']:.2f} / {c['server_ttft_s']:.2f} s",
        )  # fmt: skip
    console.print(table)
    t2 = Table(title=f"concurrent streaming clients, {a.tokens} tokens each")
    for col in ("clients", "tokens", "wall", "tok/s", "vs 1 client"):
        t2.add_column(col, justify="right")
    for r in conc:
        t2.add_row(
            str(r["clients"]), str(r["tokens"]), f"{r['wall_s']:.2f} s", f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s'] / conc[0]['tokens_per_s']:.2f}x",
        )  # fmt: skip
    console.print(t2)

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    payload = {"model": a.model, "ttft": {str(k): v for k, v in rows.items()}, "concurrent": conc}
    (out / "server.json").write_text(json.dumps(payload, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = [("turn3_cold", "cold (full prefill)"), ("turn2_hot", "hot (same process)")]
    keys.append(("turn3_warm_after_restart", "after server restart"))
    x = range(len(rows))
    for i, (key, label) in enumerate(keys):
        ax.bar(
            [j + 0.27 * (i - 1) for j in x],
            [r[key]["client_ttft_s"] for r in rows.values()],
            0.27,
            label=label,
        )
    ax.set_xticks(list(x), [str(r["turn3_cold"]["prompt_tokens"]) for r in rows.values()])
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("client time to first token (s)")
    ax.legend()
    ax2.bar([str(r["clients"]) for r in conc], [r["tokens_per_s"] for r in conc])
    ax2.set_xlabel("concurrent streaming clients")
    ax2.set_ylabel("generated tokens / s")
    fig.suptitle(f"agent-memory serve, {a.model}")
    fig.tight_layout()
    fig.savefig(out / "server.png", dpi=120)
    console.print(f"wrote {out / 'server.json'} and {out / 'server.png'}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
