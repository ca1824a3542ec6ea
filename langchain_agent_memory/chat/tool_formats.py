"""Each model's own tool-call format: how tools reach the prompt, how calls are written
back, parsed from a reply, and forced (grammar-constrained) when ``tool_choice`` asks.

A chat template that renders tools itself (``tools=``) gets them that way, with calls and
results as the template expects them (``tool_calls`` on assistant turns, role ``tool``);
its replies are parsed in its own syntax (mlx-lm's tool parsers where it has one):

- ``json_tools`` (Qwen 2.5 / 3, Hermes-style templates): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (or, in newer templates,
  ``[TOOL_CALLS]name[ARGS]{...}``);
- ``llama3`` (Llama 3.1-3.3): the reply is one JSON object ``{"name": ...,
  "parameters": {...}}`` (after ``<|python_tag|>`` for some);
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>``.

Any other template (SmolLM2's plain ChatML, base models) gets ``hermes``: the tools listed
in the system message and calls as ``<tool_call>`` JSON (``prompt``), which a template
without tool syntax renders as text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages.tool import InvalidToolCall, ToolCall

from ..engine import MAX_FREE_STRING_CHARS
from .messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_reply, text_of, to_dicts

#: A tool no template names by chance: rendered to find out whether a template shows tools.
_PROBE = {
    "type": "function",
    "function": {
        "name": "probe_tool_7f3a",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One way of calling tools: see the module docstring for each."""

    name: str
    native: bool  # the chat template renders tools, tool calls and tool results itself
    open: str  # where a call starts in a reply ("" : the reply itself is the call)
    close: str
    args_key: str = "arguments"

    def parse(self, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
        """A reply's text without its calls, the calls, and those that did not parse."""
        return _PARSERS[self.name](self, text)

    def grammar(
        self, tools: Sequence[dict[str, Any]], max_string_chars: int | None = MAX_FREE_STRING_CHARS
    ) -> str:
        """A grammar for exactly one call, in this format, to one of ``tools`` (free strings
        of its arguments bounded, see ``constrain.bounded_strings``)."""
        from ..engine import tool_call_grammar

        if self.name == "harmony":
            return _harmony_grammar(tools, max_string_chars)
        if self.name == "mistral":
            return tool_call_grammar(tools, "[TOOL_CALLS][", "]", max_string_chars=max_string_chars)
        return tool_call_grammar(
            tools, self.open, self.close, args_key=self.args_key, max_string_chars=max_string_chars
        )

    def cut_call(self, text: str, names: Sequence[str]) -> ToolCall | InvalidToolCall:
        """The one call of a forced reply (``grammar``) that was cut short, by ``max_tokens``
        or a timeout: a call if its arguments were complete (only the text closing the call
        was cut), else an invalid call with the arguments' text as far as it went (OpenAI
        returns such a call so too) and its name: as written, or the only tool it can be."""
        if self.name == "harmony":
            head = re.search(r"to=functions\.([\w.\-]+)\s", text)
            body = re.search(r"<\|message\|>(.*)", text, re.DOTALL)
        else:  # {"name": ..., "<args_key>": {...}}, the name first (``tool_call_grammar``)
            head = re.search(r'"name"\s*:\s*"([^"\\]*)"', text)
            body = re.search(rf'"{self.args_key}"\s*:\s*(.*)', text, re.DOTALL)
        name = head.group(1) if head else (names[0] if len(names) == 1 else None)
        args = body.group(1).strip() if body else ""
        with contextlib.suppress(ValueError):
            value, _ = json.JSONDecoder().raw_decode(args)
            if name is not None and isinstance(value, dict):
                return ToolCall(name=name, args=value, id=_new_id(), type="tool_call")
        return InvalidToolCall(
            name=name,
            args=args,
            id=_new_id(),
            error="the tool call was cut off (max_tokens or the timeout) before its arguments were complete",
            type="invalid_tool_call",
        )

    def call_id(self, call_id: str | None) -> str:
        """The id a template is shown for a call (Mistral's accept 9 letters or digits only)."""
        if self.name != "mistral":
            return call_id or ""
        return hashlib.sha256((call_id or "").encode()).hexdigest()[:9]


HERMES = ToolFormat("hermes", False, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format of ``tokenizer``'s chat template (cached on the tokenizer's template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return HERMES
    cached = _CACHE.get(template)
    if cached is None:
        cached = _CACHE[template] = _detect(tokenizer, template)
    return cached


_CACHE: dict[str, ToolFormat] = {}


def _detect(tokenizer: Any, template: str) -> ToolFormat:
    if not _renders_tools(tokenizer):
        return HERMES
    if "<|channel|>" in template and "to=functions" in template:
        return ToolFormat("harmony", True, "<|channel|>commentary to=functions.", "<|call|>")
    if "[TOOL_CALLS]" in template:
        return ToolFormat("mistral", True, "[TOOL_CALLS]", "")
    if "<tool_call>" in template:
        return ToolFormat("json_tools", True, "<tool_call>\n", "\n</tool_call>")
    if "<|python_tag|>" in template or ("parameters" in template and "<|eom_id|>" in template):
        return ToolFormat("llama3", True, "", "", args_key="parameters")
    return HERMES  # a template that shows tools but whose call syntax is unknown here


def _renders_tools(tokenizer: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[_PROBE], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template that refuses tools (or this message list) cannot show them
        return False
    return isinstance(text, str) and _PROBE["function"]["name"] in text


# ---------------------------------------------------------------------- parsing


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: Any, args: Any, raw: str) -> ToolCall | InvalidToolCall:
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    if isinstance(name, str) and isinstance(args, dict):
        return ToolCall(name=name, args=args, id=_new_id(), type="tool_call")
    return InvalidToolCall(
        name=name if isinstance(name, str) else None,
        args=raw,
        id=_new_id(),
        error="unparsable tool call: a name (string) and arguments (object) are needed",
        type="invalid_tool_call",
    )


def _split(items: list[ToolCall | InvalidToolCall]) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    calls = [c for c in items if c.get("type") == "tool_call"]
    invalid = [c for c in items if c.get("type") == "invalid_tool_call"]
    return calls, invalid  # type: ignore[return-value]


def _parse_hermes(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    return parse_reply(text)


def _parse_json_tools(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    from mlx_lm.tool_parsers import json_tools

    items: list[ToolCall | InvalidToolCall] = []
    for raw in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL):
        try:
            payload = json_tools.parse_tool_call(raw)
            items.append(_call(payload.get("name"), payload.get("arguments", payload.get("parameters")), raw))
        except (ValueError, AttributeError):
            items.append(_call(None, None, raw))
    if not items:
        return text, [], []
    content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.DOTALL).strip()
    return content, *_split(items)


def _parse_mistral(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    from mlx_lm.tool_parsers import mistral

    at = text.find("[TOOL_CALLS]")
    if at == -1:
        return text, [], []
    raw = text[at + len("[TOOL_CALLS]") :].strip()
    try:
        parsed = mistral.parse_tool_call(raw)
        payloads = parsed if isinstance(parsed, list) else [parsed]
        items = [_call(p.get("name"), p.get("arguments"), raw) for p in payloads]
    except (ValueError, AttributeError):
        items = [_call(None, None, raw)]
    return text[:at].strip(), *_split(items)


def _parse_llama3(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, [], []
    try:
        payload, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return text, [], []  # prose that starts with a brace
    if not isinstance(payload, dict) or "name" not in payload:
        return text, [], []
    args = payload.get("parameters", payload.get("arguments"))
    return body[end:].strip(), *_split([_call(payload["name"], args, body[:end])])


_HARMONY_CALL = re.compile(
    r"to=functions\.([\w.\-]+)\s*(?:<\|constrain\|>\s*json)?\s*<\|message\|>(.*?)(?:<\|call\|>|$)", re.DOTALL
)


def _parse_harmony(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    items = [_call(name, args.strip(), args) for name, args in _HARMONY_CALL.findall(text)]
    if not items:
        return text, [], []
    content = text[: text.find("<|channel|>commentary to=functions.")] if "to=functions." in text else text
    return content.strip(), *_split(items)


_PARSERS: dict[str, Callable[[ToolFormat, str], tuple[str, list[ToolCall], list[InvalidToolCall]]]] = {
    "hermes": _parse_hermes,
    "json_tools": _parse_json_tools,
    "mistral": _parse_mistral,
    "llama3": _parse_llama3,
    "harmony": _parse_harmony,
}


def _harmony_grammar(tools: Sequence[dict[str, Any]], max_string_chars: int | None) -> str:
    """``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>``."""
    import llguidance

    from ..engine import JSON_OPTIONS, bounded_strings

    rules, names = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = {
            "additionalProperties": False,
            **(fn.get("parameters") or {"type": "object", "properties": {}}),
        }
        schema = {**bounded_strings(params, max_string_chars), "x-guidance": JSON_OPTIONS}
        head = f"<|channel|>commentary to=functions.{fn['name']} <|constrain|>json<|message|>"
        rules.append(f'call{i}: {json.dumps(head)} args{i} "<|call|>"\nargs{i}: %json {json.dumps(schema)}')
        names.append(f"call{i}")
    lark = "start: " + " | ".join(names) + "\n" + "\n".join(rules) + "\n"
    return llguidance.LLMatcher.grammar_from_lark(lark)


# ---------------------------------------------------------------------- rendering


def native_dicts(fmt: ToolFormat, messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as a tool-rendering template expects them: assistant turns with
    ``tool_calls`` (arguments as objects), tool results as role ``tool`` with their call id."""
    from langchain_core.messages import AIMessage, ToolMessage

    out: list[dict[str, Any]] = []
    for d, m in zip(to_dicts(messages, None), messages, strict=True):
        if isinstance(m, AIMessage) and m.tool_calls:
            calls = [
                {
                    "id": fmt.call_id(c.get("id")),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c.get("args", {})},
                }
                for c in m.tool_calls
            ]
            out.append({"role": "assistant", "content": text_of(m.content), "tool_calls": calls})
        elif isinstance(m, ToolMessage):
            out.append(
                {
                    "role": "tool",
                    "content": text_of(m.content),
                    "tool_call_id": fmt.call_id(m.tool_call_id),
                    "name": m.name or "",
                }
            )
        else:
            out.append(d)
    return out
