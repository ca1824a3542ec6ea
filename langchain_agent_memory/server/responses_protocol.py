"""The OpenAI Responses request (``POST /v1/responses``), as this server reads it, and its
translation into LangChain messages and ``ChatAgentMemory`` call arguments.

``input`` is a string or a list of items: messages (``user`` / ``system`` / ``developer`` /
``assistant``, content a string or ``input_text`` / ``output_text`` parts), the model's
earlier ``function_call`` items and the client's ``function_call_output`` answers;
``reasoning`` items are dropped (templates drop reasoning from the history). ``tools`` are
function tools; ``instructions`` is the system message of this turn only (as OpenAI's:
those of earlier responses are not carried over).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Lenient):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
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

    def call_kwargs(self, agent_id: str, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for ``ChatAgentMemory`` (``invoke(messages, **kwargs)``)."""
        kwargs: dict[str, Any] = {"agent_id": agent_id, "max_tokens": max_tokens}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.wait_for_save:
            kwargs["wait_for_save"] = True
        if self.tools and self.tool_choice != "none":
            kwargs["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in self.tools
            ]
            choice = self.tool_choice
            if isinstance(choice, NamedFunction):
                if choice.name not in {t.name for t in self.tools}:
                    raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
                kwargs["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            elif choice == "required":
                kwargs["tool_choice"] = "required"
        return kwargs


def to_messages(items: list[dict[str, Any]]) -> list[BaseMessage]:
    """Responses items -> LangChain messages (``ValueError`` naming what cannot be read); a
    run of function calls joins the assistant message before it (one reply, as generated)."""
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
            call = ToolCall(name=item["name"], args=_arguments(i, item.get("arguments")), id=item["call_id"],
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
