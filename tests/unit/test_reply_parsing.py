"""Replies parsed into text and tool calls, in the documented Hermes format and in each
family's own (``prompt.parse_reply``, ``tool_formats``): no model needed."""

from __future__ import annotations

from tool_templates import CASES, TemplateTokenizer

from langchain_agent_memory.chat import prompt
from langchain_agent_memory.chat.tool_formats import HERMES, tool_format


def test_reply_text_and_calls_are_parsed() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls, invalid = prompt.parse_reply(text)
    assert content == "Let me add."
    assert [(c["name"], c["args"]) for c in calls] == [("add", {"a": 1})] and not invalid
    assert calls[0]["id"] and calls[0]["id"].startswith("call_")


def test_a_cut_off_or_malformed_call_is_invalid_not_lost() -> None:
    _, calls, invalid = prompt.parse_reply('<tool_call>\n{"name": "add", "argum')
    assert not calls and len(invalid) == 1 and invalid[0]["args"].startswith('{"name"')
    assert prompt.parse_reply("no calls here") == ("no calls here", [], [])


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_replies_parse_in_each_format() -> None:
    fmts = {f: tool_format(TemplateTokenizer(CASES[f][0])) for f in CASES}
    samples = {
        "qwen3": f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
        "llama": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "gpt_oss": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + '{"city": "Oslo"}<|call|>',
    }
    for family, text in samples.items():
        content, calls, invalid = fmts[family].parse(text)
        assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Oslo"})], family
        assert not invalid and "get_weather" not in content
    # prose is prose
    assert fmts["llama"].parse("{curly} is not a call")[1] == []
    assert fmts["qwen3"].parse("no call here") == ("no call here", [], [])


def test_a_forced_call_cut_short_keeps_its_name_and_the_arguments_so_far() -> None:
    """A forced call cut off by ``max_tokens`` is an invalid call with its name and the
    arguments' text as far as they went (it used to be the whole payload, name unknown, or
    nothing: Llama 3's became text); one whose arguments were complete is a call."""
    fmts = {f: tool_format(TemplateTokenizer(CASES[f][0])) for f in CASES}
    fmts["hermes"] = HERMES
    cut = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
        "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
        "llama": '{"name": "get_weather", "parameters": {"city": "Os',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Os',
        "gpt_oss": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Os',
    }
    for family, text in cut.items():
        call = fmts[family].cut_call(text, ["get_weather", "get_time"])
        assert call["type"] == "invalid_tool_call", family
        assert (call["name"], call["args"]) == ("get_weather", '{"city": "Os'), family
        assert call["id"] and "cut off" in call["error"]  # type: ignore[typeddict-item]
    # cut before its name: the only tool it can be, or none; no arguments yet
    assert fmts["qwen3"].cut_call('<tool_call>\n{"na', ["get_weather"])["name"] == "get_weather"
    early = fmts["qwen3"].cut_call('<tool_call>\n{"name": "get_', ["get_weather", "get_time"])
    assert (early["name"], early["args"]) == (None, "")
    # the arguments whole, only the closing text cut: a call
    whole = HERMES.cut_call(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool', ["x"]
    )
    assert whole["type"] == "tool_call" and (whole["name"], whole["args"]) == (
        "get_weather",
        {"city": "Oslo"},
    )
