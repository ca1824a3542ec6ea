"""The OpenAI Responses request (``POST /v1/responses``), as this server reads it, and its
translation into LangChain messages and ``ChatAgentMemory`` call arguments.

``input`` is a string or a list of items: messages (``user`` / ``system`` / ``developer`` /
``assistant``, content a string or ``input_text`` / ``output_text`` parts), the model's
earlier ``function_call`` items and the client's ``function_call_output`` answers;
``reasoning`` items are dropped (templates drop reasoning from the history), and so are
items of the tools the model cannot run (``web_search_call``, ``custom_tool_call``, ...),
with a warning. ``instructions`` is the system message of this turn only (as OpenAI's:
those of earlier responses are not carried over).

``tools``: function tools, and ``namespace`` tools (a group of function tools, as the Codex
CLI sends) flattened into function tools named ``<namespace>.<name>``: a call of one comes
back as a ``function_call`` with ``name`` and ``namespace`` apart again (``ToolSet``).
Tools of the types the model cannot run (``web_search``, ``local_shell``, ``custom``,
``file_search``, ``mcp``, ...) are left out, with a warning. ``include`` asks for extras
this server does not make (``reasoning.encrypted_content``, logprobs, ...): they are
omitted. Unknown fields (``client_metadata``, ...) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class ToolSet:
    """A request's tools as the model gets them: function tools, those of namespaces
    flattened (``<namespace>.<name>``), and what was left out."""

    functions: list[FunctionTool] = field(default_factory=list)
    #: Flattened name -> (namespace, name): a call is named back as the client knows it.
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The tools left out ("web_search", "apply_patch (custom)", ...).
    dropped: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, tools: list[dict[str, Any]]) -> ToolSet:
        """``ValueError`` naming a function tool that is malformed."""
        out = cls()
        for i, tool in enumerate(tools):
            kind = tool.get("type")
            if kind == "function":
                out.functions.append(_function(f"tools[{i}]", tool))
            elif kind == "namespace" and isinstance(tool.get("tools"), list):
                space = str(tool.get("name") or "")
                for k, inner in enumerate(tool["tools"]):
                    where = f"tools[{i}].tools[{k}]"
                    if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                        kind_of = inner.get("type") if isinstance(inner, dict) else type(inner).__name__
                        out.dropped.append(f"{space}.{kind_of}")
                        continue
                    fn = _function(where, {**inner, "type": "function"})
                    flat = f"{space}.{fn.name}" if space else fn.name
                    out.namespaced[flat] = (space, fn.name)
                    out.functions.append(_function(where, {**fn.model_dump(), "name": flat}))
            else:
                name = tool.get("name")
                out.dropped.append(f"{name} ({kind})" if isinstance(name, str) else str(kind))
        return out

    def call_name(self, name: str) -> dict[str, str]:
        """A call's ``name`` (and ``namespace``) as the client named the tool."""
        if name in self.namespaced:
            space, inner = self.namespaced[name]
            return {"name": inner, "namespace": space}
        return {"name": name}


def _function(where: str, tool: dict[str, Any]) -> FunctionTool:
    try:
        return FunctionTool.model_validate(tool)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}.{loc}: {first['msg']}") from None


class ResponsesRequest(_Lenient):
    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (``errors.parse_body``)

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    #: A string, ``{"type": "function", "name": ...}``, or another kind (``allowed_tools``,
    #: a hosted tool's), read as ``auto``.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    # the agent (``agent_routes.agent_of``): as chat completions take it
    agent_id: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    wait_for_save: StrictBool = False

    def items(self) -> list[dict[str, Any]]:
        """``input`` as items."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def tool_set(self) -> ToolSet:
        """The tools as the model gets them (``ValueError`` naming a malformed one)."""
        return ToolSet.of(self.tools or [])

    def call_kwargs(self, agent_id: str, max_tokens: int, tools: ToolSet) -> dict[str, Any]:
        """Keyword arguments for ``ChatAgentMemory`` (``invoke(messages, **kwargs)``)."""
        kwargs: dict[str, Any] = {"agent_id": agent_id, "max_tokens": max_tokens}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.wait_for_save:
            kwargs["wait_for_save"] = True
        if tools.functions and self.tool_choice != "none":
            kwargs["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in tools.functions
            ]
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function":
                name = str(choice.get("name"))
                name = f"{choice['namespace']}.{name}" if choice.get("namespace") else name
                if name not in {t.name for t in tools.functions}:
                    raise ValueError(f"tool_choice names {name!r}, which is not in tools")
                kwargs["tool_choice"] = {"type": "function", "function": {"name": name}}
            elif choice == "required":
                kwargs["tool_choice"] = "required"
        return kwargs


def to_messages(items: list[dict[str, Any]], dropped: list[str] | None = None) -> list[BaseMessage]:
    """Responses items -> LangChain messages (``ValueError`` naming what cannot be read); a
    run of function calls joins the assistant message before it (one reply, as generated).
    Items of tools the model cannot run are left out, and their types added to ``dropped``;
    a namespaced call is named as the flattened tool (``ToolSet``)."""
    out: list[BaseMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role, text = item.get("role"), _text(i, item.get("content", ""))
            if role in ("system", "developer"):
                out.append(SystemMessage(text))
            elif role == "user":
                out.append(HumanMessage(text))
            elif role == "assistant":
                out.append(AIMessage(text))
            else:
                raise ValueError(
                    f"input[{i}]: a message's role is user, system, developer or assistant, not {role!r}"
                )
        elif kind == "function_call":
            name = f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"]
            call = ToolCall(name=name, args=_arguments(i, item.get("arguments")), id=item["call_id"],
                            type="tool_call")  # fmt: skip
            last = out[-1] if out else None
            if isinstance(last, AIMessage):
                last.tool_calls = [*last.tool_calls, call]
            else:
                out.append(AIMessage("", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(ToolMessage(output if isinstance(output, str) else _text(i, output),
                                   tool_call_id=item["call_id"]))  # fmt: skip
        elif kind == "reasoning":
            continue
        elif dropped is not None:
            dropped.append(str(kind))
        else:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported here")
    return out


def _text(index: int, content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(
                f"input[{index}]: content of type {kind!r} is not supported: this model reads text"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _arguments(index: int, raw: Any) -> dict[str, Any]:
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
    except ValueError as exc:
        raise ValueError(f"input[{index}]: function_call arguments are not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise ValueError(f"input[{index}]: function_call arguments must be a JSON object")
    return args
