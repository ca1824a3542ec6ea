"""``GET /dashboard``: a page for people (not a CDN in sight: the page, its style and its
script are one file of the package, ``static/dashboard.html``). Per served model: its agents
(context length, bytes on disk, last use, this server's hot-turn rate) with fork and delete
buttons, the latest replies' tokens per second and time to first token, the disk against its
budget, and a chat box against any agent. The page itself holds nothing: it asks for the API
key (kept in the tab's ``sessionStorage``) and reads ``GET /dashboard/data`` and the API's
own routes with it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse

from ..engine import is_internal
from .agent_routes import Caller
from .metrics import ReplyMetrics
from .served_models import ServedModels


def add_dashboard_routes(
    app: FastAPI, models: ServedModels, authorize: Callable[..., Caller], replies: ReplyMetrics
) -> None:
    page = resources.files(__package__).joinpath("static/dashboard.html").read_text(encoding="utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data", include_in_schema=False)
    async def data(caller: Caller = Depends(authorize)) -> dict[str, Any]:  # noqa: B008 - FastAPI's dependency
        return {"models": await asyncio.to_thread(_models, models, replies, caller)}


def _models(models: ServedModels, replies: ReplyMetrics, caller: Caller) -> list[dict[str, Any]]:
    out = []
    for name, llm in models.items():
        engine = llm.engine
        hot = set(engine.admin.hot_agents())
        agents = []
        for record in engine.admin.agent_records(wait=False):
            if is_internal(record.agent_id) or not caller.may(record.agent_id):
                continue
            info = engine.admin.agent_info(record)
            turns, hot_turns = replies.agent_turns(name, record.agent_id)
            agents.append({
                "id": record.agent_id, "tokens": len(record.token_ids),
                "bytes": info.local_bytes if info else 0, "last_used_at": int(record.updated_at),
                "hot": record.agent_id in hot,
                "turns": turns, "hot_rate": hot_turns / turns if turns else None,
            })  # fmt: skip
        agents.sort(key=lambda a: -a["last_used_at"])
        budget = engine.admin.disk_stats() or {}
        out.append({
            "name": name, "agents": agents, "hot_agents": len(hot), "disk_bytes": engine.admin.disk_bytes(),
            "disk_budget_bytes": budget.get("max_bytes"), **replies.latest(name),
        })  # fmt: skip
    return out
