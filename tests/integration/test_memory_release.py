"""A closed engine gives its memory back to the system: what a long-lived process that
opens and closes engines (a server switching models, a test session) watches in its RSS."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel, unload_models
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS, write_random_model


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_a_closed_engine_and_its_unloaded_model_leave_little_behind(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    # Random weights, ~0.6 GB at float32: big enough to see, quick to build.
    wide = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6}
    model = write_random_model({**SMALL_CONFIGS["llama"], **wide}, tmp_path / "m", smollm.path, seed=3)
    gc.collect()
    before = _rss()
    with Engine(model, cache_dir=tmp_path / "c", kv_bits=None) as engine:
        for i in range(3):
            engine.generate(f"a{i}", "word " * 600 + f"agent {i}:", GenerationParams(max_tokens=8))
        during = _rss()
    del engine  # what a caller holds, it keeps
    unload_models(tmp_path / "m")
    after = _rss()
    grown, kept = during - before, after - before
    assert grown > 500e6, grown  # the model and the agents' caches were in memory
    assert kept < 0.1 * grown, (before, during, after)  # 24 % stayed when glibc kept its free pages
    figures["memory after close"] = (
        f"an engine of a 0.6 GB model (random weights) grew RSS by {grown / 1e9:.2f} GB; "
        f"{max(kept, 0) / 1e9:.2f} GB of it stayed after close() and unload_models"
    )
