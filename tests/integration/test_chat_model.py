"""ChatAgentMemory beyond the standard suite: the cache is reused across turns, LangGraph
threads and nodes get their own caches, tools and structured output are valid, messages
of every kind render."""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel

from langchain_agent_memory import ChatAgentMemory, corpus
from langchain_agent_memory.engine.model.loading import LoadedModel

SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:2400]


def test_second_turn_reads_the_first_from_the_cache(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), agent_id="lawyer", max_tokens=12)
    history = [SystemMessage(SYSTEM), HumanMessage("What is this license called?")]
    first = llm.invoke(history)
    history += [first, HumanMessage("Can I use it commercially?")]
    second = llm.invoke(history)
    u1, u2 = first.usage_metadata, second.usage_metadata
    assert u1 is not None and u2 is not None
    assert u1["input_token_details"]["cache_read"] == 0 and u1["input_tokens"] > 500
    assert u2["input_token_details"]["cache_read"] >= u1["input_tokens"]
    assert second.response_metadata["cache"] == "hot-extend"
    assert (
        second.response_metadata["time_to_first_token_s"] < first.response_metadata["time_to_first_token_s"]
    )


def test_wait_for_save_replies_with_the_saves_outcome(smollm: LoadedModel, tmp_path: Path) -> None:
    """By default a reply leaves before its save ("pending"); with ``wait_for_save`` each
    reply (invoke, ainvoke, stream, astream) says how its save ended, and the agent's record
    holds the turn by then."""
    import asyncio

    quick = ChatAgentMemory(cache_dir=str(tmp_path), agent_id="quick", max_tokens=2)
    assert quick.invoke("Hello.").response_metadata["cache_saved"] == "pending"
    quick.flush()
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2, wait_for_save=True)
    replies = {"invoke": llm.invoke("Hello.", agent_id="a1")}
    streamed = list(llm.stream("Hello.", agent_id="a2"))
    replies["stream"] = sum(streamed[1:], start=streamed[0])

    async def async_calls() -> None:
        replies["ainvoke"] = await llm.ainvoke("Hello.", agent_id="a3")
        chunks = [c async for c in llm.astream("Hello.", agent_id="a4")]
        replies["astream"] = sum(chunks[1:], start=chunks[0])

    asyncio.run(async_calls())
    for how, reply in replies.items():
        assert reply.response_metadata["cache_saved"] is True, how
    for agent in ("a1", "a2", "a3", "a4"):
        record = llm.engine.admin.agent_record(agent)
        assert record is not None and "Hello." in record.text, agent


class _State(TypedDict):
    log: Annotated[list[str], operator.add]


def test_langgraph_nodes_and_threads_get_their_own_caches(smollm: LoadedModel, tmp_path: Path) -> None:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)

    def node(name: str):  # type: ignore[no-untyped-def]
        def run(state: _State) -> dict:
            reply = llm.invoke([HumanMessage(f"Say hello to {name}.")])
            return {"log": [reply.response_metadata["agent_id"]]}

        return run

    g = StateGraph(_State)
    g.add_node("planner", node("the planner"))
    g.add_node("writer", node("the writer"))
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    app = g.compile(checkpointer=InMemorySaver())
    one = app.invoke({"log": []}, {"configurable": {"thread_id": "t1"}})["log"]
    two = app.invoke({"log": []}, {"configurable": {"thread_id": "t2"}})["log"]
    assert one == ["t1:planner", "t1:writer"]
    assert two[-2:] == ["t2:planner", "t2:writer"]
    engine = llm.engine
    assert all(
        engine.admin.cached_tokens(a) > 0 for a in ["t1:planner", "t1:writer", "t2:planner", "t2:writer"]
    )


def test_subgraph_nodes_nest_under_their_parent(smollm: LoadedModel, tmp_path: Path) -> None:
    from langgraph.graph import END, START, StateGraph

    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2)

    def critic(state: _State) -> dict:
        return {"log": [llm.invoke("Hi").response_metadata["agent_id"]]}

    inner = StateGraph(_State)
    inner.add_node("critic", critic)
    inner.add_edge(START, "critic")
    inner.add_edge("critic", END)
    outer = StateGraph(_State)
    outer.add_node("team", inner.compile())
    outer.add_edge(START, "team")
    outer.add_edge("team", END)
    log = outer.compile().invoke({"log": []})["log"]
    assert log == ["no-thread:team|critic"]


def test_every_message_kind_renders_and_the_reply_extends_the_cache(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), agent_id="tools", max_tokens=8)
    call = {"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"}
    messages = [
        SystemMessage([{"type": "text", "text": "You can add numbers."}]),
        HumanMessage([{"type": "text", "text": "What is 2 + 3?"}]),
        AIMessage("", tool_calls=[call]),
        ToolMessage("5", tool_call_id="call_1"),
    ]
    reply = llm.invoke(messages)  # no trailing human message: allowed
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0
    text = llm.engine.admin.cached_text("tools")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    with pytest.raises(ValueError, match="text only"):
        llm.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])


