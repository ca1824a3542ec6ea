"""Replies parsed into text and tool calls, in the documented Hermes format and in each
family's own (``prompt.parse_reply``, ``tool_formats``): no model needed."""

from __future__ import annotations

from tool_templates import CASES, TemplateTokenizer

from langchain_agent_memory.chat import prompt
from langchain_agent_memory.chat.tool_formats import tool_format


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
