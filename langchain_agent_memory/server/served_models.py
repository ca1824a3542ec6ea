"""The models a server serves, by the names clients use, and the aliases that reach them
(``--model-alias 'claude-*=smollm2-135m'``): a harness that asks for models by its own
names (Claude Code's main and background models, a Codex profile's) reaches a served one
without renaming it, and an unknown name that no alias matches is still a 404."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from fnmatch import fnmatchcase
from typing import Any

from ..chat.model import ChatAgentMemory


def check_aliases(aliases: dict[str, str], names: list[str]) -> None:
    """Every alias names a served model (when the app is made: a typo fails there)."""
    for pattern, name in aliases.items():
        if name not in names:
            raise ValueError(
                f"model alias {pattern!r} names {name!r}, which is not served (served: {', '.join(names)})"
            )


def parse_alias(text: str) -> tuple[str, str]:
    """``PATTERN=NAME`` (a shell-style pattern: ``claude-*``) -> (pattern, name)."""
    pattern, sep, name = text.partition("=")
    if not sep or not pattern.strip() or not name.strip():
        raise ValueError(f"a model alias is PATTERN=NAME (e.g. 'claude-*=smollm2-135m'), not {text!r}")
    return pattern.strip(), name.strip()


class ServedModels(MutableMapping[str, ChatAgentMemory]):
    """Served name -> chat model. Lookups fall back to the aliases, in their order (the
    first pattern that matches); iteration, ``len`` and listings see served names only."""

    def __init__(self, aliases: dict[str, str] | None = None) -> None:
        self._models: dict[str, ChatAgentMemory] = {}
        self.aliases = dict(aliases or {})

    def name_of(self, asked: str) -> str | None:
        """The served name ``asked`` reaches (itself, or an alias's target), or None."""
        if asked in self._models:
            return asked
        for pattern, name in self.aliases.items():
            if fnmatchcase(asked, pattern):
                return name
        return None

    def __getitem__(self, asked: str) -> ChatAgentMemory:
        name = self.name_of(asked)
        if name is None or name not in self._models:
            raise KeyError(asked)
        return self._models[name]

    def __setitem__(self, name: str, llm: ChatAgentMemory) -> None:
        self._models[name] = llm

    def __delitem__(self, name: str) -> None:
        del self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)


def codex_catalog(models: ServedModels, context_scale: float = 1.0) -> list[dict[str, Any]]:
    """The model metadata the Codex CLI reads (``GET /v1/models?client_version=...``, its
    ``models``, when its provider sets ``model_catalog_url``): an entry for each served name
    and each alias without a wildcard (Codex 0.171 looks its model up by exact name, so a
    pattern such as ``gpt-*`` cannot be listed: give Codex a served name, or alias its name
    exactly). Each says what this server runs: function tools only (no hosted search), no
    reasoning summaries, text in, and the model's context (times ``context_scale``, as
    token counts are told)."""
    entries: dict[str, str] = {name: name for name in models}
    for pattern, name in models.aliases.items():
        if not any(c in pattern for c in "*?["):
            entries.setdefault(pattern, name)
    return [
        _codex_entry(slug, name, models[name].context_length, context_scale) for slug, name in entries.items()
    ]


def _codex_entry(slug: str, served: str, context: int, scale: float) -> dict[str, Any]:
    window = round(context * scale)
    return {
        "slug": slug,
        "display_name": served,
        "description": f"{served} on agent-memory serve",
        "default_reasoning_level": None,
        "supported_reasoning_levels": [],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "upgrade": None,
        "base_instructions": "",
        "minimal_client_version": "0.1.0",
        "supports_reasoning_summaries": False,
        "supports_reasoning_summary_parameter": False,
        "default_reasoning_summary": "none",
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "supports_search_tool": False,
        "truncation_policy": {"mode": "tokens", "limit": 10_000},
        "supports_parallel_tool_calls": False,
        "prefer_websockets": False,
        "use_responses_lite": False,
        "context_window": window,
        "max_context_window": window,
        "auto_compact_token_limit": None,
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }
