"""``GET /metrics``, scraped as Prometheus does and parsed with ``prometheus_client``'s own
parser: the counters move with the requests a client makes (the ``openai`` and
``anthropic`` packages over loopback), the gauges say what the server holds, and the page
is behind the API key unless ``metrics_public``."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from services import app_on_loopback

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

KEY = "test-key"
MODEL = "smollm2-135m"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("metrics")), api_key=KEY)
    with app_on_loopback(create_app(config)) as url:
        yield url


def scrape(url: str, headers: dict[str, str] | None = AUTH) -> dict[tuple[str, frozenset], float]:
    """Every sample of the page: (name, labels) -> value."""
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_counters_move_with_each_reply_and_the_gauges_say_what_is_held(server: str) -> None:
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    messages = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)
    before = scrape(server)
    ask = [{"role": "user", "content": "Name a color."}]
    first = chat.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=6, extra_headers={"X-Agent-ID": "m1"}
    )
    follow = [*ask, {"role": "assistant", "content": first.choices[0].message.content}]
    follow.append({"role": "user", "content": "Another one?"})
    chat.chat.completions.create(
        model=MODEL, messages=follow, max_tokens=6, extra_headers={"X-Agent-ID": "m1"}
    )
    messages.messages.create(model=MODEL, max_tokens=6, messages=ask, metadata={"user_id": "m2"})
    with chat.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=6, stream=True, extra_headers={"X-Agent-ID": "m3"}
    ) as stream:
        for _ in stream:
            pass
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, model=MODEL, **labels) - value(before, name, model=MODEL, **labels)

    assert moved("agent_memory_replies_total") == 4
    assert moved("agent_memory_replies_total", source="hot", match="extend") == 1  # m1's second turn
    assert moved("agent_memory_time_to_first_token_seconds_count") == 4
    assert moved("agent_memory_decode_seconds_count") == 4
    assert moved("agent_memory_prompt_tokens_total", part="reused") > 0  # the follow-up's
    assert moved("agent_memory_prompt_tokens_total", part="prefilled") > 0
    assert moved("agent_memory_generated_tokens_total") >= 4
    assert moved("agent_memory_turns_total") == 4
    http = "agent_memory_http_requests_total"
    assert (
        value(after, http, route="/v1/chat/completions", status="200")
        - value(before, http, route="/v1/chat/completions", status="200")
        == 3
    )
    assert value(after, http, route="/v1/messages", status="200") >= 1

    httpx.post(f"{server}/v1/messages", headers=AUTH, json={"model": MODEL, "messages": ask})  # no max_tokens
    refused = scrape(server)
    assert value(refused, http, route="/v1/messages", status="400") >= 1
    assert value(refused, "agent_memory_agents_hot", model=MODEL) >= 3
    assert value(refused, "agent_memory_agents_stored", model=MODEL) >= 1  # saves land after replies
    assert value(refused, "agent_memory_disk_bytes", model=MODEL) > 0
    # mlx's own memory (the process's, unlabelled) holds at least the live caches' bytes
    hot = value(refused, "agent_memory_hot_bytes", model=MODEL)
    assert hot > 0 and value(refused, "agent_memory_mlx_active_bytes") >= hot
    assert ("agent_memory_mlx_cache_bytes", frozenset()) in refused
    # at rest: no request in flight holds a cache of its own, no save waits in memory
    assert value(refused, "agent_memory_serving_bytes", model=MODEL) == 0
    assert ("agent_memory_queued_save_bytes", frozenset({("model", MODEL)})) in refused
    assert value(refused, "agent_memory_decode_steps_total", model=MODEL, batch="1") > 0
    assert (
        "agent_memory_shared_store_reachable",
        frozenset({("model", MODEL)}),
    ) not in refused  # no shared store


def test_metrics_want_the_key_unless_public(
    server: str, smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert httpx.get(f"{server}/metrics").status_code == 401
    config = ServerConfig(
        models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("public")), api_key=KEY, metrics_public=True
    )
    with app_on_loopback(create_app(config)) as url:
        assert value(scrape(url, headers=None), "agent_memory_agents_hot", model=MODEL) == 0
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the rest still wants it
