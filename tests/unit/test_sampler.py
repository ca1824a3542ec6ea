"""The sampler's lazy draw (what a request decoding alone feeds before reading it) is the
token the sampler returns, for every way it chooses."""

from __future__ import annotations

import pytest

from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.requests.runner import Sampler


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_p": 1.0},
        {"temperature": 0.8, "top_p": 1.0},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.7, "top_p": 1.0, "top_k": 20, "min_p": 0.05},
    ],
)
def test_lazy_draw_is_the_sampled_token(kwargs: dict[str, float]) -> None:
    logits = mx.random.normal((300,), key=mx.random.key(4)) * 3
    sampler = Sampler(seed=11, constraint=None, **kwargs)  # type: ignore[arg-type]
    drawn = [sampler.lazy(logits, step) for step in range(12)]
    tokens = [sampler(logits, step) for step in range(12)]
    assert [int(d.item()) for d in drawn if d is not None] == tokens
    if kwargs["temperature"] > 0:
        assert len(set(tokens)) > 1  # the steps' keys differ: not one token repeated
