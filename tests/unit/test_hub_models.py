"""Hugging Face repo ids as model names (``engine/model/hub.py``), offline: a real
huggingface_hub cache is laid out in ``tmp_path`` (``models--org--name/{refs,snapshots,blobs}``,
snapshot files linked to content-addressed blobs, as huggingface_hub writes it) and found
through ``HF_HOME`` / ``HF_HUB_CACHE`` set after huggingface_hub was imported."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir

from langchain_agent_memory.chat.profile import model_profile
from langchain_agent_memory.engine import load_model, resolve_model_dir
from langchain_agent_memory.engine.model.loading import unload_models
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model

REPO = "test-org/tiny-llama"
CONFIG = b'{"model_type": "llama", "max_position_embeddings": 4096}'


def add_commit(hub: Path, repo_id: str, ref: str, files: dict[str, Path | bytes]) -> Path:
    """Store ``files`` as one commit of ``repo_id`` under ``ref`` in the cache ``hub``; its
    snapshot directory. Blobs are named as on the Hub: sha256 for LFS files (weights), the
    git blob sha1 for the rest."""
    storage = hub / f"models--{repo_id.replace('/', '--')}"
    contents = {name: f.read_bytes() if isinstance(f, Path) else f for name, f in files.items()}
    commit = hashlib.sha1(repr(sorted(contents.items())).encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for name, data in contents.items():
        lfs = name.endswith((".safetensors", ".gguf"))
        blob_id = (
            hashlib.sha256(data).hexdigest()
            if lfs
            else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        )
        blob = storage / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it verbatim
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache under HF_HOME, offline (HF_HUB_CACHE left to its default)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_a_repo_id_resolves_to_its_snapshot(hub: Path) -> None:
    snapshot = add_commit(hub, REPO, "main", {"config.json": CONFIG, "tokenizer.json": b"{}"})
    path, name = resolve_model_dir(REPO)
    assert path == snapshot and (path / "config.json").read_bytes() == CONFIG
    assert name == REPO
    # the layout is huggingface_hub's own: its cache scanner reads the same repo and commit
    (repo,) = scan_cache_dir(hub).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {snapshot.name}


def test_hf_hub_cache_wins_over_hf_home(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_commit(hub, REPO, "main", {"config.json": CONFIG})
    other = tmp_path / "elsewhere"
    snapshot = add_commit(other, REPO, "main", {"config.json": b'{"model_type": "qwen3"}'})
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model_dir(REPO)[0] == snapshot


def test_a_revision_resolves_to_its_own_snapshot(hub: Path) -> None:
    main = add_commit(hub, REPO, "main", {"config.json": CONFIG})
    v2 = add_commit(hub, REPO, "v2", {"config.json": b'{"model_type": "llama", "v": 2}'})
    assert main != v2
    assert resolve_model_dir(f"{REPO}@v2") == (v2, f"{REPO}@v2")
    assert resolve_model_dir(REPO, revision="v2")[0] == v2
    assert resolve_model_dir(f"{REPO}@{main.name}")[0] == main  # a commit hash
    assert resolve_model_dir(REPO)[0] == main
    with pytest.raises(ValueError, match="revision='main' does not apply"):
        resolve_model_dir(f"{REPO}@v2", revision="main")
    with pytest.raises(ValueError, match="does not apply to model 'smollm2-135m'"):
        resolve_model_dir("smollm2-135m", revision="v2")


def test_an_unknown_repo_offline_says_how_to_get_it(hub: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model_dir("test-org/not-downloaded")
    text = str(err.value)
    assert "'test-org/not-downloaded' is not in the Hugging Face cache at" in text
    assert str(hub) in text and "HF_HUB_OFFLINE=1" in text
    assert "hf download test-org/not-downloaded" in text and "unset HF_HUB_OFFLINE" in text
    add_commit(hub, REPO, "main", {"config.json": CONFIG})
    with pytest.raises(ValueError, match="hf download test-org/tiny-llama --revision v9"):
        resolve_model_dir(f"{REPO}@v9")  # a revision never downloaded


def test_a_missing_path_keeps_the_old_error(hub: Path, tmp_path: Path) -> None:
    for name in (str(tmp_path / "no" / "such-model"), "./no/such/model", "no-such-model", "x/y.gguf"):
        with pytest.raises(ValueError, match=r"unknown model .*an mlx-lm model directory, a \.gguf file"):
            resolve_model_dir(name)


def test_an_existing_directory_wins_over_a_repo_id(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_commit(hub, REPO, "main", {"config.json": CONFIG})
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_bytes(CONFIG)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir(REPO)[0] == Path(REPO)  # as mlx_lm.load: a path first


def test_a_gguf_repo_is_named_as_such(hub: Path) -> None:
    add_commit(hub, "test-org/tiny-gguf", "main", {"tiny-Q4_K_M.gguf": b"GGUF"})
    with pytest.raises(ValueError, match=r"holds GGUF files \(tiny-Q4_K_M\.gguf\) but no config\.json"):
        resolve_model_dir("test-org/tiny-gguf")


def test_online_without_a_network_logs_the_download_and_says_why(
    hub: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(ValueError, match=r"could not be reached \(no network\?\)"),
    ):
        resolve_model_dir("test-org/not-downloaded")
    assert "downloading test-org/not-downloaded from the Hugging Face Hub" in caplog.text


def test_the_profile_reads_a_cached_repo_and_claims_nothing_for_others(hub: Path) -> None:
    add_commit(hub, REPO, "main", {"config.json": CONFIG})  # no chat template: a base model
    cached = model_profile(REPO)
    assert cached["max_input_tokens"] == 4096 and cached["tool_calling"] is False
    unknown = model_profile("test-org/not-downloaded")
    assert "tool_calling" not in unknown and "max_input_tokens" not in unknown
    assert unknown["name"] == "test-org/not-downloaded"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight llama directory with SmolLM2's tokenizer (the files a repo would hold)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    return write_random_model(SMALL_CONFIGS["llama"], out, resolve_model_dir("smollm2-135m")[0])


def test_a_repo_loads_and_runs_end_to_end(hub: Path, tiny_llama: Path) -> None:
    snapshot = add_commit(hub, REPO, "main", {f.name: f for f in tiny_llama.iterdir()})
    try:
        loaded = load_model(REPO)
        assert loaded.path == snapshot and loaded.name == REPO
        logits = loaded.model(mx.array([[1, 2, 3]]))
        assert logits.shape == (1, 3, 49152)
        assert mx.isfinite(logits).all().item()
        assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello world")).endswith("hello world")
    finally:
        unload_models(hub)
