"""The engine facade: ``Engine.generate(agent_id, prompt_text, params)``, ``stream``, their
async twins, and the administration of agents' caches.

One request: match the prompt text against the agent's cache (hot in memory, else its
blocks from the pool / disk), prefill only what is new, decode, then commit the request's
keys and values (prompt tail *and* generated tokens) into the stored form and write the
new blocks. Nothing here knows about LangChain. The rooms behind it:

- ``config``: the settings, resolved once (``EngineConfig``); ``admin``: agents' stored
  caches (``Engine.admin``);
- ``requests/``: a request's path (admissions, the scheduler and the model's thread, its
  steps, the batched runner, forks, the streamed text, the save thread, commit subscribers);
- ``caches/``: the agents' caches (lookup, the reuse rule, the hot tier, commits and writes);
- ``kv/``: codecs, layer caches, batches; ``model/``: loading, structure, CPU kernels;
  ``storage/``: the block store, the pool, the disk budget; ``ops/``: the process's threads,
  files, device and kernels.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from .admin import AgentAdmin, AgentInfo
from .caches.agent_state import HotPolicy
from .caches.agents import AgentCaches
from .caches.prefix_index import Prompt
from .caches.schedule import Schedule
from .config import EngineConfig
from .errors import CommitConflictError
from .kv.reserve import WorkReserve, reserve_rows
from .model.adapters import is_adapted
from .model.fingerprint import model_fingerprint
from .model.loading import LoadedModel, load_model, trained_context
from .ops import device
from .ops.process import RUNTIME
from .ops.runtime import release_memory
from .prefix import tokenize_prompt
from .requests.admissions import StoreAdmissions
from .requests.commits import BeforeRequest, CommitFeed, OnCommit, Subscription
from .requests.committer import Committer
from .requests.runner import ModelRunner
from .requests.saves import SaveQueue
from .requests.saves import wait_for as wait_for_saves
from .requests.scheduler import Phase, Scheduler
from .requests.steps import Request, RequestSteps
from .requests.worker import Sink, Start, Worker
from .results import (
    CacheOutcome,
    CacheSource,
    ContextLengthError,
    GenerationParams,
    GenerationResult,
    StreamChunk,
    Timings,
    asettled,
    settled,
)
from .storage import gather
from .storage.agent_ids import validate_agent_id
from .storage.blocks import AgentNotFoundError, CacheWriteError
from .storage.pool import BlockPool
from .storage.remote import SharedBlockStore, open_store
from .storage.status import StoreStatus

__all__ = [
    "AgentInfo",
    "AgentNotFoundError",
    "CacheOutcome",
    "CacheSource",
    "CacheWriteError",
    "CommitConflictError",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "GenerationParams",
    "GenerationResult",
    "StreamChunk",
    "Subscription",
    "Timings",
]

logger = logging.getLogger(__name__)


class Engine:
    """Persistent per-agent KV caches around one mlx-lm model. ``Engine(model, **options)``:
    the options are ``EngineConfig.resolve``'s (KV format, budgets, attention, shared store,
    disk budget); or ``Engine(EngineConfig.resolve(...))``."""

    def __init__(
        self, model: str | Path | EngineConfig | None = None, *, config: EngineConfig | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        if isinstance(model, EngineConfig):
            config, model = model, None
        cfg = self.config = config or EngineConfig.resolve(model, **options)
        self.cache_dir = cfg.cache_dir
        self.lm: LoadedModel = load_model(
            cfg.model, cache_dir=cfg.models_dir, weight_dtype=cfg.weight_dtype, cpu_kernels=cfg.cpu_kernels
        )  # refuses unsupported families
        self.spec, self.quant, self.attention = self.lm.structure.spec, cfg.quant, cfg.attention
        self.fingerprint = model_fingerprint(self.lm.path, self.spec, self.quant, cfg.models_dir / "models")
        self.key = cfg.key_for(self.lm.path)  # which shared engine this is (``registry``)
        self._closed = False
        # Every part that holds a thread, a connection or memory is entered here as it is
        # built, and ``close`` (or a failed start) ends them in reverse order.
        self._parts = parts = contextlib.ExitStack()
        try:
            self._build(cfg, parts)
        except BaseException:
            parts.close()
            raise
        RUNTIME.track(self)  # closed by the runtime's shutdown if still open then

    def _build(self, cfg: EngineConfig, parts: contextlib.ExitStack) -> None:
        self._worker = Worker()  # every request's MLX work runs on this one thread
        parts.callback(self._worker.stop)
        weakref.finalize(self, self._worker.stop, False).atexit = False  # dropped: thread back
        store_dir = (self.cache_dir / "kv").expanduser().resolve() / self.fingerprint
        wait_for_saves(store_dir)  # saves this process queued there (another engine's) land first
        self._store = open_store(self.cache_dir / "kv", self.fingerprint, cfg.store)
        parts.callback(self._store.close)
        self.pool = BlockPool(self._store, cfg.hot_budget_bytes, self._worker.owner)
        context_length = cfg.context_length or trained_context(self.lm.path) or 1 << 20
        rows = None
        if cfg.reserve_work and not device.on_gpu() and self.attention == "copy":
            rows = reserve_rows(self.spec, context_length, cfg.alone_chunk_tokens, cfg.work_budget_bytes)
            parts.callback(WorkReserve(self.spec, rows).release)
        schedule = Schedule(tool_ttl_s=cfg.tool_ttl_s, follow=cfg.eviction == "schedule", loop=self._worker)
        # A prefill in the codec's rotated space (the CPU kernels) rounds otherwise than one in
        # the model's space where the model computes in 16 bits: a warm turn (its copy built
        # rotated) then parted from the hot one (its copy refreshed in the model's space) on
        # bf16 weights (the matrix's apertus and exaone4, 4-bit KV). At float32 the two agree.
        prefill_rotated = is_adapted(self.lm.model) and self.spec.dtype == "float32"
        self.agents = AgentCaches(
            spec=self.spec, quant=self.quant, store=self._store, pool=self.pool,
            tokenizer=self.tokenizer, policy=HotPolicy(cfg.hot_agents, cfg.work_budget_bytes, cfg.hot_bytes),
            schedule=schedule,
            prefill_rotated=prefill_rotated, serve_stored=self.attention == "stored",
            state_budget=cfg.state_budget, reserved_rows=rows, owner=self._worker.owner,
        )  # fmt: skip
        # The prefix index starts from every chain the store holds (read here, taken in on the
        # loop, which owns it): a new process finds a stored session's next block too.
        chains = [(r.agent_id, r.chain, r.token_ids) for r in self._store.local.records.list(warn=False)]
        self._worker.call(self.agents.index.fill, chains)
        self._feed = CommitFeed(self._worker)
        parts.callback(self._feed.close)  # subscribers hear every commit before the index closes
        parts.callback(self._forget_memory)
        self._save_queue = SaveQueue(store_dir)  # block writes, checksums, fsync, index transactions
        parts.callback(self._save_queue.close)  # every reply's save written (a failure was logged)
        runner = ModelRunner(self.lm.model, self.lm.batches)
        if device.on_gpu():
            # The kernels of a first turn compiled before any request waits for them; the
            # worker runs this first, off the constructor's path (``ModelRunner.warm_up``).
            self._worker.submit(runner.warm_up, self.agents.new_layers, self.tokenizer)
        # A finished turn's save goes down from the loop to the save thread, and how it ended
        # comes back to the loop as a message (``committer``).
        self._committer = Committer(
            caches=self.agents,
            store=self._store,
            saves=self._save_queue,
            loop=self._worker,
            feed=self._feed,
            in_use=self._in_use,
        )
        self._steps = steps = RequestSteps(
            self.agents,
            runner,
            self.tokenizer,
            context_length,
            self.lm.name,
            self._committer,
            cfg.share_prefixes,
        )
        self._scheduler = Scheduler(
            steps.admit, steps.prefill, steps.decode, policy=cfg.scheduling, chunk_tokens=cfg.chunk_tokens,
            alone_chunk_tokens=cfg.alone_chunk_tokens, prefill_whole=steps.prefill_whole,
        )  # fmt: skip
        self.chunk_tokens, self._arrivals = cfg.chunk_tokens, 0
        self._worker.stepper = self._scheduler
        self._admissions: StoreAdmissions | None = None
        if isinstance(self._store, SharedBlockStore):
            # The model's thread never waits on the network: a request's store work is done
            # before it gets there (``admissions``); its parts read the store's local tier.
            self._admissions = StoreAdmissions(
                self.agents, self._store, self._to_scheduler, self._worker.post
            )
            parts.callback(self._admissions.close)
        #: agents' stored caches: records, forks, deletes, prefetch, the disk budget
        self.admin = AgentAdmin(
            caches=self.agents, store=self._store, saves=self._save_queue, feed=self._feed,
            worker=self._worker, admissions=self._admissions, writes=self._committer.writes,
            budget=self._committer.budget, check_open=self._check_open,
        )  # fmt: skip
        self.admin.storage_budget = cfg.storage_budget  # also bounds a shared store's saves waiting to upload

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + reply) one agent's context holds: the model's trained
        context unless given (a longer one runs, with RoPE past what it was trained on)."""
        return self._steps.context_length

    @context_length.setter
    def context_length(self, value: int) -> None:
        if value < 2:
            raise ValueError(f"context_length must be at least 2 tokens, not {value}")
        self._steps.context_length = value

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def share_prefixes(self) -> bool:
        """Whether requests in flight together fork a prompt prefix they share (``forks``)."""
        return self._steps.share_prefixes

    @share_prefixes.setter
    def share_prefixes(self, value: bool) -> None:
        self._steps.share_prefixes = value

    @property
    def work_budget_bytes(self) -> int:
        """Bytes of full-precision working copies the most recent hot agents keep."""
        return self.agents.policy.work_budget_bytes

    @work_budget_bytes.setter
    def work_budget_bytes(self, value: int) -> None:
        self.agents.policy.work_budget_bytes = value

    def count_tokens(self, prompt: str) -> int:
        """Tokens a request for ``prompt`` reads (what a cold start would prefill)."""
        return len(tokenize_prompt(self.tokenizer, prompt))

    # ------------------------------------------------------------------ requests

    def generate(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> GenerationResult:
        return _last_result(self.stream(agent_id, prompt, params))

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
        checked = self._checked(agent_id, prompt, params)
        tokenized = Prompt.of(self.tokenizer, prompt, self.fingerprint)  # once, here, off the loop
        return settled(self._worker.iterate(self._start(agent_id, tokenized, checked)), params)

    def astream(
        self, agent_id: str, prompt: str, params: GenerationParams | None = None
    ) -> AsyncIterator[StreamChunk]:
        """``stream`` for an event loop: the loop never blocks on MLX work, nor on the
        prompt's tokenization (a thread of asyncio's)."""
        checked = self._checked(agent_id, prompt, params)
        return asettled(self._atokenized(agent_id, prompt, checked), params)

    async def _atokenized(
        self, agent_id: str, prompt: str, checked: GenerationParams
    ) -> AsyncGenerator[StreamChunk, None]:
        # NOTE: a 32K-token prompt takes ~75 ms to tokenize on this CPU: on the event loop it
        # would hold every other stream's chunks that long.
        tokenized = await asyncio.to_thread(Prompt.of, self.tokenizer, prompt, self.fingerprint)
        chunks = self._worker.aiterate(self._start(agent_id, tokenized, checked))
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _checked(self, agent_id: str, prompt: str, params: GenerationParams | None) -> GenerationParams:
        """The request's parameters, once the request is known to be one this engine runs
        (told to ``before_request`` subscribers)."""
        self._check_open()
        validate_agent_id(agent_id)
        if not prompt:
            raise ValueError("prompt is empty")
        checked = params or GenerationParams()
        self._feed.before_request(agent_id, checked)
        return checked

    def _start(self, agent_id: str, prompt: Prompt, params: GenerationParams) -> Start:
        """The request's start, run by the loop (``Worker.iterate``)."""

        def start(cancel: threading.Event, sink: Sink) -> None:  # on the worker
            self._arrivals += 1
            request = Request(agent_id, prompt, params, cancel, sink, self._arrivals)
            if self._admissions is None:
                self._scheduler.submit(request)
            else:  # then ``_to_scheduler``, with what the loop knows of the agent now
                self._admissions.submit(request, self.agents.view(agent_id, prompt))

        return start

    def _to_scheduler(self, request: Request) -> None:
        self._worker.submit(self._scheduler.submit, request)

    def subscribe(
        self, on_commit: OnCommit | None = None, before_request: BeforeRequest | None = None
    ) -> Subscription:
        """Hear this engine: ``before_request(agent_id, params)`` on the caller's thread before
        each request is queued; ``on_commit(record)`` after each save, in commit order, on a
        thread of its own. ``close()`` the handle to stop."""
        return self._feed.subscribe(on_commit, before_request)

    # ------------------------------------------------------------------ lifetime

    def flush(self) -> None:
        """Wait until every reply so far is saved (its blocks and record durable); raise the
        first save that failed since the last ``flush`` (``CacheWriteError``: the agent's
        previous cache is intact). ``close`` flushes too."""
        self._save_queue.flush()
        self.admin.settle_saves()  # and the loop has taken in how each ended

    def status(self) -> StoreStatus:
        """The store's state now (reachable, saves waiting to upload, saves queued), without
        waiting for the queued saves: what a readiness probe reads."""
        replication = self._store.replication
        status = replication.status() if replication is not None else StoreStatus(shared=False)
        return dataclasses.replace(status, queued_saves=self._save_queue.queued)

    def _in_use(self) -> set[str]:
        """Agents the disk budget never evicts: saves queued, requests queued or running."""
        running = {
            r.agent_id
            for r in self._scheduler.in_flight()
            if isinstance(r, Request) and r.phase is not Phase.DONE
        }
        preparing = self._admissions.busy() if self._admissions is not None else set()
        return self.agents.saving_agents() | running | preparing

    def stats(self) -> dict[str, Any]:
        shared = getattr(self._store, "stats", None)  # a shared store's traffic
        disk = self.admin.disk_stats()
        return {
            **self._worker.call(self._loop_stats),  # what memory holds: the loop's answer
            **({"shared_store": dataclasses.asdict(shared)} if shared else {}),
            **({"disk": disk} if disk is not None else {}),
        }

    def _loop_stats(self) -> dict[str, Any]:
        """The figures of the loop's state (on the loop)."""
        turns = dict(self._steps.turns)
        return {
            "fingerprint": self.fingerprint,
            "hot_agents": len(self.agents.hot),
            "working_copy_bytes": self.agents.working_copy_bytes(),  # kept for the next request
            # the hot tier: its bounds, what the schedule was told, and where turns found their
            # caches (hot: live in memory; warm: read from disk; cold: prefilled)
            "hot_tier": self.agents.hot_tier(),
            "turns": turns,
            "hot_rate": turns.get("hot", 0) / max(1, sum(turns.values())),
            "pool": dataclasses.asdict(self.pool.snapshot_stats()),
            # memory the caches hold besides the tier and the pool (requests in flight, saves
            # not written): with them, what mlx holds beyond the weights is accounted for
            **self.agents.memory_beside_the_tier(
                r.start.layers for r in self._scheduler.in_flight() if isinstance(r, Request) and r.start
            ),
            "prefix_index": self.agents.index.stats(),
            # agents whose requests wait on the shared store's part of their admission
            **({"admitting": len(self._admissions.busy())} if self._admissions is not None else {}),
            **self._scheduler.stats(),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was closed; create a new one")

    def close(self) -> None:
        """Free this engine's memory (hot agents, working copies, the in-memory block tier,
        given back to the system), its index and its thread; what is stored stays on disk.
        Call it when no request is in progress (again: nothing happens)."""
        if self._closed:
            return
        if self._worker.call(self._requests_in_progress):
            raise RuntimeError("close() while requests are in progress: let them finish first")
        self._parts.close()  # admissions, saves, memory, subscribers, store, reserve, thread

    def _requests_in_progress(self) -> bool:
        """On the loop, after every job queued before the question: whether a request is
        being prepared or run. Asked from outside, the loop's queue alone said so wrongly
        when a finished save's result waited in it (``close`` right after a reply raised)."""
        preparing = self._admissions.busy() if self._admissions is not None else set()
        return self._scheduler.has_work() or bool(preparing)

    def _forget_memory(self) -> None:
        """Live caches and the in-memory block tier freed, their buffers given back to the
        system (on the model's thread, which then no longer reaches this engine)."""
        self._closed = True
        self._worker.call(self._clear_memory)
        self._worker.submit(release_memory).result()
        gather.release()  # the block reader's digest buffers (kept between restores)

    def _clear_memory(self) -> None:
        """On the loop: what memory holds goes, and the loop steps this engine no more."""
        self.agents.clear_memory()
        self._worker.stepper = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_result(chunks: Iterator[StreamChunk]) -> GenerationResult:
    result = None
    for chunk in chunks:
        result = chunk.result or result
    assert result is not None
    return result
