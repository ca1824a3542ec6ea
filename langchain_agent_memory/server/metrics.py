"""``GET /metrics``: the server in Prometheus' text format (``prometheus-client``), as vLLM,
SGLang and llama.cpp expose theirs. Behind the API key unless ``--metrics-public``.

Two kinds, in one registry of the app's own (not the process-wide default: two apps in one
process keep apart):

- per reply, as it ends (``ReplyMetrics``, a LangChain callback on each served chat model,
  and the plain completions route): time to first token and decode time (histograms), the
  prompt's tokens by where the agent's cache came from and how it matched (``source`` hot /
  warm / cold, ``match`` exact / extend / diverge / shared / miss) and whether they were
  ``reused`` from the cache or ``prefilled``, the tokens generated;
- per HTTP request (``RequestCounter``): by method, route and status;
- read at each scrape (``EngineCollector``): agents hot and stored, live and disk bytes
  against their budgets, saves pending (queued here, and waiting to upload to a shared store)
  and their bytes, the shared store's reachability (its circuit), the decode batches by size.

Every metric has a ``model`` label (the name the model is served under).
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import Engine, GenerationResult, device, is_internal
from .history import History

logger = logging.getLogger(__name__)

#: Seconds: from a hot turn's tens of milliseconds to a long cold prefill on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Replies kept per model for the dashboard's live figures, and agents for its hit rates.
RECENT_REPLIES = 32
MAX_AGENTS_SEEN = 10_000
DECODE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ReplyMetrics:
    """What each reply adds (see the module docstring), into ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.replies = Counter(
            "agent_memory_replies", "Replies generated, by where the agent's cache came from.",
            ["model", "source", "match"], registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "agent_memory_time_to_first_token_seconds", "Time to a reply's first token.",
            ["model"], buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.decode = Histogram(
            "agent_memory_decode_seconds", "Time from a reply's first token to its last.",
            ["model"], buckets=DECODE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "agent_memory_prompt_tokens",
            "Prompt tokens, reused from the agent's cache or prefilled, by cache outcome.",
            ["model", "source", "match", "part"], registry=registry,
        )  # fmt: skip
        self.generated = Counter(
            "agent_memory_generated_tokens", "Tokens generated.", ["model"], registry=registry
        )

        #: For the dashboard (not exported: an agent label would grow without bound): per
        #: (model, agent) [turns, hot turns], the latest agents last; per model the latest
        #: replies' (time to first token, tokens generated, decode seconds).
        self.agents: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self.recent: dict[str, deque[tuple[float, int, float]]] = {}
        #: The dashboard's charts: the same replies in time buckets (bounded, ``history``).
        self.history = History()
        self._lock = threading.Lock()

    def observe(
        self, model: str, cache: str, prompt: int, reused: int, generated: int,
        ttft_s: float, decode_s: float, agent: str | None = None,
    ) -> None:  # fmt: skip
        """One reply: ``cache`` as replies report it (``hot-extend``, ``cold``, ...)."""
        source, _, match = cache.partition("-")
        match = match or "miss"
        with self._lock:
            self.recent.setdefault(model, deque(maxlen=RECENT_REPLIES)).append((ttft_s, generated, decode_s))
            if agent is not None:
                seen = self.agents.pop((model, agent), [0, 0])
                seen[0] += 1
                seen[1] += source == "hot"
                self.agents[(model, agent)] = seen
                while len(self.agents) > MAX_AGENTS_SEEN:
                    self.agents.popitem(last=False)
        self.replies.labels(model, source, match).inc()
        self.prompt_tokens.labels(model, source, match, "reused").inc(reused)
        self.prompt_tokens.labels(model, source, match, "prefilled").inc(max(0, prompt - reused))
        self.generated.labels(model).inc(generated)
        self.ttft.labels(model).observe(ttft_s)
        self.decode.labels(model).observe(decode_s)
        self.history.reply(model, cache, ttft_s=ttft_s, reused=reused, prefilled=max(0, prompt - reused))

    def result(self, model: str, result: GenerationResult, agent: str) -> None:
        """A plain completion's engine result."""
        t = result.timings
        self.observe(model, str(result.outcome), result.prompt_tokens, result.reused_tokens,
                     result.completion_tokens, t.ttft_s, t.decode_s, agent)  # fmt: skip

    def latest(self, model: str) -> dict[str, float | None]:
        """The latest replies' median time to first token and decode tokens per second."""
        with self._lock:
            recent = list(self.recent.get(model, ()))
        decoding = sum(d for _, _, d in recent)
        return {
            "ttft_s": statistics.median(t for t, _, _ in recent) if recent else None,
            "tokens_per_s": sum(max(0, n - 1) for _, n, _ in recent) / decoding if decoding else None,
        }

    def agent_turns(self, model: str, agent: str) -> tuple[int, int]:
        """(turns, hot turns) of the agent's replies this server made (0, 0: none)."""
        with self._lock:
            turns, hot = self.agents.get((model, agent), (0, 0))
        return turns, hot

    def handler(self, model: str) -> BaseCallbackHandler:
        """A LangChain callback that observes each reply of a served chat model."""
        return _ReplyHandler(self, model)


class _ReplyHandler(BaseCallbackHandler):
    run_inline = True  # a few counter updates: not worth a thread of the executor

    def __init__(self, metrics: ReplyMetrics, model: str) -> None:
        self.metrics, self.model = metrics, model

    def on_llm_end(self, response: LLMResult, **_: Any) -> None:
        for generations in response.generations:
            for g in generations:
                message = getattr(g, "message", None)
                meta = getattr(message, "response_metadata", None) or {}
                usage = getattr(message, "usage_metadata", None) or {}
                if "cache" not in meta or not usage:
                    continue  # not one of ours (or cut off before its end)
                reused = (usage.get("input_token_details") or {}).get("cache_read", 0)
                ttft, decode = meta.get("time_to_first_token_s", 0.0), meta.get("decode_s", 0.0)
                try:
                    self.metrics.observe(
                        self.model,
                        meta["cache"],
                        usage["input_tokens"],
                        reused,
                        usage["output_tokens"],
                        ttft,
                        decode,
                        meta.get("agent_id"),
                    )
                except Exception:  # a metric must never fail a reply
                    logger.exception("metrics: a reply could not be observed")


class EngineCollector(Collector):
    """The served engines' state, read at each scrape (``engines``: model name -> engine)."""

    def __init__(self, engines: Callable[[], dict[str, Engine]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(f"agent_memory_{name}", doc, labels=["model"])
            for name, doc in _GAUGES.items()
        }
        steps = CounterMetricFamily(
            "agent_memory_decode_steps", "Batched decode steps, by how many agents decoded together.",
            labels=["model", "batch"],
        )  # fmt: skip
        step_s = CounterMetricFamily(
            "agent_memory_decode_step_seconds", "Seconds in batched decode steps, by batch size.",
            labels=["model", "batch"],
        )  # fmt: skip
        turns = CounterMetricFamily(
            "agent_memory_turns",
            "Requests admitted, by where their cache was found.",
            labels=["model", "source"],
        )
        for model, engine in self.engines().items():
            try:
                stats = engine.stats()
                values = _engine_values(engine, stats)
            except Exception:  # a scrape reports what it can
                logger.exception("metrics: model %s could not be read", model)
                continue
            for name, value in values.items():
                if value is not None:
                    families[name].add_metric([model], float(value))
            for batch, (n, seconds) in stats.get("decode_steps", {}).items():
                steps.add_metric([model, str(batch)], n)
                step_s.add_metric([model, str(batch)], seconds)
            for source, n in stats.get("turns", {}).items():
                turns.add_metric([model, source], n)
        yield from families.values()
        yield from (steps, step_s, turns)
        yield from _mlx_memory()


_GAUGES = {
    "agents_hot": "Agents whose caches are live in memory.",
    "agents_stored": "Agents with a stored cache.",
    "hot_bytes": "Bytes of the live caches (stored form and working copies).",
    "hot_budget_bytes": "The live caches' byte budget (absent: none).",
    "pool_bytes": "Bytes of stored blocks the block pool keeps in memory (bounded by its budget).",
    "serving_bytes": "Bytes of the caches of requests in flight that the hot tier does not hold.",
    "queued_save_bytes": "Bytes of blocks held in memory until their save is written.",
    "disk_bytes": "Bytes of the stored caches on this server's disk.",
    "disk_budget_bytes": "The stored caches' disk budget (absent: none).",
    "queued_saves": "Saves queued on this server and not written yet.",
    "pending_saves": "Saves kept on this server that the shared store has not taken yet.",
    "pending_save_bytes": "Bytes of those saves.",
    "shared_store_reachable": "1 while the shared store answers (0: circuit open); absent without one.",
    "max_decode_batch": "The most agents that decoded together so far.",
}


def _engine_values(engine: Engine, stats: dict[str, Any]) -> dict[str, float | int | None]:
    status = engine.status()
    tier = stats["hot_tier"]  # the loop's answer (``Engine.stats``): its state is read nowhere else
    budget = engine.admin.disk_stats() or {}
    return {
        "agents_hot": tier["agents"],
        "agents_stored": sum(
            1 for r in engine.admin.agent_records(wait=False) if not is_internal(r.agent_id)
        ),
        "hot_bytes": tier["bytes"],
        "hot_budget_bytes": tier["hot_bytes"],
        "pool_bytes": stats["pool"]["hot_bytes"],
        "serving_bytes": stats["serving_bytes"],
        "queued_save_bytes": stats["queued_save_bytes"],
        "disk_bytes": engine.admin.disk_bytes(),
        "disk_budget_bytes": budget.get("max_bytes"),  # type: ignore[arg-type]
        "queued_saves": status.queued_saves,
        "pending_saves": status.pending_saves,
        "pending_save_bytes": status.pending_bytes,
        "shared_store_reachable": int(status.reachable) if status.shared else None,
        "max_decode_batch": stats.get("max_decode_batch", 0),
    }


def _mlx_memory() -> Iterator[Metric]:
    """mlx's memory in this process, all engines together. Beside ``hot_bytes`` it tells an
    operator (and ``benchmarks/soak.py``) caches that fill from memory that leaks."""
    active, cache = device.mlx_memory()
    for name, doc, value in (
        ("mlx_active_bytes", "Bytes mlx's arrays hold in this process (all models).", active),
        ("mlx_cache_bytes", "Freed buffers mlx keeps for reuse in this process (all models).", cache),
    ):
        family = GaugeMetricFamily(f"agent_memory_{name}", doc)
        family.add_metric([], float(value))
        yield family


class RequestCounter:
    """Counts HTTP requests by method, route (its template: ``/v1/agents/{agent_id}``, not
    the id) and status. Plain ASGI: a streamed reply passes through untouched."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "agent_memory_http_requests", "HTTP requests, by method, route and status.",
            ["method", "route", "status"], registry=registry,
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # an exception that escapes sends none

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.requests.labels(scope["method"], route, str(status)).inc()
