"""A streamed reply whose prefill outlasts the wait for its first token: the status line
goes out, SSE keep-alive comments follow while the prefill runs (a client with a read
timeout keeps waiting), then the reply; each API's stream (chat completions, Anthropic's
messages, OpenAI's responses) as its clients read it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from services import app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app, streams
from langchain_agent_memory.testing.corpus import apache_license

MODEL = "smollm2-135m"
LONG = "Read this license.\n\n" + apache_license()[:6000] + "\n\nWho wrote it?"  # ~1.4K tokens, cold


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("streams")))
    with app_on_loopback(create_app(config)) as url:
        yield url


def _body(path: str) -> dict:
    # Its own first words: no other agent's stored prompt is read, the prefill runs cold.
    prompt = f"For {path}: " + LONG
    if path == "/v1/responses":
        return {"input": prompt, "max_output_tokens": 4}
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_long_prefill_streams_keep_alives_then_the_reply(
    server: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = _body(path)
    monkeypatch.setattr(streams, "FIRST_TOKEN_WAIT_S", 0.05)  # a prefill "longer" than the wait
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.2)
    agent = {"X-Agent-ID": f"long {path.rsplit('/', 1)[-1]}"}
    lines = []
    with httpx.stream(
        "POST", server + path, json={"model": MODEL, "stream": True, **body}, headers=agent, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    pings = [line for line in lines[: first_data + 8] if line.startswith(":")]
    assert pings, lines[:10]  # keep-alive comments while the prefill ran
    failed = [line for line in lines if '"error": {' in line or "response.failed" in line]
    assert not failed, failed
    last = [line for line in lines if line.startswith("data:")][-1]
    assert last == "data: [DONE]" if path == "/v1/chat/completions" else '"type":' in last
