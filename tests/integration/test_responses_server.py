"""OpenAI's Responses API on the server, driven over loopback by the real clients: the
``openai`` package's ``client.responses`` and ``ChatOpenAI(use_responses_api=True)``. A
chain of responses is an agent: its next turn extends the agent's cache, across a restart
of the server too (a new app on the same cache directory)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from services import app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app
from langchain_agent_memory.testing.server_process import free_port, start_server

KEY = "test-key"
MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("responses")), api_key=KEY)
    with app_on_loopback(create_app(config)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_a_chain_of_three_turns_extends_its_agent_across_a_restart(tmp_path: Path) -> None:
    """Turns 1 and 2 on one server process, turn 3 on the next one (same cache directory):
    ``previous_response_id`` finds the stored chain, and the agent's cache, read from disk,
    holds all of it (``warm-extend``): nothing is prefilled again."""
    port = free_port()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    brief = {"model": MODEL, "instructions": "You are brief.", "max_output_tokens": 8}
    proc = _serve(tmp_path, port)
    try:
        one = client.responses.create(input="Name a fruit.", **brief)
        assert one.status in ("completed", "incomplete") and one.output_text
        assert one.usage.input_tokens_details.cached_tokens == 0
        two = client.responses.create(input="And a vegetable?", previous_response_id=one.id, **brief)
        assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens
        assert two.model_extra["agent_memory"]["cache"] == "hot-extend"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    proc = _serve(tmp_path, port)  # the process restarted
    try:
        assert client.responses.retrieve(two.id).output_text == two.output_text
        three = client.responses.create(input="And a color?", previous_response_id=two.id, **brief)
        assert three.model_extra["agent_memory"]["cache"] == "warm-extend"
        assert three.usage.input_tokens_details.cached_tokens >= two.usage.input_tokens
        assert three.previous_response_id == two.id
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _serve(cache_dir: Path, port: int) -> subprocess.Popen[bytes]:
    args = ["--cache-dir", str(cache_dir), "--log-level", "warning"]
    return start_server(args, port, env={**os.environ, "AGENT_MEMORY_API_KEY": KEY})


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8)
    events = list(client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, stream=True))
    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # cut at max_output_tokens, OpenAI ends the stream with response.incomplete
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    final = events[-1].response
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert final.output_text == deltas == whole.output_text
    assert [ev.sequence_number for ev in events] == list(range(1, len(events) + 1))
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    asked = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48,
    )  # fmt: skip
    (call,) = [o for o in asked.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in call.arguments
    answered = client.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}],
    )  # fmt: skip
    assert answered.model_extra["agent_memory"]["cache"] == "hot-extend"
    listed = client.responses.input_items.list(answered.id)  # this turn's input
    assert [(i.type, i.output) for i in listed.data] == [("function_call_output", "18 C, sunny")]
    (first,) = client.responses.input_items.list(asked.id, order="asc").data
    assert first.type == "message" and first.content[0].text == "What is the weather in Paris?"
    assert client.responses.input_items.list(asked.id).data[0].id == first.id  # stable ids


def test_store_false_keeps_nothing_and_delete_forgets(client: openai.OpenAI) -> None:
    kept = client.responses.create(model=MODEL, input="Name a tree.", max_output_tokens=6)
    unkept = client.responses.create(
        model=MODEL, input="Name a bird.", previous_response_id=kept.id, store=False, max_output_tokens=6
    )
    assert unkept.model_extra["agent_memory"]["cache"].endswith("extend")  # it reused the chain
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        client.responses.create(
            model=MODEL, input="More?", previous_response_id=unkept.id, max_output_tokens=4
        )
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_codex_style_session_resends_its_history_with_store_false(client: openai.OpenAI) -> None:
    """What the Codex CLI sends a local provider: the whole history every turn, with
    ``store: false``, its session id as ``prompt_cache_key``, reasoning and include options,
    streamed. No response is stored, but the session's agent keeps its cache: the second
    turn extends it instead of prefilling the history again."""
    session = "codex session 0195f1c2"
    codex = {
        "model": MODEL, "instructions": "You are a coding agent. Answer briefly.", "store": False,
        "prompt_cache_key": session, "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 8, "stream": True,
    }  # fmt: skip

    def said(text: str) -> dict:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    history: list[dict] = [said("Hi.")]
    first = list(client.responses.create(input=history, **codex))[-1].response
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append(said("Why?"))
    two = list(client.responses.create(input=history, **codex))[-1].response
    assert two.model_extra["agent_memory"]["cache"] == "hot-extend"
    assert two.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store: false: nothing to retrieve
        client.responses.retrieve(two.id)


def test_chat_openai_on_the_responses_api(client: openai.OpenAI) -> None:
    llm = ChatOpenAI(
        model=MODEL, base_url=str(client.base_url), api_key=KEY, use_responses_api=True, max_tokens=8,
        max_retries=0,
    )  # fmt: skip
    reply = llm.invoke([HumanMessage("Say hello.")])
    assert reply.text and reply.usage_metadata and reply.usage_metadata["input_tokens"] > 0
    assert "".join(c.text for c in llm.stream([HumanMessage("Say hello.")])) == reply.text
    roomy = llm.model_copy(update={"max_tokens": 48})  # room for the whole call
    call = roomy.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"


def test_a_chain_goes_on_on_another_worker_of_a_shared_store(
    smollm: LoadedModel, shared_store: tuple[str, str], tmp_path: Path
) -> None:
    """Two servers on one shared store (PostgreSQL + S3), each with its own cache
    directory: a chain begun on one continues on the other, which reads the stored chain
    from the database and the agent's blocks from the store (``warm-extend``)."""
    store, blocks = shared_store
    clients = []
    with contextlib.ExitStack() as stack:
        for worker in ("a", "b"):
            config = ServerConfig(
                models=[MODEL], cache_dir=str(tmp_path / worker), api_key=KEY, store=store, blocks=blocks
            )
            url = stack.enter_context(app_on_loopback(create_app(config)))
            clients.append(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0))
        a, b = clients
        one = a.responses.create(
            model=MODEL, input="Name a fruit.", max_output_tokens=8, extra_body={"wait_for_save": True}
        )
        assert one.model_extra["agent_memory"]["cache_saved"] is True  # in the shared store
        two = b.responses.create(
            model=MODEL, input="And a color?", previous_response_id=one.id, max_output_tokens=8
        )
        assert two.model_extra["agent_memory"]["cache"] == "warm-extend"
        assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens
        assert a.responses.retrieve(two.id).id == two.id  # stored for every worker
