"""The engine facade: ``Engine.generate(agent_id, prompt_text, params)`` and ``stream``.

One request: match the prompt text against the agent's cache (hot in memory, else its
blocks from the pool / disk), prefill only what is new, decode, then commit the request's
keys and values (prompt tail *and* generated tokens) into the stored form and write the
new blocks. Nothing here knows about LangChain.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..config import get_settings
from .adapters import is_adapted
from .cache import (
    BatchLayerCache,
    KVQuant,
    LayerCache,
    batch_layer_caches,
    make_layer_caches,
)
from .cache import kv_format as kv_format_of
from .constrain import TokenConstraint
from .fingerprint import model_fingerprint
from .forward import decode_step, prefill_chunk
from .models import LoadedModel, load_model
from .pool import BlockPool
from .prefix import NOT_A_BOUNDARY, MatchKind, PrefixMatch, TokenizedText, match, tokenize
from .runtime import mx
from .scheduler import Phase, Scheduler
from .spec import ModelCacheSpec
from .store import (
    BLOCK_TOKENS,
    AgentRecord,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    CacheWriteError,
    DiskBlockStore,
    NewerFormatError,
    block_hash,
    validate_agent_id,
)
from .worker import Sink, Start, Worker

logger = logging.getLogger(__name__)

#: Prefill chunk of a request: a new arrival waits for at most one chunk of another agent's
#: cold prefill (benchmarks/concurrency.py: behind a 3.9K-token cold prefill, 0.59 s with
#: 128-token chunks, 3.9 s with 512), and on CPU prefill is as fast from 128 tokens a chunk
#: up (3161 tokens: 16-19 s at 128, 256 and 512 alike).
ENGINE_CHUNK_TOKENS = 128


#: Default ``Engine(work_budget_bytes=...)``: one 16K-token SmolLM2 agent (754 MB at
#: float32), or ~15 Gemma 3 270M agents of 8K tokens (its sliding layers keep their window).
WORK_BUDGET_BYTES = 1 << 30


class CacheSource(str, Enum):
    COLD = "cold"  # nothing reused: full prefill
    WARM = "warm"  # reused, read (at least partly) from disk
    HOT = "hot"  # reused from memory


@dataclass(frozen=True, slots=True)
class CacheOutcome:
    source: CacheSource
    match: MatchKind

    def __str__(self) -> str:
        return (
            self.source.value
            if self.source is CacheSource.COLD
            else f"{self.source.value}-{self.match.value}"
        )


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context window."""


@dataclass(slots=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: Restricts sampling to what a grammar allows (``constrain.GrammarConstraint``); it is
    #: stateful: one per request.
    constraint: TokenConstraint | None = None
    #: Stop decoding after this many seconds from the request's start (``"timeout"``).
    timeout_s: float | None = None


@dataclass(slots=True)
class Timings:
    load_s: float = 0.0  # building the cache from blocks (memory or disk)
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start -> first token sampled
    decode_s: float = 0.0
    save_s: float = 0.0


@dataclass(slots=True)
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    outcome: CacheOutcome
    finish_reason: str  # "stop" (end of turn or stop sequence), "length", "cancelled", "timeout"
    timings: Timings
    bytes_written: int = 0


@dataclass(slots=True)
class StreamChunk:
    """A piece of generated text; the last chunk of a stream carries ``result``."""

    text: str
    result: GenerationResult | None = None


@dataclass(slots=True)
class _AgentState:
    tokens: TokenizedText  # what the committed cache stands for
    blocks: list[BlockHash]
    layers: list[LayerCache] | None  # live caches (hot), or None (rebuild from blocks)


@dataclass(eq=False)
class _Request:
    """One generation request as the scheduler advances it (see ``scheduler``)."""

    agent_id: str
    prompt: str
    params: GenerationParams
    cancel: threading.Event
    sink: Sink
    arrival: int
    phase: Phase = Phase.PREFILL
    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=Timings)
    # set when admitted
    state: _AgentState | None = None
    source: CacheSource = CacheSource.COLD
    match: PrefixMatch | None = None
    layers: list[LayerCache] = field(default_factory=list)
    known: TokenizedText | None = None  # what the cache holds (grows as tokens are fed)
    tail: TokenizedText | None = None  # the prompt's tokens still to prefill
    prefilled: int = 0
    reused: int = 0
    prompt_tokens: int = 0
    max_new: int = 0  # tokens it may generate: max_tokens, or what the context has left
    sampler: Any = None
    detok: Any = None
    eos: set[int] = field(default_factory=set)
    hold: int = 0
    # decoding
    token: int = 0  # sampled, to be fed next
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    ended_by_eos: bool = False
    decode_t0: float = 0.0

    @property
    def remaining_prefill(self) -> int:
        return len(self.tail) - self.prefilled if self.tail is not None else 0


