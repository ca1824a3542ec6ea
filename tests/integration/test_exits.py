"""Processes that end without ``close()`` on a shared store (real PostgreSQL and SeaweedFS):
a script's last turn reaches the store at interpreter exit, and a save that was durable on
the worker but not uploaded when the process was SIGKILLed is uploaded by the next engine
on that directory."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from services import PostgresServer, SeaweedServer

from langchain_agent_memory.engine.engine import Engine

#: A script as users write them: a chat model on a shared store, one call, no close().
SCRIPT = textwrap.dedent(
    """
    import sys
    from langchain_agent_memory import ChatAgentMemory

    cache_dir, store, blocks, prompt = sys.argv[1:5]
    llm = ChatAgentMemory(cache_dir=cache_dir, store=store, blocks=blocks, agent_id="cfg", max_tokens=4)
    steps = len(sys.argv) > 5  # told when to go on (stdin), and when the save is durable here
    if steps:
        print("ready", llm.engine.fingerprint[:8], flush=True)
        sys.stdin.readline()
    reply = llm.invoke(prompt)
    print("replied", reply.response_metadata.get("cache_saved"), flush=True)
    if steps:
        llm.flush()
        print("saved", flush=True)
        sys.stdin.readline()
    """
)


def _prompt() -> str:
    from langchain_agent_memory import corpus

    return "Read this.\n\n" + corpus.apache_license()[:5000] + "\n\nWhat is it called?"


def _stored_text(store: str, blocks: str, root: Path) -> str | None:
    """The agent's text in the shared store, read by a worker that never held it."""
    with Engine("smollm2-135m", cache_dir=root, store=store, blocks=blocks) as reader:
        record = reader.admin.store.records.get("cfg")
        return record.text if record is not None else None


def test_a_script_that_ends_without_close_keeps_its_last_turn(
    tmp_path: Path, shared_store: tuple[str, str]
) -> None:
    store, blocks = shared_store
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "w"), store, blocks, _prompt()],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replied pending" in done.stdout  # the reply left before its save
    assert "was not saved" not in done.stderr, done.stderr[-3000:]
    text = _stored_text(store, blocks, tmp_path / "reader")
    assert text is not None and "What is it called?" in text


def test_a_save_kept_locally_when_the_worker_was_killed_is_uploaded_by_the_next_start(
    tmp_path: Path,
) -> None:
    pg, s3 = PostgresServer(), SeaweedServer()  # servers of its own: this test freezes one
    try:
        store, blocks = pg.new_database("exits"), s3.new_bucket("exits")
        script = tmp_path / "script.py"
        script.write_text(SCRIPT)
        worker = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "w"), store, blocks, _prompt(), "wait"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().startswith("ready"), worker.poll()
        # The database hangs while the turn runs: its save is durable on the worker only.
        pg.freeze()
        try:
            worker.stdin.write("go\n")
            worker.stdin.flush()
            lines = [worker.stdout.readline(), worker.stdout.readline()]
            assert lines[-1].strip() == "saved", (lines, worker.poll())
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            pg.thaw()
        # Killed before any upload; the next engine on the directory uploads what it finds.
        with Engine("smollm2-135m", cache_dir=tmp_path / "w", store=store, blocks=blocks) as again:
            deadline = time.monotonic() + 60
            while again.admin.store.local.records.pending_agents() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert again.admin.store.local.records.pending_agents() == []
        text = _stored_text(store, blocks, tmp_path / "reader")
        assert text is not None and "What is it called?" in text
    finally:
        pg.close()
        s3.close()
