"""One call of ``ChatAgentMemory`` as the engine runs it and as LangChain gets it back: the
request (rendered text, parameters, the tool format replies are parsed in, reasoning), the
reply as an ``AIMessage`` (content, tool calls, reasoning, usage, cache metadata) or as
streamed chunks, and the tool-choice and schema helpers of ``bind_tools`` /
``with_structured_output``."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import ToolCallChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool

from ..engine import Engine, GenerationParams, GenerationResult
from . import reasoning
from .tool_formats import ToolFormat

#: ``tool_choice`` values that force some tool call.
_ANY_TOOL = ("any", "required", True)
#: Finish reasons of a reply cut short (by ``max_tokens``, by the timeout).
_CUT = ("length", "timeout")


def cut_short(message_or_reason: AIMessage | str | None) -> bool:
    """Whether a reply (or its ``finish_reason``) ended before the model finished it."""
    if isinstance(message_or_reason, AIMessage):
        message_or_reason = message_or_reason.response_metadata.get("finish_reason")
    return message_or_reason in _CUT


class ChatRequest:
    __slots__ = ("agent", "engine", "forced", "opened", "params", "text", "thinks", "tools")

    def __init__(
        self,
        engine: Engine,
        agent: str,
        text: str,
        params: GenerationParams,
        tools: ToolFormat | None,
        forced: tuple[str, ...],
        thinks: bool,
        opened: bool,
    ) -> None:
        self.engine, self.agent, self.text, self.params = engine, agent, text, params
        self.tools = tools  # the format replies are parsed in for calls (None: no tools offered)
        self.forced = forced  # the tools a forced call is to (the reply is the call, held to its end)
        self.thinks, self.opened = thinks, opened  # split reasoning; the prompt opened <think>

    @property
    def hide_text(self) -> bool:
        return bool(self.forced)

    def split(self, text: str, partial: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of a reply (or of one still being generated)."""
        return reasoning.split(text, self.opened, partial) if self.thinks else ("", text)

    def parse(self, text: str, cut: bool = False) -> tuple[str, str, list[Any], list[Any]]:
        """(reasoning, content, tool calls, invalid calls) of a whole reply; ``cut``: it was
        cut short, and a forced call is then the call as far as it went (``cut_call``)."""
        thought, answer = self.split(text)
        content, calls, invalid = self.tools.parse(answer) if self.tools is not None else (answer, [], [])
        if cut and self.forced and self.tools is not None and not calls:  # the reply is the call
            call = self.tools.cut_call(answer, self.forced)
            whole = call["type"] == "tool_call"  # only the text closing it was cut
            content, calls, invalid = "", [call] if whole else [], [] if whole else [call]
        if thought and content.lstrip().startswith("<|"):
            content = reasoning.strip_headers(content)
        if calls:  # the agent comes back when the tools return: the hot tier keeps it meanwhile
            self.engine.admin.schedule.awaits_tool(self.agent)
        return thought, content, calls, invalid


