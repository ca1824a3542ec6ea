"""What LangChain users rely on beyond the standard suite: token counting in the model's
own tokenizer (offline), the model profile, context overflow as LangChain's error, fan-out
(``batch`` items and ``Send`` tasks each on their own agent, the shared prefix prefilled
once)."""

from __future__ import annotations

import asyncio
import json
import operator
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
from langchain_core.exceptions import ContextOverflowError
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from langchain_agent_memory import ChatAgentMemory, corpus
from langchain_agent_memory.engine.model.loading import LoadedModel


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_tokens_are_counted_with_the_models_tokenizer(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2)
    text = "Agents resume from their caches."
    assert llm.get_token_ids(text) == smollm.tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_num_tokens(text) == len(smollm.tokenizer.encode(text, add_special_tokens=False))
    history = [SystemMessage("You are terse."), HumanMessage("What is a KV cache?")]
    counted = llm.get_num_tokens_from_messages(history)
    reply = llm.invoke(history, agent_id="count-plain")
    # a call reads the messages and then the generation prompt (``<|im_start|>assistant\n``)
    generation_prompt = len(smollm.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert reply.usage_metadata is not None
    assert reply.usage_metadata["input_tokens"] == counted + generation_prompt
    # the tool listing is part of what the model reads
    with_tools = llm.get_num_tokens_from_messages(history, tools=[get_weather])
    assert with_tools > counted + 20
    reply = llm.bind_tools([get_weather]).invoke(history, agent_id="count-tools")
    assert reply.usage_metadata is not None
    assert reply.usage_metadata["input_tokens"] == with_tools + generation_prompt


def test_trim_messages_counts_with_the_model(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path))
    history = [SystemMessage("You are terse.")]
    for i in range(12):
        history += [HumanMessage(f"Question {i}: what is {i} squared?"), AIMessage(f"It is {i * i}.")]
    history.append(HumanMessage("And 13?"))
    kept = trim_messages(history, max_tokens=120, token_counter=llm, strategy="last", include_system=True)
    assert kept[0] == history[0] and kept[-1] == history[-1] and len(kept) < len(history)
    assert llm.get_num_tokens_from_messages(kept) <= 120


def test_counts_of_partial_lists_add_up(smollm: LoadedModel, tmp_path: Path) -> None:
    """SmolLM2's template adds a default system prompt to a list without one: a human message
    alone counted 34 tokens, with a system message before it 23, and ``trim_messages`` then
    kept the system message only. A list counts what its own messages add."""
    llm = ChatAgentMemory(cache_dir=str(tmp_path))
    system = SystemMessage("You are a terse assistant.")
    human = HumanMessage("What is the capital of France? Answer in one word please.")
    alone, both = llm.get_num_tokens_from_messages([human]), llm.get_num_tokens_from_messages([system, human])
    assert both == alone + llm.get_num_tokens_from_messages([system])
    kept = trim_messages([system, human], max_tokens=both, token_counter=llm, include_system=True)
    assert kept == [system, human]
    history = [system, human, AIMessage("Paris."), HumanMessage("And of Italy?")]
    kept = trim_messages(
        history, max_tokens=both + 5, token_counter=llm, include_system=True, strategy="last"
    )
    assert kept[0] == system and kept[-1] == history[-1] and len(kept) >= 3


def test_a_per_call_option_with_a_typo_is_refused_with_the_nearest_name(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """``invoke("hi", max_token=3)`` generated its usual reply without a word."""
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=4)
    with pytest.raises(ValueError, match=r"'temprature' \(did you mean 'temperature'\?\)"):
        llm.invoke("hi", temprature=0.2)
    with pytest.raises(ValueError, match=r"'max_token' \(did you mean 'max_tokens'\?\)"):
        list(llm.stream("hi", max_token=3))
    with pytest.raises(ValueError, match="temprature"):
        llm.bind(temprature=0.2)  # named at the bind, not at a later call
    with pytest.raises(ValueError, match="max_token"):
        asyncio.run(llm.ainvoke("hi", max_token=3))
    reply = llm.bind(max_tokens=2).invoke("hi", agent_id="typo-check")  # known options work
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] <= 2


def test_profile_and_context_length_come_from_the_model(smollm: LoadedModel, tmp_path: Path) -> None:
    chat = ChatAgentMemory(cache_dir=str(tmp_path))
    assert chat.profile is not None
    assert chat.profile["max_input_tokens"] == 8192 == chat.context_length
    assert chat.profile["tool_calling"] and chat.profile["structured_output"]
    assert not chat.profile["image_inputs"]
    base = ChatAgentMemory(model="gemma3-270m", cache_dir=str(tmp_path))  # not loaded: profile only
    assert base.profile is not None
    assert base.profile["max_input_tokens"] == 32768 and not base.profile["tool_calling"]
    assert ChatAgentMemory(cache_dir=str(tmp_path), profile={"max_input_tokens": 100}).profile == {
        "max_input_tokens": 100
    }