class Engine:
    """Persistent per-agent KV caches around one mlx-lm model."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        kv_bits: int | None = 4,
        kv_format: str | KVQuant | None = None,
        hot_budget_bytes: int = 512 << 20,
        hot_agents: int = 16,
        work_budget_bytes: int = WORK_BUDGET_BYTES,
        chunk_tokens: int = ENGINE_CHUNK_TOKENS,
        scheduling: str = "interleave",
        context_length: int | None = None,
        cpu_kernels: bool = True,
    ) -> None:
        settings = get_settings()
        self.cache_dir = Path(cache_dir or settings.cache_dir)
        # Converted models live in the settings' cache directory, shared by every engine.
        # Refuses an unsupported family. ``cpu_kernels=False``: mlx-lm's own attention on the
        # engine's caches (the protocol path a GPU takes), for tests and benchmarks on a CPU.
        self.lm: LoadedModel = load_model(model, cpu_kernels=cpu_kernels)
        self.spec = ModelCacheSpec.from_model(self.lm.model)
        #: On the CPU the adapted model attends through ``LayerCache.attend``, which
        #: prefills in the codec's rotated space; elsewhere the caches stay in model space.
        self._prefill_rotated = is_adapted(self.lm.model)
        #: Most tokens (prompt + reply) one agent's context holds: the model's trained
        #: context unless given (a longer one runs, with RoPE past what it was trained on).
        self.context_length = context_length or _trained_context(self.lm.path)
        # kv_format (a KV_PRESETS name or a KVQuant) wins over the kv_bits shorthand.
        self.quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
        for layer in self.spec.layers:
            self.quant.check_dims(layer.k_head_dim, layer.v_head_dim)
        self.fingerprint = model_fingerprint(
            self.lm.path, self.spec, self.quant, memo_dir=get_settings().cache_dir / "models"
        )
        self.store = DiskBlockStore(self.cache_dir / "kv", self.fingerprint)
        self.pool = BlockPool(self.store, hot_budget_bytes)
        self.chunk_tokens = chunk_tokens
        self.hot_agents = hot_agents
        #: Full-precision working copies kept for the most recent hot agents (their next
        #: request unpacks nothing); past this, older agents keep only the stored form.
        self.work_budget_bytes = work_budget_bytes
        self._agents: OrderedDict[str, _AgentState] = OrderedDict()  # hot agents, LRU order
        self._lock = threading.RLock()  # guards the agent table and the pool
        self._scheduler = Scheduler(
            self._admit, self._prefill_chunk, self._decode, policy=scheduling, chunk_tokens=chunk_tokens
        )
        self._arrivals = 0
        self._batch: tuple[tuple[int, ...], list[BatchLayerCache]] | None = None  # see _batch_caches
        self._worker = Worker()  # every request's MLX work runs on this one thread
        self._closed = False
        self._worker.stepper = self._scheduler
        #: Called with each new agent record after a request commits it, in commit order, on
        #: a thread of their own (a checkpointer's fsync'ing writes never hold up the MLX
        #: worker); ``settle_commits`` waits until every commit so far has been delivered.
        self.commit_listeners: list[Callable[[AgentRecord], None]] = []
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-memory-commits")

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    # ------------------------------------------------------------------ public API

    def generate(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> GenerationResult:
        result = None
        for chunk in self.stream(agent_id, prompt, params):
            result = chunk.result or result
        assert result is not None
        return result

    async def agenerate(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> GenerationResult:
        result = None
        async for chunk in self.astream(agent_id, prompt, params):
            result = chunk.result or result
        assert result is not None
        return result

    def stream(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> Iterator[StreamChunk]:
        """Text chunks as they are decoded; the last one carries the ``GenerationResult``.
        Runs on the engine's worker thread; closing the iterator early stops decoding (what
        was generated is kept in the cache, ``finish_reason == "cancelled"``)."""
        return self._worker.iterate(self._start(agent_id, prompt, params))

    def astream(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> AsyncIterator[StreamChunk]:
        """``stream`` for an event loop: the loop never blocks on MLX work."""
        return self._worker.aiterate(self._start(agent_id, prompt, params))

    def delete(self, agent_id: str) -> bool:
        """Forget an agent's cache (memory and disk); shared blocks stay for other agents."""
        with self._lock:
            self._agents.pop(agent_id, None)
            return self.pool.delete_agent(agent_id)

    def prefetch(self, agent_ids: Iterable[str]) -> Future[int]:
        """Load these agents' caches into memory in the background (on the worker thread),
        in the order given: blocks read and layer caches built, so each one's next request
        starts hot. Agents already live or without a cache are skipped. A request that
        arrives meanwhile goes first: the rest is queued again behind it. The future gives
        how many were loaded."""
        self._check_open()
        done: Future[int] = Future()
        self._worker.submit(self._prefetch_some, list(agent_ids), 0, done)
        return done

    def _prefetch_some(self, wanted: list[str], loaded: int, done: Future[int]) -> None:
        try:
            self._prefetch_from(wanted, loaded, done)
        except Exception as exc:  # a prefetch is an optimisation: report, never hang a waiter
            logger.warning("prefetch failed: %s", exc)
            done.set_exception(exc)

    def _prefetch_from(self, wanted: list[str], loaded: int, done: Future[int]) -> None:
        with self._lock:
            for i, agent_id in enumerate(wanted):
                if i and self._worker.has_waiting:  # a request waits: let it run first
                    self._worker.submit(self._prefetch_some, wanted[i:], loaded, done)
                    return
                live = self._agents.get(agent_id)
                if live is not None and live.layers is not None:
                    continue
                state, _ = self._lookup(agent_id)
                if state is None:
                    continue
                layers, _ = self._materialize(agent_id, state, len(state.tokens))
                if layers is not None:
                    state.layers = layers
                    self._keep_hot(agent_id, state)
                    loaded += 1
        done.set_result(loaded)

    def agent_records(self, prefix: str = "") -> list[AgentRecord]:
        """The stored records of every agent whose id starts with ``prefix``."""
        with self._lock:
            return list(self.store.agents(prefix))

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does: a fork, a snapshot or a
        restore. Blocks are shared (reference counts move), no tensor is copied."""
        validate_agent_id(agent_id)
        with self._lock:
            record = AgentRecord(
                agent_id, list(source.blocks), list(source.token_ids), list(source.token_ends), source.text
            )
            self.pool.set_agent(record)
            self._agents.pop(agent_id, None)  # a live copy would stand for the old text

    def cached_tokens(self, agent_id: str) -> int:
        with self._lock:
            state = self._agents.get(agent_id)
            if state is not None:
                return len(state.tokens)
            record = self._read_record(agent_id)
            return len(record.token_ids) if record else 0

    def cached_text(self, agent_id: str) -> str:
        """The text the agent's cache stands for (prompt and kept reply), or ""."""
        with self._lock:
            state, _ = self._lookup(agent_id)
            return state.tokens.text if state else ""

    def drop_hot(self, agent_id: str | None = None) -> None:
        """Forget live caches (one agent, or all): the next request reloads from blocks."""
        with self._lock:
            if agent_id is None:
                self._agents.clear()
            else:
                self._agents.pop(agent_id, None)

    def settle_commits(self) -> None:
        """Wait until ``commit_listeners`` have seen every commit made so far."""
        self._notify.submit(lambda: None).result()

    def close(self) -> None:
        """Free this engine's memory (hot agents, their working copies, the in-memory block
        tier) and close its index; what is stored stays on disk. Call it when no request is
        in progress; the engine refuses requests afterwards. Without it an engine lives as
        long as the process: its worker thread holds it (see ``Worker``)."""
        if self._worker.has_waiting:
            raise RuntimeError("close() while requests are in progress: let them finish first")
        with self._lock:
            self._agents.clear()
            for h in self.pool.hot_hashes():
                self.pool.forget(h)
            self._worker.stepper = None  # the parked thread no longer reaches this engine
            self._closed = True
        self._notify.shutdown(wait=True)  # the listeners see every commit before the index closes
        self.store.close()
        # MLX keeps freed buffers for reuse; give them back to the system (on the worker,
        # which made them).
        self._worker.submit(mx.clear_cache).result()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one request

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was closed; create a new one")

    def _start(self, agent_id: str, prompt: str, params: GenerationParams | None) -> Start:
        self._check_open()
        validate_agent_id(agent_id)
        if not prompt:
            raise ValueError("prompt is empty")
        checked = params or GenerationParams()

        def start(cancel: threading.Event, sink: Sink) -> None:  # on the worker
            self._arrivals += 1
            self._scheduler.submit(_Request(agent_id, prompt, checked, cancel, sink, self._arrivals))

        return start

    # ------------------------------------------------------------------ a request's steps
    # Called by the scheduler on the worker thread. A step that fails fails its request
    # only (the error reaches that request's caller); the others go on.

    def _admit(self, req: _Request) -> None:
        """Find and load the agent's cache, tokenize what it lacks: ready to prefill."""
        try:
            with self._lock:
                state, source = self._lookup(req.agent_id)
                m = match(state.tokens, req.prompt) if state else match(TokenizedText(""), req.prompt)
                layers: list[LayerCache] | None = None
                if state is not None and m.kind is not MatchKind.MISS:
                    t0 = time.perf_counter()
                    layers, from_disk = self._materialize(req.agent_id, state, m.reuse_tokens)
                    req.timings.load_s = time.perf_counter() - t0
                    if from_disk:
                        source = CacheSource.WARM
                if layers is None:
                    known, tail, layers, m, source = self._cold_start(req.prompt, req.timings)
                else:
                    assert state is not None
                    known = TokenizedText(state.tokens.text, state.tokens.ids[:], state.tokens.ends[:])
                    known.truncate(m.reuse_tokens)
                    if not req.prompt.startswith(known.text) or len(known.text) != m.reuse_chars:
                        raise RuntimeError("prefix bookkeeping out of step (this is a bug)")
                    tail = tokenize(self.tokenizer, req.prompt[len(known.text) :], add_special_tokens=False)
            from mlx_lm.sample_utils import make_sampler

            p = req.params
            req.state, req.source, req.match, req.layers, req.known, req.tail = (
                state,
                source,
                m,
                layers,
                known,
                tail,
            )
            req.reused, req.prompt_tokens = len(known), len(known) + len(tail)
            if req.prompt_tokens >= self.context_length:
                raise ContextLengthError(
                    f"the prompt is {req.prompt_tokens} tokens; {self.lm.name} reads at most "
                    f"{self.context_length} (prompt and reply): shorten the messages or start a new agent"
                )
            req.max_new = min(p.max_tokens, self.context_length - req.prompt_tokens)
            req.sampler = make_sampler(temp=p.temperature, top_p=p.top_p if p.top_p < 1.0 else 0.0)
            req.detok = self.tokenizer.detokenizer
            req.eos = set(self.tokenizer.eos_token_ids)
            req.hold = max((len(s) for s in p.stop if s), default=1) - 1  # a stop may be mid-way
        except BaseException as exc:
            self._fail(req, exc)

    def _prefill_chunk(self, req: _Request, n: int) -> None:
        """Run up to ``n`` of the request's new tokens; after the last, sample its first."""
        try:
            with self._lock:
                assert req.tail is not None and req.known is not None
                t0 = time.perf_counter()
                ids = req.tail.ids[req.prefilled : req.prefilled + n]
                req.prefilled += len(ids)
                logits = prefill_chunk(self.lm.model, ids, req.layers, last=req.remaining_prefill == 0)
                if logits is None:
                    req.timings.prefill_s += time.perf_counter() - t0
                    return
                token = self._sample(req, logits)
                req.timings.prefill_s += time.perf_counter() - t0
                req.timings.ttft_s = time.perf_counter() - req.t_start
                req.known.extend(req.tail)
                req.phase = Phase.DECODE
                req.decode_t0 = time.perf_counter()
                self._accept(req, token)
        except BaseException as exc:
            self._fail(req, exc)

    def _decode(self, reqs: list[_Request]) -> None:
        """One decode step for every decoding request, in one batched forward pass."""
        try:
            with self._lock:
                if len(reqs) == 1:
                    rows = decode_step(self.lm.model, reqs[0].token, reqs[0].layers)[None]
                else:
                    tokens = mx.array([r.token for r in reqs])[:, None]
                    rows = self.lm.model(tokens, cache=self._batch_caches(reqs))[:, -1].astype(mx.float32)
                # Greedy rows without a grammar: one argmax and one sync for all of them.
                plain = [
                    i for i, r in enumerate(reqs) if r.params.temperature == 0 and r.params.constraint is None
                ]
                greedy = (
                    dict(zip(plain, mx.argmax(rows[mx.array(plain)], axis=-1).tolist(), strict=True))
                    if plain
                    else {}
                )
                for i, req in enumerate(reqs):
                    try:
                        self._accept(req, greedy[i] if i in greedy else self._sample(req, rows[i]))
                    except BaseException as exc:
                        self._fail(req, exc)
        except BaseException as exc:
            for req in reqs:
                self._fail(req, exc)

    def _batch_caches(self, reqs: list[_Request]) -> list[BatchLayerCache]:
        """The batch's layer caches: kept from step to step while the same requests decode
        together (their merged buffers grow in place), rebuilt when one joins or leaves."""
        members = tuple(id(r) for r in reqs)
        if self._batch is not None and self._batch[0] == members:
            offsets = mx.array([r.layers[0].offset for r in reqs])
            return [c.step(offsets) for c in self._batch[1]]
        self._dissolve_batch()
        caches = batch_layer_caches([r.layers for r in reqs])
        self._batch = (members, caches)
        return caches

    def _dissolve_batch(self) -> None:
        if self._batch is not None:
            for cache in self._batch[1]:
                cache.dissolve()
            self._batch = None

    def _accept(self, req: _Request, token: int) -> None:
        """A sampled token: end of turn, a stop sequence, the length limit, a cancel or a
        timeout finish the request; otherwise its text is streamed and it is fed next."""
        p = req.params
        if len(req.generated) >= req.max_new:
            return self._finish(req, "length")
        if token in req.eos:
            req.ended_by_eos = True
            return self._finish(req, "stop")
        req.generated.append(token)
        req.detok.add_token(token)
        text = req.detok.text
        cut = _find_stop(text, p.stop, req.emitted - req.hold)
        if cut is not None:
            req.text = text[:cut]
            return self._finish(req, "stop", stopped=True)
        if len(text) - req.hold > req.emitted:
            req.sink.item(StreamChunk(text[req.emitted : len(text) - req.hold]))
            req.emitted = len(text) - req.hold
        req.text = text
        if len(req.generated) == req.max_new:
            return self._finish(req, "length")
        if req.cancel.is_set():
            return self._finish(req, "cancelled")
        if p.timeout_s is not None and time.perf_counter() - req.t_start > p.timeout_s:
            return self._finish(req, "timeout")
        req.token = token
        return None

    def _finish(self, req: _Request, finish: str, stopped: bool = False) -> None:
        """Stream the rest of the text, commit the cache, hand over the result."""
        assert req.known is not None
        text = req.text
        if not stopped:
            req.detok.finalize()
            text = req.detok.text
            cut = _find_stop(text, req.params.stop, req.emitted - req.hold)
            if cut is not None:
                text, finish, stopped = text[:cut], "stop", True
        req.timings.decode_s = time.perf_counter() - req.decode_t0
        if len(text) > req.emitted:
            req.sink.item(StreamChunk(text[req.emitted :]))
        # Commit the KV of the prompt and of every generated token that went through the
        # model (all but the last sampled one, unless that one was end-of-turn).
        t0 = time.perf_counter()
        self._dissolve_batch()  # the others go on in a new batch without this one
        with self._lock:
            known, generated = req.known, req.generated
            fed = generated if req.ended_by_eos else generated[:-1]
            if req.layers[0].offset != len(known) + len(fed):
                raise RuntimeError("cache length and token count disagree (this is a bug)")
            gen = self._generated_tokens(known.ids[-1] if known.ids else None, fed)
            if stopped:  # a stop sequence: keep nothing past it
                gen.truncate(_last_clean(gen, sum(1 for e in gen.ends if 0 <= e <= len(text))))
            known.extend(gen)
            written = self._commit(req.agent_id, req.state, known, req.layers, req.reused)
        req.timings.save_s = time.perf_counter() - t0
        source = req.source
        assert req.match is not None
        result = GenerationResult(
            text=text,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=len(generated) + int(req.ended_by_eos),
            reused_tokens=req.reused,
            outcome=CacheOutcome(
                source, req.match.kind if source is not CacheSource.COLD else MatchKind.MISS
            ),
            finish_reason=finish,
            timings=req.timings,
            bytes_written=written,
        )
        req.phase = Phase.DONE
        req.sink.item(StreamChunk("", result))
        req.sink.end()

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._dissolve_batch()
        req.phase = Phase.DONE
        req.sink.error(exc)

    # ------------------------------------------------------------------ helpers

    def _sample(self, req: _Request, logits: mx.array) -> int:
        constraint = req.params.constraint
        if constraint is not None:
            logits = constraint.mask(logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if req.params.seed is not None and req.params.temperature > 0:
            # Per request and step, not one global sequence: the same seed gives the same
            # text however requests interleave.
            mx.random.seed(req.params.seed + len(req.generated))
        token = int(req.sampler(logprobs[None]).item())
        if constraint is not None:
            constraint.advance(token)
        return token

    def _lookup(self, agent_id: str) -> tuple[_AgentState | None, CacheSource]:
        state = self._agents.get(agent_id)
        if state is not None:
            self._agents.move_to_end(agent_id)
            return state, CacheSource.HOT
        record = self._read_record(agent_id)
        if record is None:
            return None, CacheSource.COLD
        tokens = TokenizedText(record.text, record.token_ids, record.token_ends)
        # HOT until a block has to be read from disk (``_materialize`` says so): blocks
        # still in the pool's memory tier serve a recorded agent without any I/O.
        return _AgentState(tokens, record.blocks, None), CacheSource.HOT

    def _read_record(self, agent_id: str) -> AgentRecord | None:
        try:
            return self.store.get_agent(agent_id)
        except NewerFormatError:
            raise  # a newer version's cache: refuse rather than overwrite it
        except CacheFormatError as exc:
            # Moved aside (so this is said once), references kept: the next save reuses
            # the record's sound blocks and rewrites it.
            self.store.quarantine_agent(agent_id)
            logger.warning(
                "agent %r: stored cache record unusable (%s); moved to quarantine/, falling back "
                "to prefill (sound blocks shared by content are still reused), the next save "
                "rewrites it",
                agent_id,
                exc,
            )
            return None

    def _materialize(
        self, agent_id: str, state: _AgentState, n_tokens: int
    ) -> tuple[list[LayerCache] | None, bool]:
        """Layer caches holding the first ``n_tokens`` of ``state`` and whether any block
        came from disk; ``(None, False)`` if the stored cache is unusable (logged)."""
        live = state.layers
        if live is not None and all(_holds_window(layer, n_tokens) for layer in live):
            for layer in live:
                layer.trim_to(n_tokens)
            state.layers = None  # handed over to this request
            return live, False
        try:
            return self._from_blocks(state.blocks, n_tokens)
        except CacheFormatError as exc:
            quarantined = self._quarantine_bad(state.blocks)
            aside = f"; {quarantined} bad block file(s) moved to quarantine/" if quarantined else ""
            logger.warning(
                "agent %r: stored cache unusable (%s)%s; falling back to prefill (sound blocks "
                "shared by content are still reused), the next save rewrites it",
                agent_id,
                exc,
                aside,
            )
            return None, False

    def _quarantine_bad(self, chain: list[BlockHash]) -> int:
        """Move every unreadable block of ``chain`` aside; return how many were moved."""
        moved = 0
        with self.store.locked():
            for h in chain:
                self.pool.forget(h)
                try:
                    self.store.get_block(h)
                except BlockMissingError:
                    continue
                except CacheFormatError:
                    moved += self.store.quarantine_block(h) is not None
        return moved

    def _from_blocks(self, chain: list[BlockHash], n_tokens: int) -> tuple[list[LayerCache], bool]:
        layers = make_layer_caches(self.spec, self.quant, self._prefill_rotated)
        # The first block each layer needs: 0 for full attention, the window's for sliding.
        first = [
            0 if layer.spec.window is None else max(0, n_tokens - layer.spec.window) // BLOCK_TOKENS
            for layer in layers
        ]
        n_blocks = -(-n_tokens // BLOCK_TOKENS)
        if len(chain) < n_blocks:
            raise CacheFormatError(f"agent record names {len(chain)} blocks for {n_tokens} tokens")
        blocks, from_disk = [], False
        for b in range(min(first), n_blocks):
            block, hot = self.pool.get(chain[b])
            blocks.append(block)
            from_disk |= not hot
        base = min(first)
        try:
            self._load_layers(layers, blocks, first, base, n_tokens)
        except KeyError as exc:
            raise CacheFormatError(f"a block lacks tensor {exc}; it was written by another version") from None
        return layers, from_disk

    def _load_layers(
        self, layers: list[LayerCache], blocks: list[Block], first: list[int], base: int, n_tokens: int
    ) -> None:
        kparts, vparts = self.quant.keys.parts(), self.quant.values.parts()
        for i, layer in enumerate(layers):
            own = blocks[first[i] - base :]
            head = None
            if first[i] == 0 and _name(i, "k", HEAD_PART) in own[0].tensors:
                head = (own[0].tensors[_name(i, "k", HEAD_PART)], own[0].tensors[_name(i, "v", HEAD_PART)])
            body = [blk for blk in own if _name(i, "k", kparts[0]) in blk.tensors]
            k = v = None
            if body:
                k = tuple(_joined(body, _name(i, "k", p)) for p in kparts)
                v = tuple(_joined(body, _name(i, "v", p)) for p in vparts)
            layer.load(first[i] * BLOCK_TOKENS, head, k, v)
            held = sum(len(blk.token_ids) for blk in own)
            if layer.offset != first[i] * BLOCK_TOKENS + held:
                raise CacheFormatError(
                    f"layer {i}: blocks hold {layer.offset - layer.start} tokens of K/V for {held} token ids"
                )
            layer.trim_to(n_tokens)

    def _cold_start(
        self, prompt: str, timings: Timings
    ) -> tuple[TokenizedText, TokenizedText, list[LayerCache], Any, CacheSource]:
        """No cache of the agent's own: reuse whole blocks any agent stored for the same
        leading tokens (a shared system prompt), else start empty."""
        bos = self.tokenizer.bos_token
        full = tokenize(self.tokenizer, prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        chain: list[BlockHash] = []
        parent: BlockHash | None = None
        # Whole blocks only, and never the last token (its logits must be computed).
        for b in range((len(full) - 1) // BLOCK_TOKENS):
            h = block_hash(parent, full.ids[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS], self.fingerprint)
            if not (self.pool.is_hot(h) or self.store.has_block(h)):
                break
            chain.append(h)
            parent = h
        while chain and full.ends[len(chain) * BLOCK_TOKENS - 1] == NOT_A_BOUNDARY:
            chain.pop()
        if chain:
            n = len(chain) * BLOCK_TOKENS
            t0 = time.perf_counter()
            try:
                layers, from_disk = self._from_blocks(chain, n)
            except CacheFormatError as exc:
                logger.warning("shared blocks unusable (%s); prefilling from scratch", exc)
            else:
                timings.load_s = time.perf_counter() - t0
                known, tail = full.split(n)
                source = CacheSource.WARM if from_disk else CacheSource.HOT
                return known, tail, layers, PrefixMatch(MatchKind.SHARED, n, len(known.text)), source
        empty = TokenizedText("")
        miss = PrefixMatch(MatchKind.MISS, 0, 0)
        layers = make_layer_caches(self.spec, self.quant, self._prefill_rotated)
        return empty, full, layers, miss, CacheSource.COLD

    def _generated_tokens(self, anchor: int | None, ids: list[int]) -> TokenizedText:
        """Generated ids, their text as it continues the context, and each token's end.

        Decoded after an ``anchor`` token (the last context token) so that tokenizers that
        drop a leading space at the start of a decode keep it here.
        """
        head = [anchor] if anchor is not None else []
        base = self.tokenizer.decode(head)
        ends: list[int] = []
        for i in range(len(ids)):
            piece = self.tokenizer.decode(head + ids[: i + 1])[len(base) :]
            ends.append(NOT_A_BOUNDARY if piece.endswith("\ufffd") else len(piece))
        full = self.tokenizer.decode(head + ids)[len(base) :] if ids else ""
        # A prefix decode that is not a prefix of the whole is not a safe place to cut.
        ends = [e if e == NOT_A_BOUNDARY or e <= len(full) else NOT_A_BOUNDARY for e in ends]
        if ends and ends[-1] != len(full):
            ends[-1] = NOT_A_BOUNDARY
        return TokenizedText(full, ids, ends)

    def _commit(
        self,
        agent_id: str,
        old: _AgentState | None,
        known: TokenizedText,
        layers: list[LayerCache],
        reused: int,
    ) -> int:
        """Store the request's cache: ``known`` (its first ``reused`` tokens as in ``old``)."""
        n = len(known)
        for layer in layers:
            layer.commit(keep_work=self.work_budget_bytes > 0)
            if layer.offset > n:
                layer.trim_to(n)
        chain = self._chain_of(known, old.blocks[: reused // BLOCK_TOKENS] if old else [])
        record = AgentRecord(agent_id, chain, known.ids, known.ends, known.text)
        written = self.pool.save_agent(
            record, lambda b: self._block_of(b, chain, known, layers), old.blocks if old else []
        )
        for listener in self.commit_listeners:
            self._notify.submit(_deliver, listener, record)
        # Sliding layers keep their window and the last (partial) block, for the next save.
        for layer in layers:
            if layer.spec.window is not None:
                layer.drop_before(min(max(0, n - layer.spec.window), (n // BLOCK_TOKENS) * BLOCK_TOKENS))
        self._keep_hot(agent_id, _AgentState(known, chain, layers))
        return written

    def _chain_of(self, known: TokenizedText, kept: list[BlockHash]) -> list[BlockHash]:
        """The block chain of ``known``; ``kept``: the hashes of its first whole blocks,
        already known (a commit hashes only what the request added)."""
        chain = list(kept)
        parent = chain[-1] if chain else None
        for a in range(len(chain) * BLOCK_TOKENS, len(known), BLOCK_TOKENS):
            parent = block_hash(parent, known.ids[a : a + BLOCK_TOKENS], self.fingerprint)
            chain.append(parent)
        return chain

    def _block_of(
        self, b: int, chain: list[BlockHash], known: TokenizedText, layers: list[LayerCache]
    ) -> Block:
        """Block ``b`` of ``chain``: from the hot tier if there, else from the layer caches."""
        hot = self.pool.hot_block(chain[b])
        if hot is not None:  # held in memory but its file is gone (deleted by another process)
            return hot
        a, z = b * BLOCK_TOKENS, min((b + 1) * BLOCK_TOKENS, len(known))
        tensors: dict[str, mx.array] = {}
        for i, layer in enumerate(layers):
            if a < layer.start:  # a sliding layer dropped it, and another process deleted it
                raise CacheWriteError(
                    f"block {b} of this cache was deleted by another process and is no longer in "
                    "memory; the cache was not saved (the next request prefills)"
                )
            head, body = layer.committed_slice(a, z)
            if head is not None:
                tensors[_name(i, "k", HEAD_PART)], tensors[_name(i, "v", HEAD_PART)] = head
            if body is not None:
                for p, arr in zip(self.quant.keys.parts(), body[0], strict=True):
                    tensors[_name(i, "k", p)] = arr
                for p, arr in zip(self.quant.values.parts(), body[1], strict=True):
                    tensors[_name(i, "v", p)] = arr
        return Block(chain[b], chain[b - 1] if b else None, known.ids[a:z], tensors)

    def _keep_hot(self, agent_id: str, state: _AgentState) -> None:
        self._agents[agent_id] = state
        self._agents.move_to_end(agent_id)
        while len(self._agents) > self.hot_agents:
            self._agents.popitem(last=False)
        # Working copies: the most recent agents' first, within the budget (a copy is
        # ~3x the stored form: full precision), the older ones freed.
        used = 0
        for hot in reversed(self._agents.values()):
            for layer in hot.layers or ():
                if used + layer.work_nbytes > self.work_budget_bytes:
                    layer.drop_work()
                used += layer.work_nbytes

    def stats(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "hot_agents": len(self._agents),
            # full-precision working copies kept for the next request (``work_budget_bytes``)
            "working_copy_bytes": sum(
                layer.work_nbytes for state in self._agents.values() for layer in state.layers or ()
            ),
            "pool": dataclasses.asdict(self.pool.snapshot_stats()),
            "scheduling": self._scheduler.policy,
            "max_decode_batch": self._scheduler.max_batch,
            # batch size -> generated tokens per second while that many agents decoded together
            "decode_tokens_per_s": {
                b: b * n / total for b, (n, total) in sorted(self._scheduler.decode_time.items()) if total
            },
        }


_SHARED: dict[tuple[Path, Path, str], Engine] = {}
_SHARED_LOCK = threading.Lock()


def shared_engine(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    kv_bits: int | None = 4,
    kv_format: str | KVQuant | None = None,
    hot_budget_bytes: int | None = None,
) -> Engine:
    """The process's one engine for (model, cache directory, KV format): every chat model
    and checkpointer naming the same three shares its caches, pool and worker thread. A
    larger ``hot_budget_bytes`` than the engine's raises it; a smaller one leaves it."""
    home = _home()
    if not home.on_worker:
        # Built on a long-lived daemon thread, not the caller's: the first call often comes
        # from a LangGraph node's pool thread, and a thread that ran MLX work (loading the
        # model) and then *ends* during interpreter shutdown makes MLX abort (see Worker).
        build = functools.partial(
            shared_engine, model, cache_dir=cache_dir, kv_bits=kv_bits, kv_format=kv_format,
            hot_budget_bytes=hot_budget_bytes,
        )  # fmt: skip
        return home.submit(build).result()
    lm = load_model(model)
    root = Path(cache_dir or get_settings().cache_dir).expanduser().resolve()
    quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
    key = (lm.path, root, quant.label)
    with _SHARED_LOCK:
        engine = _SHARED.get(key)
        if engine is None:
            engine = Engine(model, cache_dir=root, kv_format=quant, **_budget(hot_budget_bytes))
            _SHARED[key] = engine
        elif hot_budget_bytes is not None and hot_budget_bytes > engine.pool.hot_budget_bytes:
            engine.pool.hot_budget_bytes = hot_budget_bytes
        return engine


def _trained_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or 1 << 20)


_HOME: Worker | None = None


def _home() -> Worker:
    """The daemon thread shared engines are built on (created on first use)."""
    global _HOME
    with _SHARED_LOCK:
        if _HOME is None:
            _HOME = Worker(name="agent-memory-init")
        return _HOME


def _budget(hot_budget_bytes: int | None) -> dict[str, int]:
    return {} if hot_budget_bytes is None else {"hot_budget_bytes": hot_budget_bytes}


#: Tensor-name part of a block's head tokens (``KVQuant.head_tokens``, block 0 only).
HEAD_PART = "head"


def _name(layer: int, kv: str, part: str) -> str:
    return f"L{layer}.{kv}.{part}" if part else f"L{layer}.{kv}"


def _joined(blocks: list[Block], name: str) -> mx.array:
    return mx.concatenate([blk.tensors[name] for blk in blocks], axis=2)


def _find_stop(text: str, stops: list[str], search_from: int) -> int | None:
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, search_from))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _deliver(listener: Callable[[AgentRecord], None], record: AgentRecord) -> None:
    try:
        listener(record)
    except Exception:  # a listener's failure is its own; the commit stands
        logger.exception("commit listener %r failed on agent %r", listener, record.agent_id)


def _holds_window(layer: LayerCache, n_tokens: int) -> bool:
    """Whether a live layer can serve a request that keeps its first ``n_tokens``."""
    if layer.committed_end != layer.offset or layer.offset < n_tokens:
        return False
    if layer.spec.window is None:
        return layer.start == 0
    return layer.start <= max(0, n_tokens - layer.spec.window)


def _last_clean(tokens: TokenizedText, limit: int) -> int:
    k = limit
    while k > 0 and tokens.ends[k - 1] == NOT_A_BOUNDARY:
        k -= 1
    return k
