"""Every family the engine accepts has a small random-weight config: the family oracles
(tests/integration/test_families.py) then cover each of them."""

from __future__ import annotations

from langchain_agent_memory.engine.model.families import SUPPORTED_FAMILIES
from langchain_agent_memory.testing.random_model import SMALL_CONFIGS


def test_every_supported_family_has_a_small_config() -> None:
    assert set(SMALL_CONFIGS) == set(SUPPORTED_FAMILIES)
