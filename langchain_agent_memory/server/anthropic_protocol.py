"""The Anthropic Messages request (``POST /v1/messages``), as this server reads it, and its
translation into LangChain messages and ``ChatAgentMemory`` call arguments.

Content blocks: ``text`` everywhere; ``tool_use`` in assistant turns (a call the model made),
``tool_result`` in user turns (its answer: a ``ToolMessage``); ``thinking`` blocks of earlier
assistant turns are dropped, as chat templates drop reasoning from the history. Images and
documents are refused (the shipped models read text). A ``system`` message inside
``messages`` (Claude Code's mid-conversation system text) is a system message at its place.
``tools`` (``input_schema``) and ``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``)
map onto the chat model's tools; Anthropic's server tools (a ``type`` such as
``web_search_20250305``: run by Anthropic's servers, not by the client) are left out, with a
warning (``dropped_tools``). ``thinking`` turns a template's thinking switch on or off
(``enable_thinking``: Qwen 3's; other templates ignore it; ``adaptive`` is on) and its
``budget_tokens`` is ignored (no model here splits its reply by a reasoning budget; only
``max_tokens`` bounds the reply). Unknown fields (``context_management``,
``output_config``, ...) are ignored. Claude Code's billing header (the first system block,
``x-anthropic-billing-header: cc_version=...``, which varies with the session's first
message) is left out of the prompt, as it is metadata for Anthropic's API: every session
then starts with the same system text and tools, which a new session reads from the blocks
an earlier one stored.

The agent whose cache a request uses: the ``X-Agent-ID`` header or the body's ``agent_id``,
else ``metadata.user_id``, else ``"default"``: the same rule as chat completions,
``metadata.user_id`` standing for ``user``. Claude Code's ``user_id`` is a JSON object in a
string (``{"device_id": ..., "session_id": ...}``): its agent is the session,
``claude-code:<session_id>`` (``session_agent``), so each session keeps a cache of its own.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from .protocol import MAX_STOP_SEQUENCES


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Lenient):
    type: Literal["thinking", "redacted_thinking"]


_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock,
}  # fmt: skip
Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class MessageIn(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]

    @property
    def blocks(self) -> list[Block]:
        """The content as typed blocks (``ValueError`` naming one this server cannot read)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        out = []
        for i, raw in enumerate(self.content):
            kind = _BLOCKS.get(str(raw.get("type")))
            if kind is None:
                raise ValueError(
                    f"content[{i}]: blocks of type {raw.get('type')!r} are not supported: "
                    "this model reads text (text, tool_use, tool_result and thinking blocks)"
                )
            try:
                out.append(kind.model_validate(raw))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"content[{i}] ({raw.get('type')}): {where}: {first['msg']}") from None
        return out  # type: ignore[return-value]

    @model_validator(mode="after")
    def _readable(self) -> MessageIn:
        self.blocks  # noqa: B018 - refused here, with the field's place, rather than later
        return self


class ToolIn(_Lenient):
    #: None or ``custom``: a tool the client runs; else one of Anthropic's server tools.
    type: str | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    @property
    def runnable(self) -> bool:
        return self.type in (None, "custom")


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" must name one: {"type": "tool", "name": ...}')
        return self


class Thinking(_Lenient):
    type: str  # enabled, disabled, adaptive, and those to come: all but disabled are on
    budget_tokens: int | None = None


class Metadata(_Lenient):
    user_id: str | None = None


#: The agent of a Claude Code session: this prefix and the session's id.
SESSION_PREFIX = "claude-code:"


def session_agent(user_id: str) -> str:
    """The agent ``metadata.user_id`` names: Claude Code's JSON (``{"device_id": ...,
    "session_id": ...}``) names its session, ``claude-code:<session_id>``; any other string
    is the agent itself.

    >>> session_agent('{"device_id": "e09a", "account_uuid": "", "session_id": "a385c0d2"}')
    'claude-code:a385c0d2'
    >>> session_agent("researcher")
    'researcher'
    """
    if not user_id.startswith("{"):
        return user_id
    try:
        fields = json.loads(user_id)
    except ValueError:
        return user_id
    session = fields.get("session_id") if isinstance(fields, dict) else None
    return SESSION_PREFIX + session if isinstance(session, str) and session else user_id


