"""What a newcomer met first (issue 66, tried 12-06), each pinned: the server's front door
(``GET /`` and Claude Code's ``HEAD /`` probe), token counts that left out a request's tools
when it had no system message (7 tokens counted against 179 read), and the command line's
~50-line tracebacks for a user's mistake, and ``cache prune``'s sizes and ages read without a
unit (``--max-size 5`` evicted all 26 agents' caches as 5 bytes)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from services import app_on_loopback
from typer.testing import CliRunner

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.cli.common import size_text
from langchain_agent_memory.cli.main import app
from langchain_agent_memory.config import Settings
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path_factory.mktemp("frictions")))
    with app_on_loopback(create_app(config)) as url:
        yield url


def test_the_front_door_points_to_the_dashboard_and_the_docs(server: str) -> None:
    r = httpx.get(server + "/", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["dashboard"] == "/dashboard" and r.json()["api_docs"] == "/docs"
    assert "/v1/messages" in r.json()["endpoints"]
    assert httpx.head(server + "/", timeout=30).status_code == 200  # Claude Code's probe


def _count(server: str, **body: Any) -> int:
    r = httpx.post(f"{server}/v1/messages/count_tokens", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_count_tokens_counts_the_tools_without_a_system_message(server: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare, tooled = _count(server, messages=ask), _count(server, messages=ask, tools=[WEATHER])
    assert tooled > bare + 50, (bare, tooled)  # the listing is ~170 tokens
    # as with a system message, where the listing joins it
    with_system = _count(server, messages=ask, tools=[WEATHER], system="Be brief.")
    assert abs(with_system - tooled) < 20, (with_system, tooled)


def test_get_num_tokens_from_messages_counts_the_tools(smollm: LoadedModel, tmp_path_factory: Any) -> None:
    llm = ChatAgentMemory(model=MODEL, cache_dir=str(tmp_path_factory.mktemp("count")))
    function = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    }
    tool = {"type": "function", "function": function}
    ask = [HumanMessage("What is the weather in Paris?")]
    bare, tooled = llm.get_num_tokens_from_messages(ask), llm.get_num_tokens_from_messages(ask, tools=[tool])
    assert tooled > bare + 50, (bare, tooled)
    system = llm.get_num_tokens_from_messages([SystemMessage(""), *ask], tools=[tool])
    assert abs(system - tooled) < 10, (system, tooled)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run", "--model", "no-such-model-xyz", "hi"], "unknown model 'no-such-model-xyz'"),
        (["models", "--check", "{empty}"], "is not an mlx-lm model directory"),
    ],
)
def test_a_users_mistake_is_one_line_not_a_traceback(args: list[str], says: str, tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "agent-memory"
    argv = [str(command), *(a.format(empty=tmp_path) for a in args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr and done.stderr.startswith("error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "[NOTE]" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr


@pytest.fixture
def three_agents(smollm: LoadedModel, tmp_path: Path) -> str:
    """A cache directory holding three agents' caches."""
    engine = Engine(MODEL, cache_dir=tmp_path)
    for i in range(3):
        engine.generate(f"agent-{i}", f"Agent {i} writes a line:", GenerationParams(max_tokens=2))
    engine.flush()  # the saves are written in the background
    return str(tmp_path)


def _agents(cache_dir: str) -> set[str]:
    listing = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", cache_dir, "--format", "json"])
    return {r["agent"] for r in json.loads(listing.output)}


@pytest.mark.parametrize(("flag", "bare"), [("--max-size", "5"), ("--older-than", "7")])
def test_prune_refuses_a_size_or_an_age_without_a_unit(three_agents: str, flag: str, bare: str) -> None:
    # ``--max-size 5`` was read as 5 bytes and evicted every agent
    done = CliRunner().invoke(app, ["cache", "prune", flag, bare, "--cache-dir", three_agents])
    assert done.exit_code == 2 and "has no unit" in done.output, done.output
    assert _agents(three_agents) == {"agent-0", "agent-1", "agent-2"}
    fits = CliRunner().invoke(app, ["cache", "prune", "--max-size", "5GB", "--older-than", "7d",
                                    "--cache-dir", three_agents])  # fmt: skip
    assert fits.exit_code == 0 and "evicted 0 agent cache(s)" in fits.output, fits.output


def test_prune_that_evicts_every_agent_asks_first(three_agents: str) -> None:
    everything = ["cache", "prune", "--max-size", "1B", "--cache-dir", three_agents]
    declined = CliRunner().invoke(app, everything, input="n\n")
    assert declined.exit_code == 1 and "every agent's cache (3)" in declined.output, declined.output
    assert _agents(three_agents) == {"agent-0", "agent-1", "agent-2"}
    plan = CliRunner().invoke(app, [*everything, "--dry-run"])  # a plan asks nothing
    assert "would evict 3 agent cache(s)" in plan.output and "go on?" not in plan.output, plan.output
    done = CliRunner().invoke(app, [*everything, "--yes"])
    assert "evicted 3 agent cache(s)" in done.output, done.output  # (1 B is never met: exit 1)
    assert _agents(three_agents) == set()


REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "12fd25f77366fa6b3b4b768ec3050bf629380bac"  # a snapshot's folder name: its commit