def test_a_context_length_of_its_own_bounds_one_models_calls(smollm: LoadedModel, tmp_path: Path) -> None:
    """``ChatAgentMemory(context_length=N)``: this model's calls hold at most N tokens (the
    engine, shared with other models of the process, keeps its own), and its profile says N
    to a trimming middleware."""
    small = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2, context_length=64)
    assert (
        small.context_length == 64 and small.profile is not None and small.profile["max_input_tokens"] == 64
    )
    text = corpus.apache_license()[:1000]
    with pytest.raises(ContextOverflowError, match="reads at most 64"):
        small.invoke([HumanMessage(text)], agent_id="small")
    roomy = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2)
    assert roomy.context_length == 8192 and roomy.invoke([HumanMessage(text)], agent_id="roomy").content


def test_an_over_long_prompt_raises_context_overflow(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=2)
    text = corpus.apache_license()
    while llm.get_num_tokens(text) < 9000:
        text += "\n" + text
    with pytest.raises(ContextOverflowError, match="reads at most 8192"):
        llm.invoke([HumanMessage(text)], agent_id="too-long")
    # the agent is intact: a normal call still works
    assert llm.invoke([HumanMessage("Hi")], agent_id="too-long").usage_metadata is not None


def test_batch_items_get_their_own_agents(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=3)
    system = SystemMessage("You answer in one word.\n\n" + corpus.apache_license()[:900])
    questions = [[system, HumanMessage(f"Question {i}: is it free?")] for i in range(4)]
    replies = llm.batch(questions)
    assert [r.response_metadata["agent_id"] for r in replies] == [f"default#{i}" for i in range(4)]
    assert sorted(r.response_metadata["cache"] for r in replies)[-3:] == ["hot-shared"] * 3
    # the next round: each item extends its own cache
    again = llm.batch([[*q, r, HumanMessage("Why?")] for q, r in zip(questions, replies, strict=True)])
    assert all(r.response_metadata["cache"] == "hot-extend" for r in again)
    # an explicit agent keeps them on one agent
    one = llm.batch(questions[:2], agent_id="solo")
    assert {r.response_metadata["agent_id"] for r in one} == {"solo"}


class MapState(TypedDict):
    questions: list[str]
    answers: Annotated[list[tuple[str, str]], operator.add]


def test_send_map_reduce_runs_each_item_on_its_own_agent(smollm: LoadedModel, tmp_path: Path) -> None:
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=3)
    doc = corpus.apache_license()[:900]

    def fan_out(state: MapState) -> list[Send]:
        return [Send("answer", {"question": q}) for q in state["questions"]]

    def answer(item: dict) -> dict:
        reply = llm.invoke(
            [SystemMessage("Answer from this text.\n\n" + doc), HumanMessage(item["question"])]
        )
        return {"answers": [(reply.response_metadata["agent_id"], reply.response_metadata["cache"])]}

    g = StateGraph(MapState)
    g.add_node("answer", answer)
    g.add_conditional_edges(START, fan_out, ["answer"])
    g.add_edge("answer", END)
    app = g.compile(checkpointer=InMemorySaver())
    questions = [f"Question {i}: who may use it?" for i in range(4)]
    out = app.invoke({"questions": questions, "answers": []}, {"configurable": {"thread_id": "t1"}})
    agents = sorted(a for a, _ in out["answers"])
    assert agents == [f"t1:answer#{i}" for i in range(4)]
    assert sorted(c for _, c in out["answers"])[-3:] == ["hot-shared"] * 3
    assert llm.engine.stats()["max_decode_batch"] >= 2


def test_the_chat_model_serializes_and_loads_back() -> None:
    """``dumpd`` / ``load`` as for LangChain's own chat models: the constructor arguments
    round trip (no model is loaded to build it)."""
    import warnings

    from langchain_core.load import dumpd, load

    llm = ChatAgentMemory(max_tokens=5, temperature=0.3, agent_id="a1", cache_dir="/tmp/x")
    assert ChatAgentMemory.is_lc_serializable()
    dumped = dumpd(llm)
    assert dumped["id"][-1] == "ChatAgentMemory" and dumped["kwargs"]["max_tokens"] == 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load is marked beta
        back = load(dumped, valid_namespaces=["langchain_agent_memory"], allowed_objects=[ChatAgentMemory])
    assert isinstance(back, ChatAgentMemory)
    assert (back.max_tokens, back.temperature, back.agent_id, back.cache_dir) == (5, 0.3, "a1", "/tmp/x")


