"""The engine facade: ``Engine.generate(agent_id, prompt_text, params)``, ``stream``, their
async twins, and the administration of agents' caches.

One request: match the prompt text against the agent's cache (hot in memory, else its
blocks from the pool / disk), prefill only what is new, decode, then commit the request's
keys and values (prompt tail *and* generated tokens) into the stored form and write the
new blocks. Nothing here knows about LangChain. The rooms behind it:

- ``agents``: the agent-cache manager (lookup, match, load, cold start, commit, hot policy);
- ``steps``: a request's steps as the scheduler runs them (``scheduler``, ``worker``);
- ``runner``: prefill chunks, batched decode steps, sampling;
- ``text``: the streamed reply, stop sequences, token ends;
- ``kv/``: codecs, layer caches, batches; ``model/``: loading, families, CPU kernels;
  ``storage/``: the block store and pool.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..config import get_settings
from . import device
from .agents import AgentCaches, HotPolicy, PendingSave
from .kv import KVQuant, ModelCacheSpec
from .kv import kv_format as kv_format_of
from .kv.reserve import WorkReserve, reserve_rows
from .model.adapters import is_adapted
from .model.fingerprint import model_fingerprint
from .model.loading import LoadedModel, load_model, trained_context
from .prefix import tokenize_prompt
from .results import (
    CacheOutcome,
    CacheSource,
    ContextLengthError,
    GenerationParams,
    GenerationResult,
    StreamChunk,
    Timings,
)
from .runner import ModelRunner
from .runtime import mx
from .saves import SaveQueue
from .saves import wait_for as wait_for_saves
from .scheduler import Phase, Scheduler
from .steps import Request, RequestSteps
from .storage.budget import DiskWatch, EvictionReport, StorageBudget
from .storage.pool import BlockPool
from .storage.shared import open_store
from .storage.store import AgentRecord, validate_agent_id
from .worker import Sink, Start, Worker

__all__ = [
    "CacheOutcome",
    "CacheSource",
    "ContextLengthError",
    "Engine",
    "GenerationParams",
    "GenerationResult",
    "StreamChunk",
    "Timings",
]

logger = logging.getLogger(__name__)

#: Over its byte budget, an engine evicts down to this share of it (headroom for the next
#: saves: an eviction pass then runs every few saves, not after each).
LOW_WATER = 0.9


class Engine:
    """Persistent per-agent KV caches around one mlx-lm model.

    ``model``: a shipped name, an mlx-lm directory of a supported family or a ``.gguf``;
    ``kv_bits`` (4, 8, None = 16-bit) or ``kv_format`` (a ``KV_PRESETS`` name); budgets for
    the pool's memory tier (``hot_budget_bytes``), live agents (``hot_agents``) and their
    full-precision working copies (``work_budget_bytes``) and the prefill chunk
    (``chunk_tokens``): None picks the device's (``device``: fixed on the CPU, from its
    memory on a GPU); ``attention``: what a request attends over, ``"stored"`` (the agent's
    stored form, 4-bit by default, and this request's own tokens: no full-precision copy of
    the context, ``kv.stored``) or ``"copy"`` (a full-precision working copy, kept for the
    most recent agents within ``work_budget_bytes``); None: settings
    ``AGENT_MEMORY_ATTENTION``, else ``device.attention`` (stored on a GPU, copy on the CPU);
    ``cpu_kernels=False`` runs mlx-lm's own attention
    on arrays the engine's caches return, for tests and benchmarks; ``share_prefixes``:
    requests in flight together whose prompts start alike (a fan-out) prefill the common
    part once (``sharing``); ``store`` (a ``postgresql://`` URL) and ``blocks`` (an
    ``s3://`` URL): caches shared by workers on several hosts, this ``cache_dir`` the local
    tier in front (``storage.shared``; default: settings ``AGENT_MEMORY_STORE`` /
    ``AGENT_MEMORY_BLOCKS``, else this directory only). ``max_disk_bytes`` (``5GB``,
    ``500MiB`` or bytes) and ``cache_ttl`` (``7d``, ``12h``, seconds or a ``timedelta``)
    bound what this engine's store keeps on disk: agents least recently used (and unused for
    longer than the TTL) are evicted, never one a request is using (``storage.budget``;
    default: settings ``AGENT_MEMORY_MAX_DISK_BYTES`` / ``AGENT_MEMORY_CACHE_TTL``, else
    unbounded). With a shared store it bounds this worker's local tier; the store keeps
    everything. ``reserve_work`` (CPU): touch, at start, the working-copy memory of one
    agent at ``context_length`` (within ``work_budget_bytes``), as llama.cpp's context
    clears its KV buffer, so that a warm restore does not pay for fresh pages
    (``kv.reserve``); MLX's buffer cache holds it while the engine lives (None: settings
    ``AGENT_MEMORY_RESERVE_WORK``, default on).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        kv_bits: int | None = 4,
        kv_format: str | KVQuant | None = None,
        hot_budget_bytes: int | None = None,
        hot_agents: int = 16,
        work_budget_bytes: int | None = None,
        chunk_tokens: int | None = None,
        scheduling: str = "interleave",
        context_length: int | None = None,
        cpu_kernels: bool = True,
        share_prefixes: bool = True,
        store: str | None = None,
        blocks: str | None = None,
        max_disk_bytes: int | str | None = None,
        cache_ttl: float | str | timedelta | None = None,
        reserve_work: bool | None = None,
        attention: str | None = None,
    ) -> None:
        settings = get_settings()
        self.cache_dir = Path(cache_dir or settings.cache_dir)
        self.lm: LoadedModel = load_model(model, cpu_kernels=cpu_kernels)  # refuses unsupported families
        self.spec = ModelCacheSpec.from_model(self.lm.model)
        context_length = context_length or trained_context(self.lm.path) or 1 << 20
        # kv_format (a KV_PRESETS name or a KVQuant) wins over the kv_bits shorthand.
        self.quant = kv_format_of(kv_format if kv_format is not None else kv_bits)
        for layer in self.spec.layers:
            self.quant.check_dims(layer.k_head_dim, layer.v_head_dim)
        # Converted models and their weight digests live in the settings' cache directory.
        self.fingerprint = model_fingerprint(
            self.lm.path, self.spec, self.quant, settings.cache_dir / "models"
        )
        # Shared by workers (Postgres + S3, this directory in front) or this directory only.
        store, blocks = store or settings.store, blocks or settings.blocks
        # Saves this process queued into that directory (another engine's) are in it first.
        store_dir = (self.cache_dir / "kv").expanduser().resolve() / self.fingerprint
        wait_for_saves(store_dir)
        self._store = open_store(self.cache_dir / "kv", self.fingerprint, store, blocks)
        #: Block writes, checksums, fsync and index transactions of finished requests.
        self._save_queue = SaveQueue(store_dir)

        #: (model directory, cache directory, KV format, store, blocks): ``shared.engine_key``.
        self.key = (self.lm.path, self.cache_dir.expanduser().resolve(), self.quant.label, store, blocks)
        self.pool = BlockPool(
            self._store, device.hot_budget_bytes() if hot_budget_bytes is None else hot_budget_bytes
        )
        # A chunk given is used alone or not; the device's default is larger when alone.
        alone_chunk = chunk_tokens or device.alone_chunk_tokens()
        self.chunk_tokens = chunk_tokens = chunk_tokens or device.chunk_tokens()
        if work_budget_bytes is None:
            work_budget_bytes = device.work_budget_bytes()
        self.attention = attention or settings.attention or device.attention()
        if self.attention not in ("stored", "copy"):
            raise ValueError(f"attention must be 'stored' or 'copy', not {self.attention!r}")
        # On the CPU kernels' model a prefill runs in the codec's rotated space
        # (``LayerCache.attend``); elsewhere the caches stay in the model's space.
        policy = HotPolicy(hot_agents, work_budget_bytes)
        self.agents = AgentCaches(
            self.spec, self.quant, self._store, self.pool, self.tokenizer, policy,
            prefill_rotated=is_adapted(self.lm.model), serve_stored=self.attention == "stored",
        )  # fmt: skip
        self._reserve: WorkReserve | None = None
        reserve = settings.reserve_work if reserve_work is None else reserve_work
        if reserve and not device.on_gpu() and self.attention == "copy":
            rows = reserve_rows(self.spec, context_length, alone_chunk, work_budget_bytes)
            self._reserve = WorkReserve(self.spec, rows)
            self.agents.reserved_rows = rows
        #: Called with each new agent record after a request commits it, in commit order, on
        #: a thread of their own (a checkpointer's fsync'ing writes never hold up the MLX
        #: worker); ``settle_commits`` waits until every commit so far has been delivered.
        self.commit_listeners: list[Callable[[AgentRecord], None]] = []
        #: Called with the agent id and parameters of each new request, on the caller's
        #: thread, before it is queued (a checkpointer rewinds a resumed thread's agents).
        self.request_hooks: list[Callable[[str, GenerationParams], None]] = []
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-memory-commits")
        steps = RequestSteps(
            self.agents, ModelRunner(self.lm.model), self.tokenizer, context_length, self.lm.name,
            self._queue_save, share_prefixes,
        )  # fmt: skip
        self._steps = steps
        self._scheduler = Scheduler(
            steps.admit, steps.prefill, steps.decode, policy=scheduling, chunk_tokens=chunk_tokens,
            alone_chunk_tokens=alone_chunk, prefill_whole=steps.prefill_whole,
        )  # fmt: skip
        self._arrivals = 0
        self._worker = Worker()  # every request's MLX work runs on this one thread
        self._worker.stepper = self._scheduler
        self._closed = False
        self._disk: DiskWatch | None = None
        self._said_over = False
        self._evicted: deque[str] = deque(maxlen=100)  # the latest evicted agents, oldest first
        self._evicted_count = 0
        self._saves = 0  # requests committed (a save's index growth counts until the next look)
        self.storage_budget = StorageBudget.of(
            max_disk_bytes if max_disk_bytes is not None else settings.max_disk_bytes,
            cache_ttl if cache_ttl is not None else settings.cache_ttl,
        )

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
    def storage_budget(self) -> StorageBudget | None:
        """The disk budget this engine keeps its store within (None: unbounded)."""
        return self._disk.budget if self._disk else None

    @storage_budget.setter
    def storage_budget(self, budget: StorageBudget | None) -> None:
        self._disk = DiskWatch(budget) if budget is not None else None

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def share_prefixes(self) -> bool:
        """Whether requests in flight together fork a prompt prefix they share (``sharing``)."""
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

    # ------------------------------------------------------------------ requests

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

    def _start(self, agent_id: str, prompt: str, params: GenerationParams | None) -> Start:
        self._check_open()
        validate_agent_id(agent_id)
        if not prompt:
            raise ValueError("prompt is empty")
        checked = params or GenerationParams()
        for hook in list(self.request_hooks):
            hook(agent_id, checked)

        def start(cancel: threading.Event, sink: Sink) -> None:  # on the worker
            self._arrivals += 1
            self._scheduler.submit(Request(agent_id, prompt, checked, cancel, sink, self._arrivals))

        return start

    @property
    def store(self) -> Any:
        """The engine's block store, once every save queued so far is in it: what a caller
        reads there includes what every reply so far said it saved."""
        self._save_queue.wait()
        return self._store

    def _queue_save(self, save: PendingSave) -> Future[bool]:
        """A request ended (on the worker): its write goes to the save thread. The future
        says whether the record was stored (False: another worker's save won)."""

        def write() -> bool:
            record = self.agents.write(save)
            if record is not None:
                self._committed(record)
            return record is not None

        return self._save_queue.submit(write, f"agent {save.record.agent_id!r}'s cache")

    def flush(self) -> None:
        """Wait until every reply so far is saved (its blocks and record durable); raise the
        first save that failed since the last ``flush`` (``CacheWriteError``: the agent's
        previous cache is intact). ``close`` flushes too."""
        self._save_queue.flush()

    def _committed(self, record: AgentRecord) -> None:
        """A request's save stored ``record`` (on the save thread)."""
        for listener in self.commit_listeners:
            self._notify.submit(_deliver, listener, record)
        self._saves += 1
        if self._disk is not None:
            try:
                self._keep_budget()
            except Exception:  # the save stands; the budget is kept at the next one
                logger.exception("keeping the cache within its disk budget failed")

    def _keep_budget(self, force: bool = False) -> EvictionReport | None:
        """Evict what the budget says must go (on the save thread: the scheduler's requests
        and the agents with saves queued are in use). Looks at the disk only when
        ``DiskWatch`` says a save may have crossed the budget, or now and then."""
        watch, written, now = self._disk, self.pool.stats.bytes_written, time.time()
        saves = self._saves
        if watch is None or not (force or watch.due(written, saves, now)):
            return None
        budget = watch.budget
        total, oldest = self._store.disk_bytes(), self._store.oldest_use()
        expired = budget.ttl_s is not None and oldest is not None and oldest < now - budget.ttl_s
        report = None
        if expired or (budget.max_bytes is not None and total > budget.max_bytes):
            in_use = self.agents.saving_agents() | {
                r.agent_id
                for r in (*list(self._scheduler.waiting), *list(self._scheduler.active))
                if isinstance(r, Request) and r.phase is not Phase.DONE
            }
            report = self.agents.evict(budget, in_use, low_water=1.0 if force else LOW_WATER)
            total = report.bytes_after
            self._evicted.extend(agent for _, agent in report.evicted)
            self._evicted_count += len(report.evicted)
            if report.over_budget and not self._said_over:
                self._said_over = True
                logger.warning(
                    "cache budget %s cannot be met: the agents in use (or saves not yet uploaded) "
                    "hold %d bytes; it is kept again once they finish",
                    budget, total,
                )  # fmt: skip
        watch.looked(total, written, saves, now)
        return report

    def _disk_stats(self) -> dict[str, Any]:
        assert self._disk is not None
        return {
            "max_bytes": self._disk.budget.max_bytes,
            "ttl_s": self._disk.budget.ttl_s,
            "bytes": self._disk.known,  # at the last look (``disk_bytes()``: now)
            "evicted_agents": self._evicted_count,
            "recently_evicted": list(self._evicted),  # the latest 100, oldest first
        }

    def enforce_storage_budget(self) -> EvictionReport | None:
        """Bring the store within ``storage_budget`` now (it is also kept after every save);
        None without a budget, or when nothing had to go."""
        self._check_open()
        return self._save_queue.submit(lambda: self._keep_budget(True), "the disk budget").result()

    def disk_bytes(self) -> int:
        """Bytes this engine's store holds on disk (what ``max_disk_bytes`` bounds)."""
        return self.store.disk_bytes()

    def settle_commits(self) -> None:
        """Wait until every reply so far is saved and ``commit_listeners`` have seen it."""
        self._save_queue.wait()
        self._notify.submit(lambda: None).result()

    def count_tokens(self, prompt: str) -> int:
        """Tokens a request for ``prompt`` reads (what a cold start would prefill)."""
        return len(tokenize_prompt(self.tokenizer, prompt))

    # ------------------------------------------------------------------ agents' caches

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
            with self.agents.lock:
                for i, agent_id in enumerate(wanted):
                    if i and self._worker.has_waiting:  # a request waits: let it run first
                        self._worker.submit(self._prefetch_some, wanted[i:], loaded, done)
                        return
                    loaded += self.agents.load_hot(agent_id)
            done.set_result(loaded)
        except Exception as exc:  # a prefetch is an optimisation: report, never hang a waiter
            logger.warning("prefetch failed: %s", exc)
            done.set_exception(exc)

    def agent_records(self, prefix: str = "") -> list[AgentRecord]:
        """The stored records of every agent whose id starts with ``prefix``."""
        return list(self.store.agents(prefix))  # the store's reads: not the model steps' lock

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does: a fork, a snapshot or a
        restore. Blocks are shared (reference counts move), no tensor is copied. Runs after
        the saves queued before it (on the save thread)."""
        self._save_queue.submit(
            lambda: self.agents.set_agent(agent_id, source), f"agent {agent_id!r}"
        ).result()

    def delete(self, agent_id: str) -> bool:
        """Forget an agent's cache (memory and disk); shared blocks stay for other agents.
        Runs after the saves queued before it (on the save thread)."""
        return self._save_queue.submit(lambda: self.agents.delete(agent_id), f"agent {agent_id!r}").result()

    def cached_tokens(self, agent_id: str) -> int:
        return self.agents.cached_tokens(agent_id)

    def cached_text(self, agent_id: str) -> str:
        """The text the agent's cache stands for (prompt and kept reply), or ""."""
        return self.agents.cached_text(agent_id)

    def drop_hot(self, agent_id: str | None = None) -> None:
        """Forget live caches (one agent, or all): the next request reloads from blocks
        (once the saves queued so far are written: it reads what they wrote)."""
        self._save_queue.wait()
        self.agents.drop_hot(agent_id)

    def stats(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "hot_agents": len(self.agents.hot),
            # full-precision working copies kept for the next request (``work_budget_bytes``)
            "working_copy_bytes": self.agents.working_copy_bytes(),
            "pool": dataclasses.asdict(self.pool.snapshot_stats()),
            # a shared store's traffic: blocks fetched / uploaded, commits, conflicts, pending saves
            **({"shared_store": dataclasses.asdict(s)} if (s := getattr(self._store, "stats", None)) else {}),
            **({"disk": self._disk_stats()} if self._disk is not None else {}),
            "scheduling": self._scheduler.policy,
            "max_decode_batch": self._scheduler.max_batch,
            # batch size -> generated tokens per second while that many agents decoded together
            "decode_tokens_per_s": {
                b: b * n / total for b, (n, total) in sorted(self._scheduler.decode_time.items()) if total
            },
            # batch size -> the median of its latest steps (seconds): joins and leaves left out
            "decode_step_median_s": {
                b: statistics.median(t) for b, t in sorted(self._scheduler.decode_recent.items())
            },
            # batch size -> [decode steps, seconds in them] (to difference over an interval)
            "decode_steps": {b: [n, total] for b, (n, total) in sorted(self._scheduler.decode_time.items())},
        }

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was closed; create a new one")

    def close(self) -> None:
        """Free this engine's memory (hot agents, their working copies, the in-memory block
        tier) and close its index; what is stored stays on disk. Call it when no request is
        in progress; the engine refuses requests afterwards. Without it an engine lives as
        long as the process: its worker thread holds it (see ``Worker``)."""
        if self._worker.has_waiting:
            raise RuntimeError("close() while requests are in progress: let them finish first")
        self._save_queue.close()  # every reply's save written (a failure was logged)
        with self.agents.lock:
            self.agents.clear_memory()
            self._worker.stepper = None  # the parked thread no longer reaches this engine
            self._closed = True
        self._notify.shutdown(wait=True)  # the listeners see every commit before the index closes
        self._store.close()
        if self._reserve is not None:
            self._reserve.release()
        # MLX keeps freed buffers for reuse; give them back to the system (on the worker,
        # which made them).
        self._worker.submit(mx.clear_cache).result()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deliver(listener: Callable[[AgentRecord], None], record: AgentRecord) -> None:
    try:
        listener(record)
    except Exception:  # a listener's failure is its own; the commit stands
        logger.exception("commit listener %r failed on agent %r", listener, record.agent_id)