def test_a_repo_ids_caches_are_named_by_the_repo(
    smollm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A repo id's model is read from the Hugging Face cache's snapshots/<commit>: its caches
    # were listed under that hash alone.
    hub = tmp_path / "hf"
    snapshot = hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in smollm.path.iterdir():
        (snapshot / f.name).symlink_to(f)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    engine = Engine(str(snapshot), cache_dir=tmp_path / "cache")
    assert engine.fingerprint.startswith(COMMIT)
    engine.generate("repo-agent", "Say hi:", GenerationParams(max_tokens=2))
    engine.flush()
    cache = ["--cache-dir", str(tmp_path / "cache")]
    for command in (["ls"], ["du"], ["verify"], ["show", "repo-agent"]):
        done = CliRunner().invoke(app, ["cache", *command, *cache])
        assert done.exit_code == 0, done.output
        assert f"{REPO} ({COMMIT}" in " ".join(done.output.split()), (command, done.output)
    listing = CliRunner().invoke(app, ["cache", "ls", *cache, "--format", "json"])
    (row,) = json.loads(listing.output)
    assert row["model"].startswith(REPO) and row["fingerprint"] == engine.fingerprint


def _dashboard_agents(url: str, q: str) -> dict[str, dict[str, Any]]:
    (model,) = httpx.get(f"{url}/dashboard/data", params={"q": q}).json()["models"]
    return {a["id"]: a for a in model["agents"]}


def test_a_forks_disk_column_leaves_out_the_blocks_it_shares(server: str) -> None:
    # The dashboard counted a fork's blocks, all its source's, as its own disk: deleting
    # either frees nothing while the other stays.
    ask = {"model": MODEL, "max_tokens": 4, "wait_for_save": True}
    story = [{"role": "user", "content": "Tell me about the sea. " * 80}]
    r = httpx.post(
        f"{server}/v1/chat/completions", json={**ask, "messages": story, "agent_id": "disk-source"}
    )
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server}/v1/agents/disk-source/fork", json={"to": "disk-fork"}).status_code == 200
    agents = _dashboard_agents(server, "disk-")
    source, fork = agents["disk-source"], agents["disk-fork"]
    assert fork["bytes"] == 0 and source["bytes"] == 0, agents
    assert fork["shared_bytes"] == source["shared_bytes"] > 100_000
    # The fork's own turn writes blocks only it names: those are its disk.
    more = [*story, r.json()["choices"][0]["message"], {"role": "user", "content": "And the waves? " * 60}]
    done = httpx.post(
        f"{server}/v1/chat/completions", json={**ask, "messages": more, "agent_id": "disk-fork"}
    )
    assert done.json()["agent_memory"]["cache"] == "hot-extend", done.text
    fork = _dashboard_agents(server, "disk-fork")["disk-fork"]
    assert fork["bytes"] > 0 and fork["shared_bytes"] > 0


def _block_bytes(cache_dir: Path) -> int:
    return sum(f.stat().st_size for f in cache_dir.glob("kv/*/blocks/*/*") if f.is_file())


def test_prune_dry_run_predicts_what_the_prune_frees(smollm: LoadedModel, tmp_path: Path) -> None:
    # A dry run said "13.3 MB -> 6.7 MB", the prune then "-> 6.8 MB": the after-figure
    # counted the index's journal, which the deletes grow. What is freed is said, exactly.
    engine = Engine(MODEL, cache_dir=tmp_path)
    for i in range(4):
        engine.generate(
            f"agent-{i}", f"Agent {i} on the sea and its waves. " * 60, GenerationParams(max_tokens=2)
        )
    engine.flush()
    engine.admin.fork("agent-0", "agent-0-fork")  # evicting agent-0 alone frees nothing
    engine.flush()
    du = CliRunner().invoke(app, ["cache", "du", "--cache-dir", str(tmp_path), "--format", "json"])
    total = json.loads(du.output)[0]["bytes"]
    prune = ["cache", "prune", "--max-size", f"{total * 6 // 10}B", "--cache-dir", str(tmp_path)]
    plan = CliRunner().invoke(app, [*prune, "--dry-run"])
    assert plan.exit_code == 0, plan.output
    before = _block_bytes(tmp_path)
    done = CliRunner().invoke(app, prune)
    assert done.exit_code == 0, done.output
    freed = size_text(before - _block_bytes(tmp_path))
    assert f"would free {freed} of " in plan.output, (freed, plan.output)
    assert f": freed {freed} of " in done.output, (freed, done.output)
    assert plan.output.count("would evict agent-") == done.output.count("evicted agent-") >= 2


def test_the_quickstarts_restart_prints_what_its_docstring_says(tmp_path: Path) -> None:
    # After a restart it printed ``hot-extend (prefetched)`` where its docstring said the
    # thread starts warm: each outcome its resumed turn prints is the docstring's.
    cache = tmp_path / "cache"
    cache.mkdir()
    models = Settings().cache_dir / "models"
    if models.is_dir():  # the converted models of the session's own cache: none converted again
        (cache / "models").symlink_to(models, target_is_directory=True)
    env = {**os.environ, "AGENT_MEMORY_CACHE_DIR": str(cache), "COLUMNS": "160"}
    env.pop("AGENT_MEMORY_MODEL", None)
    quickstart = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-tokens", "4"]
    for _ in range(2):  # the second run is the restart
        done = subprocess.run(quickstart, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    resumed = re.findall(r"(quickstart:\w+)\s*│\s*4\s*│[^│]*│[^│]*│\s*([^│]+?)\s*│", done.stdout)
    assert {agent for agent, _ in resumed} == {"quickstart:licensing", "quickstart:python_tutor"}, done.stdout
    docstring = " ".join(
        (ast.get_docstring(ast.parse((ROOT / "examples" / "quickstart.py").read_text())) or "").split()
    )
    for _, outcome in resumed:
        assert outcome in ("hot-extend (prefetched)", "warm-extend") and f"``{outcome}``" in docstring, (
            outcome
        )
