"""The server as careless operators and hostile clients drive it (issue 41): agent ids of
every script and the invisible ones that must be refused before any work, strict JSON
booleans, the API description behind the key, keys scoped to one tenant's agents, and a
shared store frozen (SIGSTOP) under it. A real uvicorn on loopback (headers go through
h11, as in production), real PostgreSQL and SeaweedFS of this module's own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
from services import PostgresServer, SeaweedServer, app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

MODEL = "smollm2-135m"
ADMIN, KEY_A, KEY_B = "k-admin", "k-tenant-a", "k-tenant-b"
SCOPED = {KEY_A: "tenant-a:", KEY_B: "tenant-b:"}
SYSTEM = "You are a careful assistant who answers in one short line. " * 12


class Server:
    def __init__(self, url: str, pg: PostgresServer) -> None:
        self.url, self.pg = url, pg

    def chat(
        self, agent: str | None, key: str = ADMIN, header: str | None = None, **body: Any
    ) -> httpx.Response:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
        payload = {"model": MODEL, "messages": messages, "max_tokens": 2, **body}
        if agent is not None:
            payload["agent_id"] = agent
        headers = {"Authorization": f"Bearer {key}"}
        if header is not None:
            headers["X-Agent-ID"] = header
        return httpx.post(self.url + "/v1/chat/completions", json=payload, headers=headers, timeout=120)

    def agents(self, key: str = ADMIN) -> dict[str, Any]:
        reply = httpx.get(self.url + "/v1/agents", headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def ids(self, key: str = ADMIN) -> set[str]:
        return {a["id"] for a in self.agents(key)["data"]}

    def call(self, method: str, path: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=120, **kw)


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pg, s3 = PostgresServer(), SeaweedServer()  # this module freezes its database
    config = ServerConfig(
        models=[MODEL],
        cache_dir=str(tmp_path_factory.mktemp("hostile-server")),
        kv_bits=None,
        api_key=ADMIN,
        scoped_keys=SCOPED,
        store=pg.new_database("hostile"),
        blocks=s3.new_bucket("hostile"),
    )
    try:
        with app_on_loopback(create_app(config)) as url:
            yield Server(url, pg)
    finally:
        pg.close()
        s3.close()


OK_IDS = ["агент", "🦉 owl", "مساعد", "👨\u200d👩\u200d👧 family", "100% sure"]
BAD_IDS = {
    " lead": "whitespace", "trail ": "whitespace", "zero\u200bwidth": "U+200B", "rtl\u200fmark": "U+200F",
    "e\u0301clair": "NFC",
}  # fmt: skip


def test_unicode_ids_round_trip_and_invisible_ones_are_refused_before_any_work(server: Server) -> None:
    for agent in OK_IDS:
        first = server.chat(agent)
        assert first.status_code == 200, (agent, first.text)
        assert unquote(first.headers["x-agent-id"]) == agent  # percent-encoded UTF-8: a valid header
        # The same agent named by the header, percent-encoded (as the reply sends it back).
        again = server.chat(None, header=quote(agent, safe=""))
        assert again.status_code == 200, (agent, again.text)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, agent
    assert set(OK_IDS) <= server.ids()
    for agent, why in BAD_IDS.items():
        reply = server.chat(agent)
        assert reply.status_code == 400 and why in reply.json()["error"]["message"], (agent, reply.text)
    assert not set(BAD_IDS) & server.ids()  # refused before any work: nothing was saved


def test_fork_wants_json_booleans(server: Server) -> None:
    for agent in ("fork-src", "fork-dst"):
        assert server.chat(agent, messages=[{"role": "user", "content": f"I am {agent}."}]).status_code == 200
    before = {a["id"]: a["tokens"] for a in server.agents()["data"]}
    for replace in ("false", 0, None):
        reply = server.call("POST", "/v1/agents/fork-src/fork", json={"to": "fork-dst", "replace": replace})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "replace", reply.text
    assert {a["id"]: a["tokens"] for a in server.agents()["data"]}["fork-dst"] == before["fork-dst"]
    bad_to = server.call("POST", "/v1/agents/fork-src/fork", json={"to": ["x"]})
    assert bad_to.status_code == 400 and bad_to.json()["error"]["param"] == "to"


def test_the_api_description_wants_the_key(server: Server) -> None:
    for path in ("/docs", "/openapi.json"):
        assert server.call("GET", path, key="").status_code == 401
        assert server.call("GET", path).status_code == 200
    assert server.call("GET", "/health", key="").status_code == 200


def test_a_scoped_key_cannot_reach_another_tenants_agents(server: Server, figures: dict[str, str]) -> None:
    assert server.chat("tenant-a:planner", key=KEY_A).status_code == 200
    assert server.chat("tenant-b:planner", key=KEY_B).status_code == 200
    assert server.ids(KEY_A) == {"tenant-a:planner"} and server.ids(KEY_B) == {"tenant-b:planner"}
    assert {"tenant-a:planner", "tenant-b:planner"} <= server.ids(ADMIN)
    refused = {
        "chat": server.chat("tenant-a:planner", key=KEY_B),
        "chat by header": server.chat(None, key=KEY_B, header="tenant-a:planner"),
        "chat, no agent": server.chat(None, key=KEY_B),
        "fork from": server.call("POST", "/v1/agents/tenant-a:planner/fork", KEY_B, json={"to": "b:x"}),
        "fork onto": server.call(
            "POST", "/v1/agents/tenant-b:planner/fork", KEY_B, json={"to": "tenant-a:planner"}
        ),
        "delete": server.call("DELETE", "/v1/agents/tenant-a:planner", KEY_B),
        "new agent elsewhere": server.chat("tenant-a:intruder", key=KEY_B),
    }  # fmt: skip
    for what, reply in refused.items():
        assert reply.status_code in (400, 403), (what, reply.status_code, reply.text)
    assert server.ids(KEY_A) == {"tenant-a:planner"}  # nothing of tenant A changed or appeared
    assert server.call("GET", "/v1/agents?prefix=tenant-a:", KEY_B).json()["data"] == []
    assert server.call("DELETE", "/v1/agents/tenant-a:planner", KEY_A).status_code == 200
    figures["scoped keys"] = f"{len(refused)} cross-tenant requests refused, {len(refused)}/{len(refused)}"


def test_a_frozen_store_under_the_server(server: Server) -> None:
    """With its database under SIGSTOP: replies come, ``/ready`` says the store is out of
    reach and what waits to upload, the listing says it is this server's copies only, a
    delete (which needs the store) is a 503 to retry, not a 500."""
    assert server.chat("frozen-1").status_code == 200
    assert server.call("GET", "/ready", key="").status_code == 200
    server.pg.freeze()
    try:
        reply = server.chat("frozen-1", messages=[{"role": "user", "content": "and now?"}])
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 60
        while True:  # the turn's save runs after its reply: until it waits to upload
            ready = server.call("GET", "/ready", key="")
            (state,) = ready.json()["models"].values()
            assert ready.status_code == 503 and not state["reachable"], ready.text
            if state["pending_saves"] >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state["pending_saves"] >= 1 and state["pending_bytes"] > 0, ready.text
        listing = server.agents()
        assert listing["local_only"] is True and "frozen-1" in {a["id"] for a in listing["data"]}
        gone = server.call("DELETE", "/v1/agents/frozen-1")
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "store_unavailable", gone.text
        assert gone.headers["retry-after"]
    finally:
        server.pg.thaw()
