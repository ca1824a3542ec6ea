"""``ChatAgentMemory.batch`` and friends (it inherits ``ItemsOnTheirOwnAgents``): every item
of a batch on an agent of its own (``#{index}`` in its id, see ``namespace``), so that they
run and decode together, prefill the prompt prefix they share once, and never overwrite one
another's cache; an explicit ``agent_id`` puts them all on that one agent, in turn."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list

from .namespace import BATCH_INDEX


class ItemsOnTheirOwnAgents:
    """The fan-out side of ``ChatAgentMemory`` (its attributes are the model's)."""

    agent_id: str | None

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """Every item on its own agent (``#{index}``, see ``namespace``): they run and
        decode together, the prompt prefix they share is prefilled once, and no item
        overwrites another's cache. An explicit ``agent_id`` puts them all on that one
        agent (one after another)."""
        configs = self._per_item(inputs, config, kwargs)
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)  # type: ignore[return-value]

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        configs = self._per_item(inputs, config, kwargs)
        return await super().abatch(inputs, configs, return_exceptions=return_exceptions, **kwargs)  # type: ignore[return-value]

    def batch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[LanguageModelInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> Iterator[tuple[int, AIMessage | Exception]]:
        configs = self._per_item(inputs, config, kwargs)
        yield from super().batch_as_completed(inputs, configs, return_exceptions=return_exceptions, **kwargs)  # type: ignore[misc]

    async def abatch_as_completed(  # type: ignore[override]
        self,
        inputs: Sequence[LanguageModelInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> AsyncIterator[tuple[int, AIMessage | Exception]]:
        configs = self._per_item(inputs, config, kwargs)
        async for item in super().abatch_as_completed(
            inputs, configs, return_exceptions=return_exceptions, **kwargs
        ):
            yield item  # type: ignore[misc]

    def _per_item(
        self, inputs: Sequence[Any], config: Any, kwargs: dict[str, Any]
    ) -> list[RunnableConfig] | Any:
        """Each item's config with its batch index in the run metadata (``namespace``)."""
        if kwargs.get("agent_id") or self.agent_id or len(inputs) < 2:
            return config
        configs = get_config_list(config, len(inputs))
        return [{**c, "metadata": {**c.get("metadata", {}), BATCH_INDEX: i}} for i, c in enumerate(configs)]
