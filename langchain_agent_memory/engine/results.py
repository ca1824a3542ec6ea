"""What a request asks for and what it gets back: parameters, results, stream chunks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from .errors import ContextLengthError  # noqa: F401 - defined there, re-exported
from .model.constrain import TokenConstraint
from .prefix import MatchKind

logger = logging.getLogger(__name__)


class CacheSource(str, Enum):
    COLD = "cold"  # nothing reused: full prefill
    WARM = "warm"  # reused, read (at least partly) from disk
    HOT = "hot"  # reused from memory


@dataclass(frozen=True, slots=True)
class CacheOutcome:
    source: CacheSource
    match: MatchKind
    #: A HOT start whose caches a prefetch (a checkpointer's, ``Engine.prefetch``) read from
    #: disk before the request came: served from memory, but not kept there since last turn.
    prefetched: bool = False

    @property
    def loaded_from(self) -> Literal["memory", "disk", "disk, prefetched"] | None:
        """Where this turn's reused cache was read from: ``"memory"`` (live, or blocks in the
        pool's memory tier), ``"disk"`` (read for this request: ``warm``), ``"disk,
        prefetched"`` (read from disk ahead of the request: a resumed graph's first turn);
        None: nothing reused (``cold``)."""
        if self.source is CacheSource.COLD:
            return None
        if self.source is CacheSource.WARM:
            return "disk"
        return "disk, prefetched" if self.prefetched else "memory"

    def __str__(self) -> str:
        return (
            self.source.value
            if self.source is CacheSource.COLD
            else f"{self.source.value}-{self.match.value}"
        )


@dataclass(slots=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: none)
    #: The reply's text exactly as it continues the prompt: a leading space is kept (mlx-lm's
    #: streaming detokenizers drop it, as a chat reply wants); raw completions set it.
    exact_text: bool = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: Restricts sampling to what a grammar allows (``constrain.GrammarConstraint``); it is
    #: stateful: one per request.
    constraint: TokenConstraint | None = None
    #: Stop decoding after this many seconds from the request's start (``"timeout"``).
    timeout_s: float | None = None
    #: Penalties against repeats (``runner.Penalties``: mlx-lm's logits processors) over the
    #: last ``penalty_window`` tokens of the prompt and the reply; None: none.
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_window: int = 20
    #: This request's own bound on prompt and reply tokens, under the engine's (None: the
    #: engine's): a caller's smaller context window.
    context_length: int | None = None
    #: What the caller says of the request, for the engine's request hooks (the engine reads
    #: none of it): the chat model passes its run's ``checkpoint_id`` (a LangGraph run resumed
    #: from an older checkpoint), which a checkpointer's hook rewinds the thread's agents to.
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The result waits for this turn's save before it is returned (the last chunk of a
    #: stream, after the text): ``saved`` is then True, ``"local"`` or False, never
    #: ``"pending"``. Off by default: a reply leaves before its save (other agents decode on
    #: meanwhile either way; only this caller waits).
    wait_for_save: bool = False


@dataclass(slots=True)
class Timings:
    load_s: float = 0.0  # building the cache from blocks (memory or disk)
    fork_s: float = 0.0  # copying an in-flight sibling's caches (a fan-out's shared prefix)
    prefill_s: float = 0.0  # fork_s included
    ttft_s: float = 0.0  # request start -> first token sampled
    decode_s: float = 0.0
    save_s: float = 0.0  # on the worker: the turn quantized into the stored form, blocks made ready


#: Where a turn's save ended: True (stored), "local" (on this worker, upload pending), False.
Saved = bool | Literal["local"]


@dataclass(slots=True)
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    outcome: CacheOutcome
    finish_reason: str  # "stop" (end of turn or stop sequence), "length", "cancelled", "timeout"
    timings: Timings
    #: The stop sequence that ended the reply (None: it ended otherwise).
    stop_sequence: str | None = None
    #: Tensor bytes of the new blocks this turn's save writes (file headers aside).
    bytes_written: int = 0
    #: "pending": the reply left before its save (blocks, record) was durable; it is written
    #: on the engine's save thread (``Engine.flush`` waits for it). False: not kept (on a
    #: shared store another worker saved the agent while this request ran).
    saved: Saved | Literal["pending"] = "pending"
    #: The save's outcome once written (``wait_saved``).
    save_done: Future[Saved] | None = field(default=None, repr=False, compare=False)

    def wait_saved(self, timeout: float | None = None) -> Saved:
        """Wait for this turn's save: True once its blocks and record are durable (in the
        shared store, for a worker of one); ``"local"`` (truthy) once durable on this worker
        with its upload pending (the store out of reach, or another worker's lease on the
        agent: uploaded as soon as it can be); False if it was not kept (a worker sharing
        the store saved the agent first). Raises what made it fail (``CacheWriteError``:
        the agent's previous cache is intact)."""
        if self.save_done is None:
            return True if self.saved is True else self.saved if self.saved == "local" else False
        return self.save_done.result(timeout)

    def settle(self) -> Saved:
        """Wait for this turn's save and set ``saved`` to its outcome; a save that failed is
        False (said in a log line: the agent's previous cache is intact, and ``flush``
        raises the error)."""
        if self.save_done is None:
            self.saved = self.wait_saved()
            return self.saved
        # Asked, not raised: a raise would add this turn's frames to the error's traceback,
        # and the error (kept for ``flush``) would keep the turn through them.
        error = self.save_done.exception()
        if error is None:
            self.saved = self.save_done.result()
        else:
            logger.warning("this turn's cache was not saved: %s", error)
            self.saved = False
        return self.saved


@dataclass(slots=True)
class StreamChunk:
    """A piece of generated text; the last chunk of a stream carries ``result``."""

    text: str
    result: GenerationResult | None = None


def settled(
    chunks: Generator[StreamChunk, None, None], params: GenerationParams | None
) -> Generator[StreamChunk, None, None]:
    """``chunks``, the last one's result waiting for its save where ``params`` ask
    (``GenerationParams.wait_for_save``)."""
    if params is None or not params.wait_for_save:
        return chunks

    def wait() -> Generator[StreamChunk, None, None]:
        with contextlib.closing(chunks):  # a consumer that stops early stops the request
            for chunk in chunks:
                if chunk.result is not None:
                    chunk.result.settle()
                yield chunk

    return wait()


def asettled(
    chunks: AsyncGenerator[StreamChunk, None], params: GenerationParams | None
) -> AsyncGenerator[StreamChunk, None]:
    """``settled`` for an event loop (the save is awaited: the loop is not blocked)."""
    if params is None or not params.wait_for_save:
        return chunks

    async def wait() -> AsyncGenerator[StreamChunk, None]:
        try:
            async for chunk in chunks:
                result = chunk.result
                if result is not None:
                    if result.save_done is not None:
                        saving = asyncio.wrap_future(result.save_done)
                        await asyncio.wait([saving])
                        if not saving.cancelled():
                            # asked here (asyncio logs an error for a future's never asked);
                            # ``settle`` says how the save ended
                            saving.exception()
                    result.settle()
                yield chunk
        finally:
            await chunks.aclose()

    return wait()
