"""Who may use which agent, and the routes over agents' caches (as llama.cpp's ``/slots``:
list, fork and delete them; ``model`` picks the engine, default the first served model).

Keys: ``ServerConfig.api_key`` sees every agent; each of ``scoped_keys`` (``--api-key
KEY:PREFIX``) only agents whose ids start with its prefix, as a server shared by tenants
needs: another tenant's agents are neither listed, read, forked, deleted nor chatted with
(403, before any work).

Agent ids follow the one rule of the engine (``validate_agent_id``), checked before any
work. HTTP headers carry bytes, not text: the ``X-Agent-ID`` a reply sends back is
percent-encoded UTF-8 (RFC 3986) where the id is not plain printable ASCII, and a request's
header may be sent that way or as raw UTF-8.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, unquote

from fastapi import Depends, FastAPI, Header, Request

from ..chat.model import ChatAgentMemory
from ..engine import AgentRecord, Engine, is_internal, validate_agent_id
from .errors import APIError, as_api_errors
from .served_models import ServedModels

DEFAULT_AGENT = "default"

#: Printable ASCII a header carries as is ('%' is escaped: it starts an escape).
_PLAIN = "".join(c for c in string.printable if c not in "%\t\n\r\x0b\x0c")


@dataclass(frozen=True, slots=True)
class Caller:
    """What a request's key may reach: agents whose ids start with ``prefix`` (None: all)."""

    prefix: str | None = None

    def may(self, agent_id: str) -> bool:
        return self.prefix is None or agent_id.startswith(self.prefix)

    def check(self, agent_id: str, param: str = "agent_id") -> None:
        if not self.may(agent_id):
            raise APIError(
                403, f"this API key may only use agents whose ids start with {self.prefix!r}",
                "agent_forbidden", param,
            )  # fmt: skip


def parse_scoped_key(value: str) -> tuple[str, str]:
    """``KEY:PREFIX`` (``--api-key``) as (key, prefix); ``ValueError`` if either is empty."""
    key, sep, prefix = value.partition(":")
    if not sep or not key or not prefix:
        raise ValueError(f"a scoped API key is KEY:PREFIX (e.g. sk-tenant-a:tenant-a:), not {value!r}")
    return key, prefix


def authorizer(api_key: str | None, scoped: dict[str, str]) -> Callable[..., Caller]:
    """The dependency every ``/v1`` route takes: the caller its bearer key stands for."""

    def authorize(
        authorization: str | None = Header(default=None), x_api_key: str | None = Header(default=None)
    ) -> Caller:
        if api_key is None and not scoped:
            return Caller()
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" and x_api_key is not None:  # Anthropic's clients send it so
            scheme, token = "bearer", x_api_key
        if scheme.lower() == "bearer":
            if api_key is not None and hmac.compare_digest(token.encode(), api_key.encode()):
                return Caller()
            for key, prefix in scoped.items():  # every one compared: no timing tells which
                if hmac.compare_digest(token.encode(), key.encode()):
                    return Caller(prefix)
        message = "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        raise APIError(401, message, "invalid_api_key")

    return authorize


def agent_header(agent_id: str) -> str:
    """``agent_id`` as an ``X-Agent-ID`` value: itself when plain printable ASCII, else
    percent-encoded UTF-8 (``urllib.parse.unquote`` gives it back)."""
    return quote(agent_id, safe=_PLAIN)


def header_agent(raw: str | None) -> str | None:
    """A request's ``X-Agent-ID``: percent-encoded or raw UTF-8 (which arrives as latin-1)."""
    if raw is None:
        return None
    with contextlib.suppress(UnicodeEncodeError, UnicodeDecodeError):  # not raw UTF-8
        raw = raw.encode("latin-1").decode("utf-8")
    return unquote(raw, errors="strict") if "%" in raw else raw


class AgentFields(Protocol):
    """What a request body says of its agent (chat completions' fields; Anthropic's
    ``metadata.user_id`` stands for ``user``)."""

    agent_id: str | None

    @property
    def prompt_cache_key(self) -> str | None: ...

    @property
    def user(self) -> str | None: ...


def agent_of(body: AgentFields, header: str | None, caller: Caller) -> str:
    """The agent a request's cache belongs to: ``prompt_cache_key``, else the ``X-Agent-ID``
    header / ``agent_id`` field (which must agree), else ``user``, else the default. An
    explicit choice wins over ``user``: an app that always sends ``user`` would otherwise
    fold all of its agents into one cache."""
    try:
        header = header_agent(header)
    except UnicodeDecodeError as exc:
        message = f"X-Agent-ID header: not valid percent-encoded UTF-8 ({exc})"
        raise APIError(400, message, param="agent_id") from exc
    if header and body.agent_id and header != body.agent_id:
        message = f"X-Agent-ID header {header!r} and body agent_id {body.agent_id!r} differ: send one"
        raise APIError(400, message, param="agent_id")
    chosen = [(f, v) for f, v in (("prompt_cache_key", body.prompt_cache_key),
              ("agent_id", header or body.agent_id), ("user", body.user)) if v]  # fmt: skip
    field, agent = chosen[0] if chosen else ("agent_id", DEFAULT_AGENT)
    if not chosen and caller.prefix is not None:
        message = f"this API key needs an agent id starting with {caller.prefix!r}"
        raise APIError(400, message, param="agent_id")
    try:
        validate_agent_id(agent)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from exc
    caller.check(agent, field)
    return agent


