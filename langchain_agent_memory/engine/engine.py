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
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import get_settings
from . import device
from .agents import AgentCaches, HotPolicy
from .kv import KVQuant, ModelCacheSpec
from .kv import kv_format as kv_format_of
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
from .scheduler import Scheduler
from .steps import Request, RequestSteps
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


class Engine:
    """Persistent per-agent KV caches around one mlx-lm model.

    ``model``: a shipped name, an mlx-lm directory of a supported family or a ``.gguf``;
    ``kv_bits`` (4, 8, None = 16-bit) or ``kv_format`` (a ``KV_PRESETS`` name); budgets for
    the pool's memory tier (``hot_budget_bytes``), live agents (``hot_agents``) and their
    full-precision working copies (``work_budget_bytes``) and the prefill chunk
    (``chunk_tokens``): None picks the device's (``device``: fixed on the CPU, from its
    memory on a GPU); ``cpu_kernels=False`` runs
    mlx-lm's own attention on the engine's caches (the path a GPU takes), for tests and
    benchmarks on a CPU; ``share_prefixes``: requests in flight together whose prompts
    start alike (a fan-out) prefill the common part once (``sharing``); ``store`` (a
    ``postgresql://`` URL) and ``blocks`` (an ``s3://`` URL): caches shared by workers on
    several hosts, this ``cache_dir`` the local tier in front (``storage.shared``; default:
    settings ``AGENT_MEMORY_STORE`` / ``AGENT_MEMORY_BLOCKS``, else this directory only).
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
    ) -> None:
        settings = get_settings()
        self.cache_dir = Path(cache_dir or settings.cache_dir)
        self.lm: LoadedModel = load_model(model, cpu_kernels=cpu_kernels)  # refuses unsupported families
        self.spec = ModelCacheSpec.from_model(self.lm.model)
        #: Most tokens (prompt + reply) one agent's context holds: the model's trained
        #: context unless given (a longer one runs, with RoPE past what it was trained on).
        self.context_length = context_length or trained_context(self.lm.path) or 1 << 20
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
        self.store = open_store(self.cache_dir / "kv", self.fingerprint, store, blocks)
        #: (model directory, cache directory, KV format, store, blocks): ``shared.engine_key``.
        self.key = (self.lm.path, self.cache_dir.expanduser().resolve(), self.quant.label, store, blocks)
        self.pool = BlockPool(
            self.store, device.hot_budget_bytes() if hot_budget_bytes is None else hot_budget_bytes
        )
        self.chunk_tokens = chunk_tokens = chunk_tokens or device.chunk_tokens()
        if work_budget_bytes is None:
            work_budget_bytes = device.work_budget_bytes()
        # On the CPU an adapted model attends through ``LayerCache.attend``, which prefills
        # in the codec's rotated space; elsewhere the caches stay in the model's space.
        policy = HotPolicy(hot_agents, work_budget_bytes)
        self.agents = AgentCaches(
            self.spec, self.quant, self.store, self.pool, self.tokenizer, policy, is_adapted(self.lm.model)
        )
        #: Called with each new agent record after a request commits it, in commit order, on
        #: a thread of their own (a checkpointer's fsync'ing writes never hold up the MLX
        #: worker); ``settle_commits`` waits until every commit so far has been delivered.
        self.commit_listeners: list[Callable[[AgentRecord], None]] = []
        #: Called with the agent id and parameters of each new request, on the caller's
        #: thread, before it is queued (a checkpointer rewinds a resumed thread's agents).
        self.request_hooks: list[Callable[[str, GenerationParams], None]] = []
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-memory-commits")
        steps = RequestSteps(
            self.agents, ModelRunner(self.lm.model), self.tokenizer, self.context_length, self.lm.name,
            self._committed, share_prefixes,
        )  # fmt: skip
        self._steps = steps
        self._scheduler = Scheduler(
            steps.admit, steps.prefill, steps.decode, policy=scheduling, chunk_tokens=chunk_tokens
        )
        self._arrivals = 0
        self._worker = Worker()  # every request's MLX work runs on this one thread
        self._worker.stepper = self._scheduler
        self._closed = False

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

    def _committed(self, record: AgentRecord) -> None:
        for listener in self.commit_listeners:
            self._notify.submit(_deliver, listener, record)

    def settle_commits(self) -> None:
        """Wait until ``commit_listeners`` have seen every commit made so far."""
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
        with self.agents.lock:
            return list(self.store.agents(prefix))

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does: a fork, a snapshot or a
        restore. Blocks are shared (reference counts move), no tensor is copied."""
        self.agents.set_agent(agent_id, source)

    def delete(self, agent_id: str) -> bool:
        """Forget an agent's cache (memory and disk); shared blocks stay for other agents."""
        return self.agents.delete(agent_id)

    def cached_tokens(self, agent_id: str) -> int:
        return self.agents.cached_tokens(agent_id)

    def cached_text(self, agent_id: str) -> str:
        """The text the agent's cache stands for (prompt and kept reply), or ""."""
        return self.agents.cached_text(agent_id)

    def drop_hot(self, agent_id: str | None = None) -> None:
        """Forget live caches (one agent, or all): the next request reloads from blocks."""
        self.agents.drop_hot(agent_id)

    def stats(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "hot_agents": len(self.agents.hot),
            # full-precision working copies kept for the next request (``work_budget_bytes``)
            "working_copy_bytes": self.agents.working_copy_bytes(),
            "pool": dataclasses.asdict(self.pool.snapshot_stats()),
            # a shared store's traffic: blocks fetched / uploaded, commits, conflicts, pending saves
            **({"shared_store": dataclasses.asdict(s)} if (s := getattr(self.store, "stats", None)) else {}),
            "scheduling": self._scheduler.policy,
            "max_decode_batch": self._scheduler.max_batch,
            # batch size -> generated tokens per second while that many agents decoded together
            "decode_tokens_per_s": {
                b: b * n / total for b, (n, total) in sorted(self._scheduler.decode_time.items()) if total
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
        with self.agents.lock:
            self.agents.clear_memory()
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


def _deliver(listener: Callable[[AgentRecord], None], record: AgentRecord) -> None:
    try:
        listener(record)
    except Exception:  # a listener's failure is its own; the commit stands
        logger.exception("commit listener %r failed on agent %r", listener, record.agent_id)
