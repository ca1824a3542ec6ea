"""Anthropic's Messages API on the server, driven over loopback by the real clients: the
``anthropic`` package and ``langchain-anthropic``'s ``ChatAnthropic`` (raw HTTP only to look
at the wire). The server runs in this process (uvicorn on a thread) on the session's model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, SystemMessage
from services import app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

KEY = "test-key"
MODEL = "smollm2-135m"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(
        models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("anthropic")), api_key=KEY,
        model_aliases={"claude-*-haiku-*": MODEL},  # Claude Code's background model
    )  # fmt: skip
    with app_on_loopback(create_app(config)) as url:
        yield url


@pytest.fixture
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def _user(agent: str) -> dict[str, Any]:
    return {"metadata": {"user_id": agent}}


def test_a_tool_loop_over_two_turns_reads_the_first_from_the_agents_cache(
    client: anthropic.Anthropic,
) -> None:
    """Claude Code's loop: the model calls a tool (``tool_use``), the client answers with a
    ``tool_result`` and the whole history; the second turn extends the agent's cache."""
    first = client.messages.create(
        model=MODEL, max_tokens=48, system="You check the weather with tools.", messages=ASK,
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, **_user("loop"),
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0

    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}],
        },
    ]
    second = client.messages.create(
        model=MODEL, max_tokens=16, system="You check the weather with tools.", messages=history,
        tools=[WEATHER], **_user("loop"),
    )  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    u = second.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert u.cache_read_input_tokens >= first.usage.cache_creation_input_tokens > 0
    assert 0 < u.cache_creation_input_tokens < prompt  # only the tool result and what follows
    assert second.model_extra and second.model_extra["agent_memory"]["cache"].endswith("extend")


def test_streaming_events_come_in_anthropics_order_and_equal_the_whole_reply(
    client: anthropic.Anthropic,
) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, **_user("whole"))
    kinds = []
    with client.messages.stream(model=MODEL, max_tokens=12, messages=ASK, **_user("streamed")) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    wire = [k for k in kinds if k in _WIRE]  # the SDK adds its own ("text") beside them
    assert wire[0] == "message_start" and wire[-2:] == ["message_delta", "message_stop"]
    assert wire[1] == "content_block_start" and wire[-3] == "content_block_stop"
    assert set(wire[2:-3]) == {"content_block_delta"}


_WIRE = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
         "message_delta", "message_stop"}  # fmt: skip


def test_a_streamed_forced_tool_call_arrives_as_a_tool_use_block(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL, max_tokens=48, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, **_user("streamed-tool"),
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather" and "city" in use.input


def test_a_stop_sequence_is_named_in_the_reply(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = client.messages.create(model=MODEL, max_tokens=30, messages=msgs, **_user("count-free"))
    text = free.content[0].text
    assert "3" in text, text
    cut = client.messages.create(
        model=MODEL, max_tokens=30, messages=msgs, stop_sequences=["3"], **_user("count-cut")
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "3"
    assert cut.content[0].text == text[: text.index("3")]


def test_count_tokens_counts_what_the_model_reads(client: anthropic.Anthropic, server: str) -> None:
    from langchain_agent_memory import ChatAgentMemory

    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=[WEATHER])
    llm = ChatAgentMemory(model=MODEL)
    tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}  # fmt: skip
    expected = llm.get_num_tokens_from_messages(
        [SystemMessage("Be brief."), HumanMessage(ASK[0]["content"])], tools=[tool]
    )
    assert counted.input_tokens == expected > 0


def test_errors_come_in_anthropics_shape(client: anthropic.Anthropic, server: str) -> None:
    bad_key = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.NotFoundError, match=r"not served here.*aliases: claude-\*-haiku-\*="):
        client.messages.create(model="claude-opus-9", max_tokens=4, messages=ASK)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="'image' are not supported"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    r = httpx.post(
        f"{server}/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": ASK}
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_a_model_alias_reaches_the_served_model(client: anthropic.Anthropic) -> None:
    """A harness's own model names (Claude Code's background model) reach the served model
    through ``--model-alias``; a name no alias matches is still a 404 (above), and an alias
    to a model not served fails when the app is made."""
    reply = client.messages.create(model="claude-3-5-haiku-20241022", max_tokens=4, messages=ASK)
    assert reply.content and reply.usage.output_tokens > 0
    with pytest.raises(ValueError, match="names 'smollm3', which is not served"):
        create_app(ServerConfig(models=[MODEL], model_aliases={"claude-*": "smollm3"}))


def test_chat_anthropic_invoke_stream_and_tools(server: str) -> None:
    """LangChain's own Anthropic chat model, pointed at this server."""
    llm = ChatAnthropic(
        model=MODEL, base_url=server, api_key=KEY, max_tokens=16, temperature=0, max_retries=0
    )
    reply = llm.invoke([SystemMessage("Be brief."), HumanMessage("Say hello.")])
    assert reply.text and reply.usage_metadata and reply.usage_metadata["input_tokens"] > 0
    streamed = "".join(c.text for c in llm.stream([SystemMessage("Be brief."), HumanMessage("Say hello.")]))
    assert streamed == reply.text
    caller = llm.bind_tools([WEATHER], tool_choice="get_weather")
    call = caller.invoke("What is the weather in Paris?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"


def test_agent_ids_in_a_header_and_in_metadata(client: anthropic.Anthropic, server: str) -> None:
    saved = {"extra_body": {"wait_for_save": True}}  # listed once the reply is here
    client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, extra_headers={"X-Agent-ID": "été 1"}, **saved
    )
    client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, metadata={"user_id": "session 2"}, **saved
    )
    listed = httpx.get(f"{server}/v1/agents", headers={"Authorization": f"Bearer {KEY}"}).json()
    ids = {a["id"] for a in listed["data"]}
    assert {"été 1", "session 2"} <= ids


def test_context_scale_multiplies_the_prompt_counts_clients_see(smollm: LoadedModel, tmp_path: Path) -> None:
    """Claude Code assumes 200K tokens of context: a server told the model holds 1/25 of
    that reports prompts 25 times their size, so the harness compacts in time; the output
    counts and what the engine does are unchanged."""
    counts = {}
    for scale in (1.0, 25.0):
        config = ServerConfig(
            models=[MODEL], cache_dir=str(tmp_path / str(scale)), api_key=KEY, context_scale=scale
        )
        with app_on_loopback(create_app(config)) as url:
            client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
            reply = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, **_user("scaled"))
            counted = client.messages.count_tokens(model=MODEL, messages=ASK)
            u = reply.usage
            counts[scale] = (u.cache_creation_input_tokens + u.cache_read_input_tokens, counted.input_tokens,
                             u.output_tokens)  # fmt: skip
    (prompt, counted, out), (prompt25, counted25, out25) = counts[1.0], counts[25.0]
    assert prompt25 == 25 * prompt and counted25 == 25 * counted and out25 == out
