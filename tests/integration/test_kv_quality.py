"""The default KV format keeps each shipped model's quality: perplexity with the stored
context in the default format stays within 3 % of 16-bit KV (measured in
benchmarks/fidelity.py), and it is clearly better than the plain 4-bit format."""

from __future__ import annotations

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.kv import KV_PRESETS, kv_format
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.testing.quality import stored_perplexity

WINDOWS = 4


@pytest.mark.parametrize("model_fixture", ["smollm", "gemma"])
def test_default_kv_format_keeps_perplexity(model_fixture: str, request: pytest.FixtureRequest) -> None:
    lm: LoadedModel = request.getfixturevalue(model_fixture)
    formats = {"fp16": KV_PRESETS["fp16"], "default": kv_format(4), "q4": KV_PRESETS["q4"]}
    ids = lm.tokenizer.encode(corpus.python_docs())[: (WINDOWS + 1) * 256]
    ppl = stored_perplexity(lm.model, lm.structure.spec, formats, ids, WINDOWS)
    assert ppl["default"] / ppl["fp16"] < 1.03, ppl
    assert ppl["default"] < ppl["q4"], ppl