def _magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input + 2


@pytest.mark.parametrize(
    "choice", ["any", "_magic_function", {"type": "function", "function": {"name": "_magic_function"}}]
)
def test_forced_tool_choice_yields_a_valid_call(smollm: LoadedModel, tmp_path: Path, choice: object) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path)).bind_tools([_magic_function], tool_choice=choice)
    for reply in (
        llm.invoke("What is magic_function(3)?"),
        _joined(llm.stream("What is magic_function(3)?")),
    ):
        assert len(reply.tool_calls) == 1, reply
        call = reply.tool_calls[0]
        assert call["name"] == "_magic_function" and isinstance(call["args"]["input"], int)
        assert set(call["args"]) == {"input"}


def _get_weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny"


def test_a_forced_call_cut_off_by_max_tokens_is_an_invalid_call_not_nothing(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """A forced call cut off by ``max_tokens`` used to come back with no name
    (``invalid_tool_calls[0]["args"]`` the whole ``{"name": ..., "arguments": ...`` payload):
    now it is the call as far as it went, its name and the arguments' text (as OpenAI returns
    it), ``finish_reason="length"``; streamed, it comes back as the text it was (a chunk's
    tool calls are re-parsed leniently: a cut call would pass as a whole one)."""
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=20)
    forced = llm.bind_tools([_get_weather], tool_choice="any")
    reply = forced.invoke("What is the weather in Paris?")
    assert reply.response_metadata["finish_reason"] == "length"
    assert not reply.tool_calls and reply.content == "" and len(reply.invalid_tool_calls) == 1, reply
    cut = reply.invalid_tool_calls[0]
    assert cut["name"] == "_get_weather" and cut["args"] and '{"city": "Paris"}'.startswith(cut["args"]), cut
    with pytest.raises(ValueError):
        json.loads(cut["args"])
    streamed = _joined(forced.stream("What is the weather in Paris?"))
    assert streamed.response_metadata["finish_reason"] == "length" and not streamed.tool_calls
    assert '"name": "_get_weather"' in streamed.text and streamed.text.endswith(cut["args"]), streamed
    # with_structured_output's forced call: an error, as for a JSON reply cut short
    with pytest.raises(OutputParserException, match="cut off at max_tokens"):
        llm.with_structured_output(_get_weather, method="function_calling").invoke("Weather in Paris?")


def test_unknown_tool_choice_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not among the bound tools"):
        ChatAgentMemory(cache_dir=str(tmp_path)).bind_tools([_magic_function], tool_choice="nope")


class _Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_is_validated(smollm: LoadedModel, tmp_path: Path, method: str) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path))
    question = "Alice is 31 years old. Give her name and age as JSON."
    if method == "json_mode":
        out = llm.with_structured_output({"type": "object"}, method="json_mode").invoke(question)
        assert isinstance(out, dict)
    else:
        out = llm.with_structured_output(_Person, method=method).invoke(question)  # type: ignore[arg-type]
        assert isinstance(out, _Person)
        assert (out.name, out.age) == ("Alice", 31)


class _Joke(BaseModel):
    setup: str
    punchline: str


def test_constrained_strings_keep_to_max_string_chars(smollm: LoadedModel, tmp_path: Path) -> None:
    """SmolLM2 loops inside a free string ("The cat was a cat and it was a cat and ..."): the
    cap closes it and the object completes; a forced tool call's arguments keep to it too."""
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_string_chars=24)
    joke = llm.with_structured_output(_Joke).invoke("Tell me a joke about cats")
    assert isinstance(joke, _Joke) and joke.setup and joke.punchline
    assert max(len(joke.setup), len(joke.punchline)) <= 24, joke

    def shout(text: str) -> str:
        """Repeat the text in capitals."""
        return text.upper()

    call = llm.bind_tools([shout], tool_choice="shout").invoke("Shout a long sentence about cats.")
    assert len(call.tool_calls) == 1 and 0 < len(call.tool_calls[0]["args"]["text"]) <= 24, call
    # A cap of its own per call (an ``invoke`` kwarg):
    longer = llm.with_structured_output(_Joke).invoke("Tell me a joke about cats", max_string_chars=60)
    assert isinstance(longer, _Joke) and 24 < max(len(longer.setup), len(longer.punchline)) <= 60, longer


def _joined(chunks):  # type: ignore[no-untyped-def]
    chunks = list(chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert chunks[-1].chunk_position == "last"
    return full
