"""Run ``agent-memory serve`` as a child process and wait until it answers (for scripts,
benchmarks and tests that need a real server process, e.g. to restart it)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    args: list[str],
    port: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``agent-memory serve --port PORT ARGS...`` in a child process, returned once
    ``/health`` answers 200 (the models are loaded by then). Raises ``RuntimeError`` with the
    end of its stderr when it exits or does not answer within ``timeout_s``. ``log``: a file
    that gets its stdout and stderr (the start-up summary, the access log), appended to."""
    import httpx

    cmd = [sys.executable, "-m", "langchain_agent_memory.cli.main", "serve", "--port", str(port), *args]
    # stderr goes to a file, not a pipe (a pipe nobody reads would block a chatty server);
    # the child keeps writing to it after this function closes its own handle
    with open(log, "a+b") if log is not None else tempfile.TemporaryFile() as out:
        stdout = out if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=out, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                out.seek(0)
                err = out.read().decode(errors="replace")
                raise RuntimeError(f"the server did not start: {err[-2000:]}")
            time.sleep(0.1)


@contextlib.contextmanager
def app_on_loopback(app: Any) -> Iterator[str]:
    """An ASGI app served by a real uvicorn on a thread of this process (port 0: any free
    one; headers go through h11 as in production); yields its base URL."""
    import uvicorn  # the server extra

    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
