"""Every error the engine raises for a caller to catch, in one place (the facade re-exports
them: ``from langchain_agent_memory.engine import CacheWriteError``). What each one means
for the caller's data is in its docstring: none of them loses a stored cache."""

from __future__ import annotations

from collections.abc import Sequence


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context window. The chat model raises it as
    LangChain's ``ContextOverflowError`` too (``chat_model.ContextLengthError``)."""


class UnsupportedModelError(ValueError):
    """The model keeps something the engine cannot store, or computes differently over the
    engine's caches than over mlx-lm's own (``self_check``)."""


class UnsupportedGGUFError(ValueError):
    """The GGUF holds an architecture or tensor type this converter cannot turn into mlx-lm."""


class CacheFormatError(ValueError):
    """A stored file cannot be used: corrupt, truncated, another model's, or a newer format."""


class NewerFormatError(CacheFormatError):
    """Written by a newer version of this package: refused, and never overwritten."""


class BlockMissingError(CacheFormatError):
    """A block an agent record refers to is not in the store; ``missing``: the hashes, where
    one call found several (a shared store's commit naming blocks its catalog does not
    hold: never uploaded, or collected)."""

    def __init__(self, message: str, missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


class AgentNotFoundError(LookupError):
    """The agent named has no stored cache (never saved, or deleted)."""


class CacheWriteError(RuntimeError):
    """A cache could not be saved (disk full, permissions...); the previous one is intact."""


class CommitConflictError(CacheWriteError):
    """Another writer committed this agent first (or holds its lease): this save lost.
    ``leased``: another worker holds the lease (a later retry may succeed)."""

    def __init__(self, message: str, *, leased: bool = False) -> None:
        super().__init__(message)
        self.leased = leased


class RemoteUnavailableError(ConnectionError):
    """The shared store (PostgreSQL or the object store) could not be used.

    ``unreachable``: no answer came (a server down, frozen or behind a wrong address: start
    it or wait); False where the store answered and refused (a missing bucket or database,
    wrong keys or password: the setting is to fix). At start the two call for different
    fixes (``storage.remote.open_store``); while serving both leave saves pending."""

    def __init__(self, message: str, *, unreachable: bool = True) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class BlocksUnavailableError(RemoteUnavailableError):
    """Blocks could not be fetched in time; the first ``available`` of those asked for are here."""

    def __init__(self, message: str, available: int) -> None:
        super().__init__(message)
        self.available = available


class RemoteConfigError(ValueError):
    """A ``store=`` / ``blocks=`` setting that cannot be used as given."""
