"""``GET /dashboard``: a page for people (not a CDN in sight: the page, its style, its script
and its charts, drawn as plain SVG, are one file of the package, ``static/dashboard.html``).

Per served model: charts over the last hour (time to first token by cache outcome, the hot /
warm / cold share of replies, prompt tokens reused against prefilled, the disk against its
budget: ``history``), the latest replies' tokens per second and time to first token, and its
agents, paged and searched here (context length, bytes on disk, last use, this server's
hot-turn rate) with fork and delete buttons; and a chat box against any agent, whose
transcript the browser keeps across reloads. The page holds nothing of the server's: a
login view asks for the API key when one is wanted (kept in the tab's ``sessionStorage``),
and the page reads ``GET /dashboard/data``, ``GET /dashboard/history`` and the API's own
routes with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import HTMLResponse

from ..engine import AgentRecord, Engine, is_internal, shared_blocks
from .agent_routes import Caller
from .errors import APIError
from .history import History
from .metrics import ReplyMetrics
from .served_models import ServedModels

logger = logging.getLogger(__name__)

#: Agents a page of the dashboard's list shows at most.
MAX_PAGE = 200


def add_dashboard_routes(
    app: FastAPI, models: ServedModels, authorize: Callable[..., Caller], replies: ReplyMetrics
) -> None:
    page = resources.files(__package__).joinpath("static/dashboard.html").read_text(encoding="utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
        q: str = "",
        limit: int = 25,
        at: list[str] = Query(default=[]),  # noqa: B008 - FastAPI's parameter
    ) -> dict[str, Any]:
        """Every model's figures and one page of its agents: those whose ids contain ``q``
        (any case), most recently used first, ``limit`` from the offset ``at`` gives the
        model (``at=<model>:<offset>``; none: the first page)."""
        if not 1 <= limit <= MAX_PAGE:
            raise APIError(400, f"limit must be between 1 and {MAX_PAGE}, not {limit}", param="limit")
        offsets = _offsets(at)
        return {"models": await asyncio.to_thread(_models, models, replies, caller, q, limit, offsets)}

    @app.get("/dashboard/history", include_in_schema=False, dependencies=[Depends(authorize)])
    async def history(since: float = 0.0) -> dict[str, Any]:
        """Per model, the figures' buckets from ``since`` on (``history.History.since``)."""
        return {"step_s": replies.history.step_s, "models": replies.history.since(since)}


async def keep_disk_history(models: ServedModels, history: History) -> None:
    """Sample each model's disk into ``history`` every bucket, for as long as the server
    runs (the lifespan starts and cancels it): the disk chart then covers the hours nobody
    had the page open."""
    while True:
        for name, llm in list(models.items()):
            try:
                await asyncio.to_thread(_sample_disk, history, name, llm.engine)
            except Exception:  # a sample is a figure: the next one may do
                logger.debug("dashboard: model %s's disk not sampled", name, exc_info=True)
        await asyncio.sleep(history.step_s)


def _sample_disk(history: History, name: str, engine: Engine) -> tuple[int, int | None]:
    budget = (engine.admin.disk_stats() or {}).get("max_bytes")
    disk = engine.admin.disk_bytes()
    history.disk(name, disk, budget)
    return disk, budget


def _offsets(at: list[str]) -> dict[str, int]:
    offsets = {}
    for item in at:
        model, _, offset = item.rpartition(":")
        if not model or not offset.isdigit():
            raise APIError(400, f"at is <model>:<offset>, not {item!r}", param="at")
        offsets[model] = int(offset)
    return offsets


def _models(
    models: ServedModels, replies: ReplyMetrics, caller: Caller, q: str, limit: int, offsets: dict[str, int]
) -> list[dict[str, Any]]:
    out = []
    for name, llm in models.items():
        engine = llm.engine
        hot = set(engine.admin.hot_agents())
        records = [r for r in engine.admin.agent_records(wait=False) if not is_internal(r.agent_id)]
        # NOTE: a block other agents name too (a fork's, a common prompt's) is not this
        # agent's disk: deleting it would free nothing (a checkpointer's snapshots aside)
        shared = shared_blocks(records)
        visible = [r for r in records if caller.may(r.agent_id)]
        matched = [r for r in visible if q.casefold() in r.agent_id.casefold()]
        matched.sort(key=lambda r: (-r.updated_at, r.agent_id))
        offset = min(offsets.get(name, 0), max(0, len(matched) - 1))
        page = matched[offset : offset + limit]
        agents = [_agent(engine, replies, name, r, hot, shared) for r in page]
        disk, budget = _sample_disk(replies.history, name, engine)
        out.append({
            "name": name, "agents": agents, "agents_total": len(visible), "agents_matched": len(matched),
            "offset": offset, "hot_agents": len(hot), "disk_bytes": disk, "disk_budget_bytes": budget,
            **replies.latest(name),
        })  # fmt: skip
    return out


def _agent(
    engine: Engine,
    replies: ReplyMetrics,
    model: str,
    record: AgentRecord,
    hot: set[str],
    shared: Collection[str],
) -> dict[str, Any]:
    info = engine.admin.agent_info(record, shared)
    turns, hot_turns = replies.agent_turns(model, record.agent_id)
    return {
        "id": record.agent_id,
        "tokens": len(record.token_ids),
        "bytes": info.own_bytes if info else 0,
        "shared_bytes": info.shared_bytes if info else 0,
        "last_used_at": int(record.updated_at),
        "hot": record.agent_id in hot,
        "turns": turns,
        "hot_rate": hot_turns / turns if turns else None,
    }