def test_an_unknown_argument_is_refused_with_the_nearest_name() -> None:
    """``temprature=0.7`` used to leave the temperature at 0.0 without a word."""
    with pytest.raises(ValueError, match=r"'temprature' \(did you mean 'temperature'\?\)"):
        ChatAgentMemory(temprature=0.7)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown argument"):
        ChatAgentMemory(max_tokenz=5, model_provider="x")  # type: ignore[call-arg]
    # LangChain's own fields and aliases are known
    llm = ChatAgentMemory(stop_sequences=["\n"], tags=["t"], metadata={"k": 1}, disable_streaming=False)
    assert llm.stop == ["\n"] and llm.tags == ["t"]


def test_streaming_true_streams_invoke_to_callbacks(smollm: LoadedModel, tmp_path: Path) -> None:
    """``streaming=True`` as on LangChain's other chat models: ``invoke`` streams, and a
    callback handler hears each piece (``on_llm_new_token``)."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Pieces(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: object) -> None:
            self.tokens.append(token)

    heard = Pieces()
    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=6, streaming=True, callbacks=[heard])
    reply = llm.invoke("Say hello.")
    assert len(heard.tokens) >= 2 and "".join(heard.tokens).strip() == str(reply.content).strip()
    quiet = Pieces()
    ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=6, callbacks=[quiet]).invoke("Say hello.")
    assert quiet.tokens == []  # not streaming: one result, no pieces


def test_a_structured_reply_cut_off_by_max_tokens_is_an_error_not_a_repaired_object(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """A reply that ran out of tokens inside the object used to come back "repaired" by the
    partial-JSON parser (``Person(hobbies=['chess', 'ten'])``, no error). Now it raises; with
    ``include_raw=True`` it is the ``parsing_error`` beside the raw message."""
    from langchain_core.exceptions import OutputParserException
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str
        hobbies: list[str] = Field(max_length=3)  # SmolLM2 lists hobbies forever otherwise

    question = "Invent a person with many hobbies."
    short = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=5)
    with pytest.raises(OutputParserException, match="cut off at max_tokens"):
        short.with_structured_output(Person).invoke(question)
    out = short.with_structured_output(Person, include_raw=True).invoke(question)
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    assert out["raw"].response_metadata["finish_reason"] == "length"
    whole = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=200, max_string_chars=16)
    person = whole.with_structured_output(Person, method="json_schema", include_raw=True).invoke(question)
    assert isinstance(person["parsed"], Person), person
    # only the schema's keys: the object is closed (it used to grow keys until the budget ran out)
    assert set(json.loads(person["raw"].content)) == {"name", "hobbies"}


def test_langchain_create_agent_runs_on_the_chat_model_and_the_saver(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """LangChain 1.x's ``create_agent`` (``create_react_agent``'s successor) with
    ``ChatAgentMemory`` and ``AgentMemorySaver``, and a summarisation middleware that trims
    the history: every turn of the thread runs, the agent's next turn reuses its cache, and
    the summariser's calls keep a cache of their own (they never overwrite the agent's)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import SummarizationMiddleware

    from langchain_agent_memory import AgentMemorySaver

    llm = ChatAgentMemory(cache_dir=str(tmp_path), max_tokens=8)
    summarise = SummarizationMiddleware(model=llm, trigger=("messages", 6), keep=("messages", 2))
    with AgentMemorySaver(cache_dir=tmp_path) as saver:
        agent = create_agent(
            llm,
            tools=[get_weather],
            system_prompt="You answer briefly.",
            middleware=[summarise],
            checkpointer=saver,
        )
        config = {"configurable": {"thread_id": "lc1"}}
        replies = []
        for question in ("Hello!", "What is 2+2?", "Name a colour.", "Name a fruit.", "Thanks."):
            state = agent.invoke({"messages": [HumanMessage(question)]}, config)
            replies.append(state["messages"][-1])
        assert all(isinstance(r, AIMessage) for r in replies)
        assert replies[1].response_metadata["cached_tokens"] > 0  # the second turn reused the first's cache
        agents = {r.agent_id for r in llm.engine.admin.agent_records("lc1:")}
        assert any(a.startswith("lc1:model") for a in agents), agents
        assert len(agents) >= 2, agents  # the summariser's calls: an agent of their own