def valid_agent(agent_id: str, caller: Caller, param: str = "agent_id") -> None:
    try:
        validate_agent_id(agent_id)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc
    caller.check(agent_id, param)


def served(models: ServedModels, name: str) -> ChatAgentMemory:
    llm = models.get(name)
    if llm is None:
        aliases = ", ".join(f"{p}={n}" for p, n in models.aliases.items())
        also = f"; aliases: {aliases}" if aliases else ""
        message = f"model {name!r} is not served here; served: {', '.join(models)}{also}"
        raise APIError(404, message, "model_not_found", "model")
    return llm


def _agent_card(engine: Engine, model: str, record: AgentRecord) -> dict[str, Any]:
    """An agent's cache as ``GET /v1/agents`` lists it (bytes: its blocks on this server's
    disk; blocks shared with other agents count for each)."""
    info = engine.admin.agent_info(record)
    assert info is not None
    return {
        "id": record.agent_id,
        "object": "agent",
        "model": model,
        "tokens": len(record.token_ids),
        "blocks": len(record.blocks),
        "bytes": info.local_bytes,
        "last_used_at": int(record.updated_at),
    }


def add_agent_routes(app: FastAPI, models: ServedModels, authorize: Callable[..., Caller]) -> None:
    def engine_of(model: str | None) -> Engine:
        return served(models, model or next(iter(models))).engine

    @app.get("/v1/agents")
    async def list_agents(
        model: str | None = None,
        prefix: str = "",
        all: bool = False,
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> dict[str, Any]:
        """Agents with a cache (a scoped key's only); ``?all=true`` also lists the product's
        own entries (a checkpointer's ``@snapshot:`` ids). With the shared store out of
        reach, ``local_only`` says the list is this server's copies alone."""
        engine = engine_of(model)
        if caller.prefix is not None and not prefix.startswith(caller.prefix):
            if not caller.prefix.startswith(prefix):
                return {"object": "list", "data": []}  # no id can start with both
            prefix = caller.prefix
        records = [
            r
            for r in await asyncio.to_thread(engine.admin.agent_records, prefix, wait=False)
            if (all or not is_internal(r.agent_id)) and caller.may(r.agent_id)
        ]
        name = model or next(iter(models))
        out: dict[str, Any] = {"object": "list", "data": [_agent_card(engine, name, r) for r in records]}
        if not engine.status().reachable:
            out["local_only"] = True
            out["warning"] = "the shared store is unreachable: these are this server's copies only"
        return out

    @app.delete("/v1/agents/{agent_id}")
    async def delete_agent(
        agent_id: str,
        model: str | None = None,
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> dict[str, Any]:
        engine = engine_of(model)
        valid_agent(agent_id, caller)
        with as_api_errors():
            gone = await asyncio.to_thread(engine.admin.delete, agent_id)
        if not gone:
            raise APIError(404, f"agent {agent_id!r} has no cache here", "agent_not_found", "agent_id")
        return {"id": agent_id, "object": "agent.deleted", "deleted": True}

    @app.post("/v1/agents/{agent_id}/fork")
    async def fork_agent(
        agent_id: str,
        request: Request,
        model: str | None = None,
        caller: Caller = Depends(authorize),  # noqa: B008 - FastAPI's dependency
    ) -> dict[str, Any]:
        """Body ``{"to": "new-agent"}``: the new agent's cache stands for what this one's does
        (blocks shared, no tensor copied); an existing ``to`` is refused unless ``"replace":
        true`` (a JSON boolean: ``"false"``, a string, is refused, not read as true)."""
        engine = engine_of(model)
        try:
            body = json.loads(await request.body() or b"{}")
            target, replace = body["to"], body.get("replace", False)
        except (ValueError, KeyError, TypeError) as exc:
            raise APIError(400, 'send a JSON body {"to": "<new agent id>"}', param="to") from exc
        if not isinstance(target, str):
            raise APIError(400, f'"to" must be a string agent id, not {json.dumps(target)}', param="to")
        if not isinstance(replace, bool):
            raise APIError(400, f'"replace" must be true or false (JSON booleans), not {json.dumps(replace)}',
                           param="replace")  # fmt: skip
        valid_agent(agent_id, caller)
        valid_agent(target, caller, "to")
        with as_api_errors():
            found = await asyncio.to_thread(engine.admin.has_agent, agent_id)
            exists = await asyncio.to_thread(engine.admin.has_agent, target)
        if not found:
            raise APIError(404, f"agent {agent_id!r} has no cache here", "agent_not_found", "agent_id")
        if not replace and exists:
            raise APIError(409, f'agent {target!r} exists: send "replace": true to overwrite it', param="to")
        with as_api_errors():
            # The source's record is read with the write (a racing save or delete of it is
            # ordered before or after, never between); deleted meanwhile: a 404.
            source = await asyncio.to_thread(engine.admin.fork, agent_id, target)
        card = _agent_card(engine, model or next(iter(models)), source)
        return {**card, "id": target, "forked_from": agent_id}
