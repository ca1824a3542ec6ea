"""Context scaling for agent harnesses that assume a bigger context than the model's (Claude
Code assumes 200K tokens; a local model may hold 8K): the prompt token counts a reply
reports are multiplied by ``ServerConfig.context_scale``, so that the harness compacts its
history when the model's real context is full rather than long after. Only what the client
is told is scaled: the engine, the metrics and the agents' caches count real tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

from langchain_core.messages import AIMessage

M = TypeVar("M", bound=AIMessage)


def scaled(message: M, factor: float) -> M:
    """``message`` with its prompt token counts (and their cached part) times ``factor``."""
    u = message.usage_metadata
    if factor == 1.0 or not u:
        return message
    details = dict(u.get("input_token_details") or {})
    if "cache_read" in details:
        details["cache_read"] = round(details["cache_read"] * factor)
    prompt = round(u["input_tokens"] * factor)
    usage = {
        **u,
        "input_tokens": prompt,
        "total_tokens": prompt + u["output_tokens"],
        "input_token_details": details,
    }
    return message.model_copy(update={"usage_metadata": usage})


async def scaled_chunks(chunks: AsyncIterator[M], factor: float) -> AsyncIterator[M]:
    """A stream's chunks, scaled (``scaled``); closing it closes ``chunks`` (decoding stops)."""
    try:
        async for chunk in chunks:
            yield scaled(chunk, factor)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
