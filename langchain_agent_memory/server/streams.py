"""A streamed reply's start: its first token awaited a few seconds before the status line is
sent, so that what fails early (a context too long, a store out of reach) still gets its
status code; a longer prefill (a cold 32K-token agent on a CPU takes minutes) goes on after
the status line, behind SSE keep-alive comments (``KEEPALIVE_S``), so that clients with a
read timeout do not give up on it. What fails after the status line goes in the stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .errors import as_api_errors

logger = logging.getLogger(__name__)

#: Longest wait for a stream's first token before its status line is sent.
FIRST_TOKEN_WAIT_S = 5.0
#: Seconds between SSE keep-alive comments (``: ping``) while nothing else is sent.
KEEPALIVE_S = 5

First = Any  # a stream's first chunk, or the task that will give it


async def first_chunk(chunks: AsyncIterator[Any]) -> First:
    """The first chunk, if it comes within ``FIRST_TOKEN_WAIT_S`` (its failure: an
    ``APIError`` with a status code); else the task still waiting for it."""
    task = asyncio.ensure_future(anext(chunks))
    await asyncio.wait({task}, timeout=FIRST_TOKEN_WAIT_S)
    if not task.done():
        return task
    with as_api_errors():
        return task.result()


async def resolved(first: First) -> Any:
    """The first chunk, awaited if it had not come yet (its failure raised here, in the stream)."""
    return await first if isinstance(first, asyncio.Future) else first


async def closed(chunks: AsyncIterator[Any], first: First) -> None:
    """The stream ended or the client went away: stop waiting, stop decoding."""
    if isinstance(first, asyncio.Future) and not first.done():
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
    await chunks.aclose()  # type: ignore[attr-defined]


async def relay(
    first: First,
    chunks: AsyncIterator[Any],
    render: Callable[[Any], list[dict[str, str]]],
    on_error: Callable[[Exception], list[dict[str, str]]],
    head: list[dict[str, str]] | tuple[()] = (),
    tail: Callable[[], Awaitable[list[dict[str, str]]]] | None = None,
) -> AsyncIterator[dict[str, str]]:
    """A streamed reply's SSE events: ``head``, what ``render`` makes of each chunk, then
    ``tail``'s; a failure after the status line was sent goes in the stream (``on_error``'s
    events end it). Closing it (the client went away) stops decoding."""
    try:
        for out in head:
            yield out
        chunk = None
        while True:
            try:
                chunk = await resolved(first) if chunk is None else await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:  # the status line is sent: the error goes in the stream
                logger.exception("generation failed mid-stream")
                for out in on_error(exc):
                    yield out
                return
            for out in render(chunk):
                yield out
        for out in await tail() if tail is not None else ():
            yield out
    finally:
        await closed(chunks, first)


async def sent(events: list[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
    """A reply generated whole, as SSE events."""
    for out in events:
        yield out
