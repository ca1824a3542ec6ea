"""Token counts of message lists, as ``trim_messages(token_counter=llm)`` and LangChain's
context middleware ask for them: the messages as the model reads them (chat template, tool
listing), without the generation prompt a call adds after them (a few tokens).

Counts of parts add up to the count of the whole: ``trim_messages`` subtracts a system
message's count from its budget and fits a suffix of the conversation into the rest. Many
chat templates insert a default system prompt when a list has none (SmolLM2's adds ~25
tokens), so a human message alone would count more than the same message after a system
message. A list that does not start with a system message (and has no tools, whose listing
is a system message) is therefore counted as it renders after an empty system message, less
that empty system turn: the default text a template would add is not counted to messages it
did not come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage, SystemMessage

from ..engine import Engine
from . import prompt


def count_message_tokens(
    engine: Engine, messages: Sequence[BaseMessage], tools: Sequence[dict[str, Any]] | None = None
) -> int:
    """Tokens the model reads for ``messages`` (and ``tools``, OpenAI dicts) from scratch,
    the generation prompt of a call not included."""
    if not messages:
        return 0
    tokenizer = engine.tokenizer
    try:
        if not getattr(tokenizer, "chat_template", None):
            return engine.count_tokens(prompt.render(tokenizer, messages, tools))
        if isinstance(messages[0], SystemMessage) or tools:
            # With tools the listing is a system message of its own: no default text is added,
            # and the listing is counted (an empty system turn less would take it away).
            return engine.count_tokens(prompt.render(tokenizer, messages, tools, generation_prompt=False))
        empty = [SystemMessage("")]
        whole = prompt.render(tokenizer, [*empty, *messages], tools, generation_prompt=False)
        turn = prompt.render(tokenizer, empty, tools, generation_prompt=False)
        if not whole.startswith(turn):  # a template that folds the system text into a turn
            return engine.count_tokens(prompt.render(tokenizer, messages, tools, generation_prompt=False))
        return engine.count_tokens(whole) - engine.count_tokens(turn)
    except Exception:  # a strict template may refuse a partial conversation (as
        # ``trim_messages`` counts slices of one): count each message's text instead.
        return sum(engine.count_tokens(prompt.text_of(m.content)) for m in messages)