#: Claude Code's first system block: billing attribution for Anthropic's API, not text for
#: the model. Its ``cc_version`` ends in a hash of the session's first user message, so
#: kept, it would make every session's prompt differ from its first tokens on and no
#: session could start from the system prompt and tools another one stored (SHARED).
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(system: str | list[TextBlock] | None) -> str:
    """The system text the model reads: the blocks joined, Claude Code's billing header
    left out."""
    if not system:
        return ""
    if isinstance(system, str):
        return system
    return "".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))


class CountTokensRequest(_Lenient):
    """``POST /v1/messages/count_tokens``: what a request of these messages would read."""

    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (``errors.parse_body``)

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None

    def to_messages(self) -> list[BaseMessage]:
        """LangChain messages (``ValueError`` on what cannot be read)."""
        out: list[BaseMessage] = []
        system = _system_text(self.system)
        if system:
            out.append(SystemMessage(system))
        for i, m in enumerate(self.messages):
            out.extend(_turn(i, m))
        return out

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI function format the chat model takes."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
            if t.runnable
        ]

    def dropped_tools(self) -> list[str]:
        """The tools left out: Anthropic's server tools, which no client runs."""
        return [f"{t.name} ({t.type})" for t in self.tools or [] if not t.runnable]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    #: This server's own: the agent, as the chat completions body takes it.
    agent_id: str | None = None
    wait_for_save: StrictBool = False

    @model_validator(mode="after")
    def _tool_named(self) -> MessagesRequest:
        choice = self.tool_choice
        named = choice is not None and choice.type == "tool"
        if named and choice.name not in {t.name for t in self.tools or [] if t.runnable}:  # type: ignore[union-attr]
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")  # type: ignore[union-attr]
        return self

    # What ``agent_routes.agent_of`` reads: the same rule as chat completions.
    @property
    def prompt_cache_key(self) -> None:
        return None

    @property
    def user(self) -> str | None:
        user_id = self.metadata.user_id if self.metadata else None
        return session_agent(user_id) if user_id else None

    def call_kwargs(self, agent_id: str, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for ``ChatAgentMemory`` (``invoke(messages, **kwargs)``)."""
        kwargs: dict[str, Any] = {"agent_id": agent_id, "max_tokens": max_tokens}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k:
            kwargs["top_k"] = self.top_k
        if self.stop_sequences:
            kwargs["stop"] = self.stop_sequences
        if self.wait_for_save:
            kwargs["wait_for_save"] = True
        if self.thinking is not None:
            kwargs["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        choice = self.tool_choice
        if self.tools and not (choice is not None and choice.type == "none"):
            kwargs["tools"] = self.openai_tools()
            if choice is not None and choice.type == "any":
                kwargs["tool_choice"] = "required"
            elif choice is not None and choice.type == "tool":
                kwargs["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        return kwargs


def _turn(index: int, message: MessageIn) -> list[BaseMessage]:
    """One Anthropic turn as LangChain messages: a user turn's tool results first (one
    ``ToolMessage`` each), then its text; an assistant turn's text and calls as one reply; a
    system message's text."""
    blocks = message.blocks
    if message.role == "system":
        if any(not isinstance(b, TextBlock) for b in blocks):
            raise ValueError(f"messages[{index}]: a system message holds text blocks only")
        return [SystemMessage("".join(b.text for b in blocks if isinstance(b, TextBlock)))]
    if message.role == "assistant":
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls = [
            ToolCall(name=b.name, args=b.input, id=b.id, type="tool_call")
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        return [AIMessage(text, tool_calls=calls)]
    out: list[BaseMessage] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            text = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content)
            status = "error" if b.is_error else "success"
            out.append(ToolMessage(text, tool_call_id=b.tool_use_id, status=status))
        elif isinstance(b, ToolUseBlock):
            raise ValueError(f"messages[{index}]: a user turn cannot hold a tool_use block (the assistant's)")
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if text or not out:
        out.append(HumanMessage(text))
    return out


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a ``tool_use`` block's ``input`` (a JSON object)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
