"""The OpenAI-compatible server, driven over loopback by real clients: the ``openai``
package, ``langchain-openai``'s ``ChatOpenAI`` and raw HTTP (httpx) for the errors.

The server runs in this process (uvicorn on a thread, port 0) on the session's model;
the restart test runs ``agent-memory serve`` as a child process, twice.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from services import app_on_loopback

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.registry import shared_engine
from langchain_agent_memory.engine.storage.blocks import CacheWriteError
from langchain_agent_memory.engine.storage.budget import StorageBudget
from langchain_agent_memory.engine.storage.index import AgentIndex
from langchain_agent_memory.server import ServerConfig, create_app
from langchain_agent_memory.testing.corpus import apache_license
from langchain_agent_memory.testing.server_process import free_port, start_server

KEY = "test-key"
MODEL = "smollm2-135m"
BODY_LIMIT = 256 << 10
COLORS = [{"role": "user", "content": "Name three colors, one per line."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    cache_dir = tmp_path_factory.mktemp("server-cache")
    config = ServerConfig(
        models=[MODEL], cache_dir=str(cache_dir), api_key=KEY, max_body_bytes=BODY_LIMIT, max_tokens_limit=512
    )
    with app_on_loopback(create_app(config)) as url:
        yield url, cache_dir


@pytest.fixture
def client(server: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _agent(name: str) -> dict[str, Any]:
    return {"extra_headers": {"X-Agent-ID": name}}


def _complete(client: openai.OpenAI, agent: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, **_agent(agent), **kw
    )


def _stream_text(client: openai.OpenAI, agent: str, messages: list[dict[str, Any]], **kw: Any) -> tuple:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **_agent(agent),
            **kw,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ------------------------------------------------------------------ the openai package


def test_openai_client_reply_then_followup_reuses_the_agents_cache(client: openai.OpenAI) -> None:
    first = _complete(client, "oa-memory", COLORS, max_tokens=16)
    reply = first.choices[0].message.content
    assert reply and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.model_extra["agent_memory"]["cache"] == "cold"

    followup = [
        *COLORS,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And a fourth?"},
    ]
    second = _complete(client, "oa-memory", followup, max_tokens=8)
    # the first prompt and its reply are in the agent's cache: only the new turn is read
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.model_extra["agent_memory"]["cache"] == "hot-extend"

    # the body field names the agent as well as the header does
    third = client.chat.completions.create(
        model=MODEL, messages=followup, max_tokens=4, temperature=0, extra_body={"agent_id": "oa-memory"}
    )
    assert third.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # A reply leaves before its save ("pending") unless asked to wait for it.
    assert third.model_extra["agent_memory"]["cache_saved"] == "pending"
    waited = client.chat.completions.create(
        model=MODEL, messages=followup, max_tokens=2, temperature=0,
        extra_body={"agent_id": "oa-memory", "wait_for_save": True},
    )  # fmt: skip
    assert waited.model_extra["agent_memory"]["cache_saved"] is True
    wait = {"wait_for_save": True}
    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_body=wait)
    assert text.model_extra["agent_memory"]["cache_saved"] is True


def test_streaming_gives_the_same_reply_as_non_streaming(client: openai.OpenAI) -> None:
    whole = _complete(client, "oa-plain", COLORS, max_tokens=24)
    text, chunks = _stream_text(client, "oa-stream", COLORS, max_tokens=24)
    assert text == whole.choices[0].message.content  # both cold, greedy: the same tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_sequence_cuts_the_reply_before_it(client: openai.OpenAI) -> None:
    full = _complete(client, "oa-stop-full", COLORS, max_tokens=24).choices[0].message.content
    assert len(full) > 8
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = _complete(client, "oa-stop", COLORS, max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    text, _ = _stream_text(client, "oa-stop-stream", COLORS, max_tokens=24, stop=stop)
    assert text == full[: full.find(stop)]


def test_forced_tool_call_then_tool_result_round_trip(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = _complete(client, "oa-tools", ask, tools=[WEATHER_TOOL], tool_choice=forced, max_tokens=48)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )

    # streamed: the call arrives as tool_calls deltas
    _, chunks = _stream_text(
        client, "oa-tools-stream", ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)

    # the tool's answer goes back; the reply extends the same agent's cache
    back = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    answer = _complete(client, "oa-tools", back, tools=[WEATHER_TOOL], max_tokens=16)
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens


def test_a_forced_call_cut_off_by_max_tokens_comes_back_as_the_call_so_far(
    client: openai.OpenAI, server: tuple[str, Path]
) -> None:
    """It used to come back as ``tool_calls=None, content=''`` (streamed: its text as
    content). As OpenAI does: ``finish_reason="length"`` and the call with its name and the
    arguments' text as far as they went, whole or streamed; ``ChatOpenAI`` makes it an
    ``invalid_tool_calls`` entry."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = _complete(client, "oa-cut", ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=20)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    args = call.function.arguments
    assert call.function.name == "get_weather" and call.id
    assert args and '{"city": "Paris"}'.startswith(args), args
    with pytest.raises(ValueError):
        json.loads(args)

    text, chunks = _stream_text(
        client, "oa-cut-stream", ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=20
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert not text and [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", args)]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server[0] + "/v1",
        api_key=KEY,
        temperature=0,
        max_tokens=20,
        max_retries=0,
        default_headers={"X-Agent-ID": "lc-cut"},
    )
    reply = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke(ask[0]["content"])
    assert reply.response_metadata["finish_reason"] == "length" and not reply.tool_calls
    assert [(c["name"], c["args"]) for c in reply.invalid_tool_calls] == [("get_weather", args)]


def test_json_schema_response_format_parses(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string"}},
        "required": ["color"],
        "additionalProperties": False,
    }
    r = _complete(
        client,
        "oa-json",
        [{"role": "user", "content": "Pick a color."}],
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
    )
    assert set(json.loads(r.choices[0].message.content)) == {"color"}


def test_closing_a_stream_stops_decoding(client: openai.OpenAI, server: tuple[str, Path]) -> None:
    ask = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=200, temperature=0, stream=True, **_agent("oa-cancel")
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    # a second request of the agent waits for the first to end (same-agent requests run in order)
    after = _complete(client, "oa-cancel", ask, max_tokens=1)
    kept = shared_engine(MODEL, cache_dir=server[1]).admin.store.records.get("oa-cancel")
    assert kept is not None
    generated = len(kept.token_ids) - after.usage.prompt_tokens
    assert generated < 100, f"decoding went on after the client left: {generated} tokens kept"


def test_a_failed_save_leaves_the_reply_and_the_previous_cache(
    client: openai.OpenAI, server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply leaves before its save (written on the engine's save thread): a save that
    fails (the index write: disk full) is logged, raised by ``flush``, and leaves the
    agent's previous cache; once writable again the same agent is served and saved."""
    engine = shared_engine(MODEL, cache_dir=server[1])

    def disk_full(self: AgentIndex, record: object, *sync: object) -> int:  # the index write fails
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as mp:
        mp.setattr(AgentIndex, "put", disk_full)
        assert _complete(client, "oa-full", COLORS, max_tokens=4).choices[0].message.content
        assert _stream_text(client, "oa-full-stream", COLORS, max_tokens=12)
        with pytest.raises(CacheWriteError, match="disk is full"):
            engine.flush()
    assert (
        engine.admin.store.records.get("oa-full") is None
        and engine.admin.store.records.get("oa-full-stream") is None
    )
    assert _complete(client, "oa-full", COLORS, max_tokens=4).choices[0].message.content
    engine.flush()
    assert engine.admin.store.records.get("oa-full") is not None


def test_ready_and_the_agents_list_answer_while_a_save_waits(
    client: openai.OpenAI, server: tuple[str, Path], figures: dict[str, str]
) -> None:
    """A load balancer's probe and an operator's list never wait for the saves queued
    (they run on the server's event loop): with the cache directory held by another writer,
    a reply's save waits behind it, and both answer meanwhile, saying what waits. The list
    names the agent whose save waits: its turn was answered (a list right after two chats
    lacked the second, whose save had not landed: the hostile server's fork test, flaky)."""
    engine = shared_engine(MODEL, cache_dir=server[1])
    store = engine.admin.store
    headers = {"Authorization": f"Bearer {KEY}"}
    with store.locked():  # as `agent-memory cache gc` in another process would
        assert _complete(client, "oa-queued", COLORS, max_tokens=4).choices[0].message.content
        started = time.perf_counter()
        ready = httpx.get(server[0] + "/ready", timeout=30)
        listed = httpx.get(server[0] + "/v1/agents", headers=headers, timeout=30)
        took = time.perf_counter() - started
        assert engine.status().queued_saves >= 1  # still waiting when both had answered
    figures["/ready + GET /v1/agents, a save queued"] = f"{took * 1000:.1f} ms for both"
    assert ready.status_code == 200 and ready.json()["models"][MODEL]["queued_saves"] >= 1
    assert listed.status_code == 200
    queued = {a["id"]: a for a in listed.json()["data"]}
    engine.flush()
    assert "oa-queued" in queued, sorted(queued)
    assert queued["oa-queued"]["tokens"] == len(engine.admin.agent_record("oa-queued").token_ids)
    after = httpx.get(server[0] + "/v1/agents", headers=headers).json()["data"]
    assert "oa-queued" in [a["id"] for a in after]


# ------------------------------------------------------------------ langchain-openai


def test_chat_openai_invoke_stream_and_tools(server: tuple[str, Path]) -> None:
    def llm(agent: str, max_tokens: int = 16) -> ChatOpenAI:
        return ChatOpenAI(
            model=MODEL,
            base_url=server[0] + "/v1",
            api_key=KEY,
            temperature=0,
            max_tokens=max_tokens,
            max_retries=0,
            default_headers={"X-Agent-ID": agent},
            stream_usage=True,
        )

    messages = [SystemMessage("You answer briefly."), HumanMessage("Name three colors.")]
    first = llm("lc-agent").invoke(messages)
    assert isinstance(first, AIMessage) and first.content
    assert first.usage_metadata["input_token_details"].get("cache_read", 0) == 0
    second = llm("lc-agent").invoke([*messages, first, HumanMessage("And one more?")])
    assert second.usage_metadata["input_token_details"]["cache_read"] >= first.usage_metadata["input_tokens"]

    chunks = list(llm("lc-stream").stream(messages))
    assert "".join(c.content for c in chunks) == first.content  # both cold: the same reply
    assert (
        sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks)
        == (first.usage_metadata["output_tokens"])
    )

    weather = llm("lc-tools", max_tokens=48).bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    call = weather.invoke("What is the weather in Rome?").tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


# ------------------------------------------------------------------ errors (raw HTTP)


def _post(server: tuple[str, Path], body: Any, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    h = {"Authorization": f"Bearer {KEY}", **(headers or {})}
    content = body if isinstance(body, (bytes, str)) or callable(body) else json.dumps(body)
    if callable(content):
        content = content()
    return httpx.post(server[0] + "/v1/chat/completions", content=content, headers=h, timeout=120, **kw)


def _ok(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize(
    ("body", "headers", "status", "says"),
    [
        (b'{"model": ', {}, 400, "not valid JSON"),
        (json.dumps(_ok()).replace('"hi"', '"\\ud800 hi"'), {}, 400, "lone UTF-16 surrogate"),
        ({"messages": [{"role": "user", "content": "hi"}]}, {}, 400, "model: Field required"),
        ({"model": MODEL, "messages": []}, {}, 400, "messages"),
        (_ok(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "messages.0"),
        (_ok(model="gpt-9"), {}, 404, "not served here"),
        (_ok(n=2), {}, 400, "n is not supported"),
        (_ok(logprobs=True), {}, 400, "logprobs is not supported"),
        (_ok(temperature=5), {}, 400, "temperature"),
        (
            _ok(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            {},
            400,
            "reads text only",
        ),
        (
            _ok(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
            {},
            400,
            "names 'x'",
        ),
        (
            _ok(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            ),
            {},
            400,
            "not JSON",
        ),
        (_ok(), {"X-Agent-ID": "../../etc"}, 400, "looks like a path"),
        (_ok(agent_id="a"), {"X-Agent-ID": "b"}, 400, "differ"),
        (_ok(), {"Authorization": "Bearer wrong"}, 401, "API key"),
        (_ok(), {"Authorization": ""}, 401, "API key"),
    ],
)
def test_malformed_requests_get_clear_4xx(
    server: tuple[str, Path], body: Any, headers: dict[str, str], status: int, says: str
) -> None:
    r = _post(server, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"]


def test_request_limits(server: tuple[str, Path]) -> None:
    big = _ok(messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    declared = _post(server, big)
    assert declared.status_code == 413 and "limit" in declared.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    streamed = _post(server, chunked)
    assert streamed.status_code == 413

    # a prompt over the model's context (8192 tokens) is refused before any work, streamed or not
    long = _ok(messages=[{"role": "user", "content": apache_license() * 4}])
    for stream in (False, True):
        r = _post(server, {**long, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_models_and_health(server: tuple[str, Path], client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server[0] + "/health")  # no key needed: for load balancers
    assert health.status_code == 200 and health.json()["models"] == [MODEL]
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


# ------------------------------------------------------------------ restart


def _serve(cache_dir: Path, port: int) -> subprocess.Popen[bytes]:
    args = ["--cache-dir", str(cache_dir), "--log-level", "warning"]
    return start_server(args, port, env={**os.environ, "AGENT_MEMORY_API_KEY": KEY})


def test_restarted_server_serves_an_agent_warm(tmp_path: Path, figures: dict[str, str]) -> None:
    port = free_port()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    system = {"role": "system", "content": "Answer questions about this license.\n\n" + apache_license()}
    ask = [system, {"role": "user", "content": "Who may use the work?"}]
    times = []
    for turn in range(2):
        proc = _serve(tmp_path, port)
        try:
            t0 = time.perf_counter()
            r = _complete(client, "restart-agent", ask, max_tokens=8)
            times.append((time.perf_counter() - t0, r.model_extra["agent_memory"]))
        finally:
            proc.send_signal(signal.SIGTERM)
            # uvicorn shuts down gracefully, then re-raises the signal it caught
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        if turn == 0:
            first = r
            ask = [*ask, {"role": "assistant", "content": r.choices[0].message.content}]
            ask.append({"role": "user", "content": "And who may not?"})
    cold, warm = times
    assert cold[1]["cache"] == "cold" and warm[1]["cache"] == "warm-extend"
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    figures["server restart, ~2.5K-token agent"] = (
        f"cold TTFT {cold[1]['time_to_first_token_s']:.2f} s (request {cold[0]:.2f} s), "
        f"after restart TTFT {warm[1]['time_to_first_token_s']:.2f} s (request {warm[0]:.2f} s)"
    )


# ------------------------------------------------------------------ issue 21: agents without headers


def test_prompt_cache_key_then_an_explicit_agent_then_user_choose_the_agent(
    server: tuple[str, Path], client: openai.OpenAI
) -> None:
    messages = [{"role": "system", "content": "You help with maps. " * 30}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4, prompt_cache_key="conv-7", user="u1"
    )
    assert first.headers["X-Agent-ID"] == "conv-7"  # prompt_cache_key wins over user
    reply = first.parse().choices[0].message.content
    again = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=4, prompt_cache_key="conv-7",
        messages=[*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}],
    )  # fmt: skip
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.8 * again.usage.prompt_tokens
    by_user = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=2, user="alice@example.com"
    )
    assert by_user.headers["X-Agent-ID"] == "alice@example.com"
    # An explicit agent wins over ``user`` (an app that always sends ``user`` keeps its agents apart)
    explicit = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=2, user="alice@example.com",
        extra_headers={"X-Agent-ID": "planner"},
    )  # fmt: skip
    assert explicit.headers["X-Agent-ID"] == "planner"
    in_body = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=2, user="alice@example.com",
        extra_body={"agent_id": "critic"},
    )  # fmt: skip
    assert in_body.headers["X-Agent-ID"] == "critic"
    # ChatOpenAI passes prompt_cache_key per call
    llm = ChatOpenAI(base_url=server[0] + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=2)
    out = llm.invoke("Hello", prompt_cache_key="lc-conv")
    assert out.response_metadata.get("model_name") and _agent_ids(server) >= {
        "conv-7",
        "alice@example.com",
        "lc-conv",
    }
    # The product's own entries (a checkpointer's snapshots) are listed only when asked for
    auth = {"Authorization": f"Bearer {KEY}"}
    forked = httpx.post(
        server[0] + "/v1/agents/conv-7/fork", json={"to": "@snapshot:feed"}, headers=auth, timeout=60
    )
    assert forked.status_code == 200, forked.text
    assert "@snapshot:feed" not in _agent_ids(server)
    listed = httpx.get(server[0] + "/v1/agents?all=true", headers=auth, timeout=60)
    assert "@snapshot:feed" in {a["id"] for a in listed.json()["data"]}


def _agent_ids(server: tuple[str, Path]) -> set[str]:
    listed = httpx.get(server[0] + "/v1/agents", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert listed.status_code == 200, listed.text
    return {a["id"] for a in listed.json()["data"]}


def test_top_k_and_min_p_are_honoured(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = _complete(client, "sampling", messages, max_tokens=8).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # either leaves only the most likely token
        sampled = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=3, max_tokens=8,
            extra_body=extra, **_agent("sampling"),
        )  # fmt: skip
        assert sampled.choices[0].message.content == greedy, extra


def test_penalties_are_honoured(client: openai.OpenAI, smollm: LoadedModel, tmp_path: Path) -> None:
    """presence / frequency (OpenAI's) and repetition (vLLM's) penalties change a greedy
    reply as ChatAgentMemory's own do (they used to be refused)."""
    messages = [{"role": "user", "content": "Write the word cat many times."}]
    plain = _complete(client, "pen-plain", messages, max_tokens=16).choices[0].message.content
    for i, extra in enumerate(
        ({"repetition_penalty": 1.3}, {"presence_penalty": 1.5, "frequency_penalty": 1.0})
    ):
        sent = (
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                max_tokens=16,
                extra_body=extra,
                **_agent(f"pen-{i}"),
            )
            .choices[0]
            .message.content
        )
        here = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=16, **extra).invoke(messages[0]["content"])
        assert sent == here.content != plain, extra


def test_unsupported_fields_are_refused_by_name_in_openai_error_shapes(server: tuple[str, Path]) -> None:
    r = _post(server, _ok(logit_bias={"42": 5}))
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    wrong_key = _post(server, _ok(), {"Authorization": "Bearer nope"}).json()["error"]
    assert (wrong_key["type"], wrong_key["code"]) == ("invalid_request_error", "invalid_api_key")
    no_model = _post(server, _ok(model="gpt-9")).json()["error"]
    assert (no_model["type"], no_model["code"], no_model["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    bad_key = _post(server, _ok(prompt_cache_key="../x"))
    assert bad_key.status_code == 400 and bad_key.json()["error"]["param"] == "prompt_cache_key"


def test_agents_are_listed_forked_and_deleted_over_http(
    server: tuple[str, Path], client: openai.OpenAI
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "You plan trips. " * 40}, {"role": "user", "content": "Rome?"}]
    _complete(client, "planner-1", messages, max_tokens=4)
    (card,) = [a for a in httpx.get(server[0] + "/v1/agents", headers=auth, timeout=60).json()["data"]
               if a["id"] == "planner-1"]  # fmt: skip
    assert card["tokens"] > 100 and card["blocks"] >= 1 and card["bytes"] > 0 and card["last_used_at"] > 0
    fork = httpx.post(
        server[0] + "/v1/agents/planner-1/fork", json={"to": "planner-2"}, headers=auth, timeout=60
    )
    assert fork.status_code == 200 and fork.json()["forked_from"] == "planner-1", fork.text
    again = httpx.post(
        server[0] + "/v1/agents/planner-1/fork", json={"to": "planner-2"}, headers=auth, timeout=60
    )
    assert again.status_code == 409
    # the fork resumes warm from the shared blocks: no tensor was copied, nothing prefilled twice
    resumed = _complete(client, "planner-2", messages, max_tokens=2)
    assert resumed.usage.prompt_tokens_details.cached_tokens >= 0.9 * resumed.usage.prompt_tokens
    gone = httpx.delete(server[0] + "/v1/agents/planner-1", headers=auth, timeout=60)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert httpx.delete(server[0] + "/v1/agents/planner-1", headers=auth, timeout=60).status_code == 404
    assert "planner-1" not in _agent_ids(server) and "planner-2" in _agent_ids(server)


def test_served_names_cors_and_default_sampling(smollm: LoadedModel, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    config = ServerConfig(
        models=[MODEL], served_names=["team-model"], cache_dir=str(tmp_path), allowed_origins=["http://app.example"],
        temperature=1.0, top_k=1,  # the server's default sampling: top-k 1 is greedy whatever the temperature
        context_length=128, max_disk_bytes="1GB", cache_ttl="7d",
    )  # fmt: skip
    with TestClient(create_app(config)) as http:
        engine = shared_engine(MODEL, cache_dir=tmp_path)
        assert engine.context_length == 128
        assert engine.admin.storage_budget == StorageBudget(max_bytes=10**9, ttl_s=7 * 86400)
        long = {"model": "team-model", "messages": [{"role": "user", "content": "word " * 200}]}
        over = http.post("/v1/chat/completions", json=long)
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["team-model"]
        ask = {
            "model": "team-model",
            "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 6,
        }
        by_default = http.post("/v1/chat/completions", json={**ask, "seed": 5}).json()
        greedy = http.post("/v1/chat/completions", json={**ask, "temperature": 0}).json()
        assert by_default["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        assert http.post("/v1/chat/completions", json={**ask, "model": MODEL}).status_code == 404
        preflight = http.options(
            "/v1/chat/completions",
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        other = http.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_plain_completions_continue_text_exactly(server: tuple[str, Path], client: openai.OpenAI) -> None:
    prompt = "The Apache License, Version 2.0, is a permissive license written by the"
    done = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_headers={"X-Agent-ID": "plain"}
    )
    assert done.headers["X-Agent-ID"] == "plain"
    first = done.parse()
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    text = first.choices[0].text
    assert text.startswith(" ")  # the leading space a continuation needs is kept
    # The oracle: the engine's own tokens for prompt + text are what the model saw.
    engine = shared_engine(MODEL, cache_dir=server[1])
    assert (
        engine.admin.cached_text("plain")
        == prompt + text[: len(engine.admin.cached_text("plain")) - len(prompt)]
    )
    # Continuing from prompt + text extends the cache: only the new words are read.
    more = client.completions.create(
        model=MODEL,
        prompt=prompt + text + " and",
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Agent-ID": "plain"},
    )
    assert more.usage.prompt_tokens_details.cached_tokens >= more.usage.prompt_tokens - 4
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_headers={"X-Agent-ID": "plain-2"},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    refused = _post_to(server, "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True})
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]


def _post_to(server: tuple[str, Path], path: str, body: dict[str, Any]) -> Any:
    return httpx.post(server[0] + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_plain_completions_on_the_gemma3_base_model(gemma: LoadedModel, tmp_path: Path) -> None:
    """A base model (no chat template) served for text completion: the continuation keeps
    its leading space and the next call, prompt + reply + more, reads only the new text."""
    from fastapi.testclient import TestClient

    config = ServerConfig(models=["gemma3-270m"], cache_dir=str(tmp_path))
    with TestClient(create_app(config)) as http:
        ask = {"model": "gemma3-270m", "prompt": "The capital of France is", "max_tokens": 5}
        ask["temperature"] = 0
        first = http.post("/v1/completions", json=ask, headers={"X-Agent-ID": "base"}).json()
        text = first["choices"][0]["text"]
        assert text.startswith(" ") and text.strip()
        engine = shared_engine("gemma3-270m", cache_dir=tmp_path)
        assert engine.admin.cached_text("base").startswith(ask["prompt"] + text.rstrip()[:3])
        more = {**ask, "prompt": ask["prompt"] + text + " It", "max_tokens": 3}
        second = http.post("/v1/completions", json=more, headers={"X-Agent-ID": "base"}).json()
        usage = second["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 3


def test_a_storm_of_chats_forks_and_deletes_answers_each_with_its_true_cause(
    server: tuple[str, Path], figures: dict[str, str]
) -> None:
    """20 clients at once chat with one agent, fork it and delete it and its forks: a fork of
    an agent that exists succeeds (its record is read with the write: a save racing it can
    no longer free the blocks it names), a fork or delete that loses a race with a delete is
    a 404, a fork onto an existing agent a 409; never a 400 or a 5xx."""
    import random
    import threading

    url, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    first = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL, "agent_id": "storm", "max_tokens": 2, "messages": COLORS,
    })  # fmt: skip
    assert first.status_code == 200, first.text
    statuses: list[tuple[str, int, str]] = []

    def client(n: int) -> None:
        rng = random.Random(n)  # fixed per client: the same storm every run
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            for i in range(4):
                op = rng.choice(["chat", "chat", "fork", "fork", "delete-fork", "delete"])
                if op == "chat":
                    turn = [*COLORS, {"role": "user", "content": f"Client {n}, turn {i}: one more?"}]
                    body = {"model": MODEL, "agent_id": "storm", "max_tokens": 2, "messages": turn}
                    reply = http.post("/v1/chat/completions", json=body)
                elif op == "fork":
                    reply = http.post("/v1/agents/storm/fork", json={"to": f"storm-{n}", "replace": True})
                elif op == "delete-fork":
                    reply = http.delete(f"/v1/agents/storm-{rng.randrange(20)}")
                else:
                    reply = http.delete("/v1/agents/storm")
                statuses.append((op, reply.status_code, reply.text[:200]))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [s for s in statuses if s[1] not in (200, 404, 409) or (s[0] == "chat" and s[1] != 200)]
    assert not wrong, wrong
    for op, status, text in statuses:
        if status == 404:
            assert op != "chat" and "no cache here" in text, (op, text)
    counts: dict[str, int] = {}
    for op, status, _ in statuses:
        counts[f"{op} {status}"] = counts.get(f"{op} {status}", 0) + 1
    figures["request storm"] = f"20 clients, {len(statuses)} requests: " + ", ".join(
        f"{k}: {v}" for k, v in sorted(counts.items())
    )
