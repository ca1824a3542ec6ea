"""``ChatAgentMemory.batch`` and friends: every item
of a batch on an agent of its own (``#{index}`` in its id, see ``namespace``), so that they
run and decode together, prefill the prompt prefix they share once, and never overwrite one
another's cache; an explicit ``agent_id`` puts them all on that one agent, in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list

from .namespace import BATCH_INDEX


def per_item_configs(
    inputs: Sequence[Any], config: Any, agent_id: str | None, kwargs: dict[str, Any]
) -> list[RunnableConfig] | Any:
    """Each item's config with its batch index in the run metadata (``namespace``), unless
    an explicit ``agent_id`` (the model's or the call's) puts every item on that agent."""
    if kwargs.get("agent_id") or agent_id or len(inputs) < 2:
        return config
    configs = get_config_list(config, len(inputs))
    return [{**c, "metadata": {**c.get("metadata", {}), BATCH_INDEX: i}} for i, c in enumerate(configs)]