def choice_name(choice: Any) -> str | None:
    if isinstance(choice, dict):
        return choice.get("function", {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice not in ("auto", "none", "any", "required"):
        return choice
    return None


def forced_tools(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    if not tools or choice in (None, "auto", "none", False):
        return []
    if choice in _ANY_TOOL:
        return tools
    name = choice_name(choice)
    return [t for t in tools if t["function"]["name"] == name]


def json_schema_of(schema: dict[str, Any] | type | None) -> dict[str, Any]:
    """A JSON schema from a Pydantic class, TypedDict, OpenAI tool dict or titled schema; an
    untitled dict is taken as the JSON schema itself (``{"type": "object"}``: any object)."""
    if not schema:
        return {"type": "object"}
    if isinstance(schema, dict) and "title" not in schema and "function" not in schema:
        return schema
    return convert_to_json_schema(schema)


def ls_format(schema: Any, method: str) -> dict[str, Any]:
    """Tracing metadata for LangSmith: ``{"ls_structured_output_format": ...}`` when the
    schema converts to a tool (a bare ``{"type": "object"}`` does not), else nothing."""
    try:
        tool = convert_to_openai_tool(schema)
    except Exception:  # only tracing metadata: never fail the call over it
        return {}
    return {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": tool}}


def usage_of(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
        input_token_details={"cache_read": result.reused_tokens},
    )


def response_metadata(req: ChatRequest, result: GenerationResult) -> dict[str, Any]:
    return {
        "model_name": req.engine.lm.name,
        "model_provider": "agent-memory",
        "finish_reason": result.finish_reason,
        "stop_sequence": result.stop_sequence,  # the one that ended the reply, if one did
        "agent_id": req.agent,
        "cache": str(result.outcome),
        # where the reused cache was read from: "memory", "disk", "disk, prefetched", None (cold)
        "loaded_from": result.outcome.loaded_from,
        "cached_tokens": result.reused_tokens,
        # "pending": written after the reply left (``flush`` waits); False: a worker sharing the
        # store saved this agent while the call ran (that save stands)
        "cache_saved": result.saved,
        "time_to_first_token_s": round(result.timings.ttft_s, 4),
        # where the time went: reading the cache, forking a sibling's, prefill, decode, the
        # turn made ready to store (on the model's thread; the write itself runs after)
        "load_s": round(result.timings.load_s, 4),
        "fork_s": round(result.timings.fork_s, 4),
        "prefill_s": round(result.timings.prefill_s, 4),
        "decode_s": round(result.timings.decode_s, 4),
        "save_s": round(result.timings.save_s, 4),
        "bytes_written": result.bytes_written,
    }


def chat_result(req: ChatRequest, result: GenerationResult) -> ChatResult:
    thought, content, calls, invalid = req.parse(result.text, cut_short(result.finish_reason))
    message = AIMessage(
        content=content,
        additional_kwargs={"reasoning_content": thought} if thought else {},
        tool_calls=calls,
        invalid_tool_calls=invalid,
        usage_metadata=usage_of(result),
        response_metadata=response_metadata(req, result),
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


class StreamShaper:
    """Engine text chunks -> message chunks: reasoning streams as ``reasoning_content``
    chunks, the answer as content, except what may be (or is) a tool call, which is parsed
    at the end into tool-call chunks; the last chunk (``chunk_position="last"``) carries
    usage and metadata."""

    def __init__(self, req: ChatRequest) -> None:
        self.req = req
        self.text = ""  # the whole reply so far
        self.thought_emitted = 0
        self.answer = ""  # its answer part so far (``ChatRequest.split``)
        self.emitted = 0  # of ``answer``
        self.in_call = req.hide_text

    def feed(self, piece: str, result: GenerationResult | None) -> list[ChatGenerationChunk]:
        out: list[ChatGenerationChunk] = []
        self.text += piece
        thought, self.answer = self.req.split(self.text, partial=True)
        if len(thought) > self.thought_emitted:
            delta = thought[self.thought_emitted :]
            out.append(
                ChatGenerationChunk(
                    message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": delta})
                )
            )
            self.thought_emitted = len(thought)
        if not self.in_call:
            text = self.answer
            limit = len(text)
            fmt = self.req.tools
            if fmt is not None and fmt.open:  # text is held back where a call may start
                marker = fmt.open.strip()
                at = text.find(marker, self.emitted)
                if at != -1:
                    limit, self.in_call = at, True
                else:
                    limit = reasoning.safe_end(text, marker)
            elif fmt is not None:  # the call is the whole reply (Llama 3): held while it may be one
                head = text.lstrip()
                if head.startswith(("{", "<|python_tag|>")):
                    limit, self.in_call = self.emitted, True
                elif not head or "<|python_tag|>".startswith(head):
                    limit = self.emitted
            if limit > self.emitted:
                out.append(ChatGenerationChunk(message=AIMessageChunk(content=text[self.emitted : limit])))
                self.emitted = limit
        if result is not None:
            out.append(self._last(result))
        return out

    def _last(self, result: GenerationResult) -> ChatGenerationChunk:
        thought, content, calls, invalid = self.req.parse(result.text)
        rest = content[self.emitted :] if content.startswith(self.answer[: self.emitted]) else ""
        chunks = [
            ToolCallChunk(
                name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i, type="tool_call_chunk"
            )
            for i, c in enumerate(calls)
        ]
        # A chunk's tool calls are re-parsed from its chunks (leniently: a cut-off call would
        # pass as a call), so an unparsable call is returned as the text it was.
        opening = self.req.tools.open if self.req.tools is not None else ""
        rest += "".join(opening + (c["args"] or "") for c in invalid)
        late = thought[self.thought_emitted :]  # reasoning the partial split held back
        message = AIMessageChunk(
            content=rest,
            additional_kwargs={"reasoning_content": late} if late else {},
            tool_call_chunks=chunks,
            usage_metadata=usage_of(result),
            response_metadata=response_metadata(self.req, result),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


def whole_reply(message: AIMessage) -> AIMessage:
    """``message`` if its generation ended by itself; an ``OutputParserException`` if
    ``max_tokens`` (or the timeout) cut it off (a structured reply or a forced call cut short
    is not valid however much of it parses: LangChain's partial-JSON parser would "repair" it
    into an object with missing or truncated values). With ``include_raw=True`` the error is
    the ``parsing_error`` and the raw message is kept."""
    if cut_short(message):
        used = (message.usage_metadata or {}).get("output_tokens", "?")
        limit = "max_tokens" if message.response_metadata["finish_reason"] == "length" else "timeout"
        raise OutputParserException(
            f"the structured reply was cut off at {limit} ({used} tokens generated) before the "
            f"object was complete; raise {limit} (or lower max_string_chars) and call again",
            llm_output=str(message.content),
        )
    return message
