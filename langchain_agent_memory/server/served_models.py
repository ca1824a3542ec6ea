"""The models a server serves, by the names clients use, and the aliases that reach them
(``--model-alias 'claude-*=smollm2-135m'``): a harness that asks for models by its own
names (Claude Code's main and background models, a Codex profile's) reaches a served one
without renaming it, and an unknown name that no alias matches is still a 404."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from fnmatch import fnmatchcase

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
