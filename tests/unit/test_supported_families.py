"""Every family the engine accepts has a small random-weight config: the family oracles
(tests/integration/test_families.py) then cover each of them (hybrids: ``HYBRID_CONFIGS``,
of which those with a recurrent mixer and attention in one layer are refused)."""

from __future__ import annotations

from langchain_agent_memory.engine.model.families import RECURRENT_FAMILIES, SUPPORTED_FAMILIES
from langchain_agent_memory.testing.random_model import HYBRID_CONFIGS, SMALL_CONFIGS


def test_every_supported_family_has_a_small_config() -> None:
    hybrids = {f for f in HYBRID_CONFIGS if f in SUPPORTED_FAMILIES}
    assert set(SMALL_CONFIGS) | hybrids == set(SUPPORTED_FAMILIES)
    assert set(HYBRID_CONFIGS) - hybrids == {"falcon_h1"} <= RECURRENT_FAMILIES
