"""The agent harnesses at full size against ``agent-memory serve``: Claude Code and the Codex
CLI as installed (``tests/harnesses``, pinned; ``scripts/setup.sh --dev``), with their own
system prompts and tools, nothing shortened.

    .venv/bin/python benchmarks/harness.py [--harness claude codex] [--model gemma3-270m]

For each harness: session 1 turn 1 (cold), session 1 turn 2 (``--continue`` /
``resume --last``), session 2 turn 1 (a new session: its own agent, which should start from
the system prompt and tools session 1 stored, a SHARED match), then the server is stopped
and a new process serves session 3 turn 1 (the shared blocks from disk). Each turn's first
model request is timed by a recording proxy between the client and the server (request in
-> first token event out) and read back from the reply: the cache outcome, the prompt
tokens and those read from a cache, and the server's own time to first token. The server
clamps replies to ``--max-tokens`` (a base model never stops by itself; Claude Code then
asks again to go on: those follow-ups are counted, not timed).

Writes benchmarks/results/harness.json; the table is in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from langchain_agent_memory.testing.harnesses import ClaudeCode, CodexCli  # noqa: E402
from langchain_agent_memory.testing.server_process import (  # noqa: E402
    app_on_loopback,
    free_port,
    start_server,
)

#: Event types whose arrival is a reply's first token (Anthropic's, the Responses API's).
FIRST_TOKEN = (
    b"content_block_delta",
    b"response.output_text.delta",
    b"response.function_call_arguments.delta",
)
MODEL_ROUTES = ("/v1/messages", "/v1/responses")


@dataclass(slots=True)
class Reply:
    """One model request as the proxy saw it."""

    route: str
    client_ttft_s: float | None = None
    server_ttft_s: float | None = None
    cache: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def _read_reply(reply: Reply, body: bytes) -> None:
    """The reply's account (``agent_memory``, usage) from its last SSE events."""
    for line in body.decode(errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        whole = event.get("response") if isinstance(event.get("response"), dict) else event
        memory = whole.get("agent_memory")
        usage = whole.get("usage") or {}
        if not memory:
            continue
        reply.cache = memory.get("cache")
        reply.cached_tokens = memory.get("cached_tokens")
        reply.server_ttft_s = memory.get("time_to_first_token_s")
        if "cache_read_input_tokens" in usage:  # Anthropic's three parts add up to the prompt
            parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
            reply.prompt_tokens = sum(int(usage.get(k) or 0) for k in parts)
        elif "input_tokens" in usage:
            reply.prompt_tokens = int(usage["input_tokens"])


@contextmanager
def recording_proxy(upstream: Callable[[], str], replies: list[Reply]) -> Iterator[str]:
    """A proxy on loopback forwarding everything to ``upstream()`` (asked per request: the
    server moves to a new process); each model request is appended to ``replies``."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=None)
    hop = {"content-length", "transfer-encoding", "connection", "content-encoding", "host"}

    async def forward(request: Request) -> StreamingResponse:
        t0 = time.perf_counter()
        url = upstream() + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        sent = client.build_request(request.method, url, headers=headers, content=await request.body())
        resp = await client.send(sent, stream=True)
        reply = (
            Reply(request.url.path) if request.method == "POST" and request.url.path in MODEL_ROUTES else None
        )

        async def body() -> Any:
            seen = bytearray()
            async for chunk in resp.aiter_raw():
                if reply is not None:
                    seen += chunk
                    if reply.client_ttft_s is None and any(t in seen for t in FIRST_TOKEN):
                        reply.client_ttft_s = time.perf_counter() - t0
                yield chunk
            await resp.aclose()
            if reply is not None:
                _read_reply(reply, bytes(seen))
                replies.append(reply)

        out = {k: v for k, v in resp.headers.items() if k.lower() not in hop}
        return StreamingResponse(body(), status_code=resp.status_code, headers=out)

    methods = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    with app_on_loopback(app) as url:
        yield url


@dataclass(slots=True)
class Row:
    harness: str
    turn: str
    wall_s: float
    requests: int
    first: Reply


def run_harness(name: str, model: str, max_tokens: int, root: Path) -> list[Row]:
    cache, log = root / "cache", root / "serve.log"
    args = ["-m", model, "--cache-dir", str(cache), "--max-tokens-limit", str(max_tokens), "--metrics-public"]
    args += ["--model-alias", f"claude-*={model}", "--model-alias", f"gpt-*={model}"]
    port = free_port()
    replies: list[Reply] = []
    rows: list[Row] = []
    proc = start_server(args, port, log=log)
    # a failed turn stops the server too (one left running would hold the cores)
    atexit.register(lambda: proc.poll() is None and _stop(proc))
    with recording_proxy(lambda: f"http://127.0.0.1:{port}", replies) as url:
        work, home = root / "work", root / "home"
        if name == "claude":
            # The model pinned, as docs/guides/server.md says: by default a new session's
            # system prompt names it "(1M context)" and a continued one does not.
            claude = ClaudeCode(url, home, work, args=("--model", "claude-opus-4-8"), timeout_s=3600)

            def turn(prompt: str, resume: bool) -> object:
                return claude.turn(prompt, resume=resume, check=False)  # a base model hits max_tokens
        else:
            codex = CodexCli(url, model, home, work, timeout_s=3600)

            def turn(prompt: str, resume: bool) -> object:
                return codex.turn(prompt, resume=resume, check=False)

        def timed(label: str, prompt: str, resume: bool = False) -> None:
            n, t0 = len(replies), time.perf_counter()
            turn(prompt, resume)
            wall = time.perf_counter() - t0
            mine = replies[n:]
            assert mine, f"{name} {label}: no model request reached the server"
            rows.append(Row(name, label, round(wall, 1), len(mine), mine[0]))
            print(json.dumps(asdict(rows[-1])), flush=True)

        timed("session 1 turn 1", "What does this project do? Answer in one line.")
        timed("session 1 turn 2", "And which language is it written in?", resume=True)
        timed("session 2 turn 1", "List the files in this folder.")
        _stop(proc)
        proc = start_server(args, port, log=log)  # a new process on the same cache directory
        timed("session 3 turn 1 (new process)", "Explain what a KV cache is.")
    return rows


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", nargs="+", default=["claude", "codex"], choices=["claude", "codex"])
    ap.add_argument("--model", default="gemma3-270m", help="32K context: Claude Code's prompt is ~20K tokens")
    ap.add_argument("--max-tokens", type=int, default=16, help="the server's --max-tokens-limit")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "harness.json")
    a = ap.parse_args()
    rows: list[Row] = []
    for name in a.harness:
        with tempfile.TemporaryDirectory(prefix=f"harness-{name}-") as tmp:
            rows += run_harness(name, a.model, a.max_tokens, Path(tmp))
    a.out.write_text(json.dumps({"model": a.model, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print(f"{'harness':8} {'turn':32} {'cache':14} {'read':>13} {'TTFT client':>12} {'server':>8}")
    for r in rows:
        f = r.first
        read = f"{f.cached_tokens}/{f.prompt_tokens}"
        client = f"{f.client_ttft_s:.2f}s" if f.client_ttft_s is not None else "-"
        server = f"{f.server_ttft_s:.2f}s" if f.server_ttft_s is not None else "-"
        print(f"{r.harness:8} {r.turn:32} {f.cache or '-':14} {read:>13} {client:>12} {server:>8}")


if __name__ == "__main__":
    main()
