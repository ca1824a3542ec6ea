"""The OpenAI Chat Completions request, as this server reads it, and its translation into
LangChain messages and ``ChatAgentMemory`` call arguments.

Every sampling field is honoured (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, ``stop``, ``max_tokens``, ``presence_penalty``, ``frequency_penalty`` and vLLM's
``repetition_penalty``) or, where this server cannot honour it, refused with a 400 that
names it (``n > 1``, ``logprobs``, ``logit_bias``); fields that only
describe the caller (``metadata``, ``store``, ``parallel_tool_calls``) and unknown fields
are accepted and ignored (a debug log line names them), as clients add fields faster than
servers learn them. A ``max_tokens`` over the server's limit is clamped to it
(``errors.within_limit``).

The agent whose cache a request uses: OpenAI's ``prompt_cache_key`` (``ChatOpenAI`` and the
``openai`` client pass it per call), else the ``X-Agent-ID`` header or the body field
``agent_id`` (``extra_body={"agent_id": ...}``), else ``user``, else ``"default"``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from ..chat.prompt import text_of

#: Most stop sequences one request may give (OpenAI allows 4).
MAX_STOP_SEQUENCES = 16

Content = str | list[dict[str, Any]]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemIn(_Lenient):
    role: Literal["system", "developer"]
    content: Content


class UserIn(_Lenient):
    role: Literal["user"]
    content: Content


class AssistantIn(_Lenient):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolIn(_Lenient):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemIn | UserIn | AssistantIn | ToolIn, Field(discriminator="role")]


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class SampledRequest(_Lenient):
    """What chat and plain completions share: the model, sampling, the agent, and the
    fields refused unless left at their no-op values (see the module docstring)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (``errors.parse_body``)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM / llama.cpp: -1 or 0 is off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    agent_id: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    #: Reply once the turn's cache is saved: ``agent_memory.cache_saved`` is then true,
    #: "local" (its upload to the shared store pending) or false, not "pending".
    wait_for_save: StrictBool = False
    # refused unless left at their no-op values (see the module docstring)
    n: int = 1
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM / llama.cpp's
    logit_bias: dict[str, float] | None = None

    def refused(self) -> dict[str, bool]:
        return {
            "n": self.n != 1,
            "logprobs": self.logprobs not in (None, False) or bool(self.top_logprobs),
            "logit_bias": bool(self.logit_bias),
        }

    @model_validator(mode="after")
    def _supported(self) -> SampledRequest:
        for name, bad in self.refused().items():
            if bad:
                raise ValueError(f"{name} is not supported by this server: leave it out")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return self

    @property
    def stops(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else self.stop


class ChatCompletionRequest(SampledRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _named_tool(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice) and not self.tool_choice.function.get("name"):
            raise ValueError('tool_choice must name a function: {"function": {"name": ...}}')
        return self


class CompletionRequest(SampledRequest):
    """``POST /v1/completions``: plain text continued (base models, raw prompts)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refused(self) -> dict[str, bool]:
        return {
            **super().refused(),
            "echo": self.echo,
            "suffix": bool(self.suffix),
            "best_of": self.best_of not in (None, 1),
            "prompt": isinstance(self.prompt, list) and len(self.prompt) != 1,  # one prompt per request
        }

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def to_messages(messages: list[Any]) -> list[BaseMessage]:
    """OpenAI messages -> LangChain messages (``ValueError`` on what cannot be read)."""
    out: list[BaseMessage] = []
    for i, m in enumerate(messages):
        if isinstance(m, SystemIn):
            out.append(SystemMessage(text_of(m.content)))
        elif isinstance(m, UserIn):
            out.append(HumanMessage(text_of(m.content)))
        elif isinstance(m, AssistantIn):
            calls = [_tool_call(i, c) for c in m.tool_calls or []]
            out.append(AIMessage(text_of(m.content or ""), tool_calls=calls))
        else:
            out.append(ToolMessage(text_of(m.content), tool_call_id=m.tool_call_id))
    return out


def _tool_call(index: int, call: ToolCallIn) -> ToolCall:
    try:
        args = json.loads(call.function.arguments or "{}")
    except ValueError as exc:
        raise ValueError(
            f"messages[{index}]: tool call {call.id!r} has arguments that are not JSON: {exc}"
        ) from exc
    if not isinstance(args, dict):
        raise ValueError(f"messages[{index}]: tool call {call.id!r} arguments must be a JSON object")
    return ToolCall(name=call.function.name, args=args, id=call.id, type="tool_call")


def penalty_kwargs(req: SampledRequest) -> dict[str, float]:
    """The request's penalties that are set (0 and a repetition penalty of 1 are off)."""
    given = {
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    return {
        k: v for k, v in given.items() if v is not None and v != (1.0 if k == "repetition_penalty" else 0.0)
    }


def call_kwargs(req: ChatCompletionRequest, agent_id: str, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for ``ChatAgentMemory`` (``invoke(messages, **kwargs)``)."""
    kwargs: dict[str, Any] = {"agent_id": agent_id, "max_tokens": max_tokens}
    if req.temperature is not None:
        kwargs["temperature"] = req.temperature
    if req.top_p is not None:
        kwargs["top_p"] = req.top_p
    if req.top_k is not None and req.top_k > 0:
        kwargs["top_k"] = req.top_k
    if req.min_p is not None:
        kwargs["min_p"] = req.min_p
    if req.seed is not None:
        kwargs["seed"] = req.seed
    if req.wait_for_save:
        kwargs["wait_for_save"] = True
    kwargs.update(penalty_kwargs(req))
    if req.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        choice = req.tool_choice
        kwargs["tool_choice"] = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        kwargs["response_format"] = {"type": "json_object", "schema": {"type": "object"}}
    elif fmt is not None and fmt.type == "json_schema":
        given = fmt.json_schema.schema_ if fmt.json_schema else None
        schema = given or {"type": "object"}
        kwargs["response_format"] = {"type": "json_schema", "schema": schema}
    return kwargs
