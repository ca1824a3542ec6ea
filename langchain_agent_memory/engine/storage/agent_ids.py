"""Agent ids: the one rule for what names an agent (``validate_agent_id``), used by the
engine, the server and the command line alike, and the ids the product keeps for itself."""

from __future__ import annotations

import unicodedata

MAX_AGENT_ID_CHARS = 256

#: Ids the product keeps for itself start with this (a checkpointer's snapshots,
#: ``@snapshot:<digest>``): listings hide them unless asked for all.
INTERNAL_PREFIX = "@"


def is_internal(agent_id: str) -> bool:
    """Whether ``agent_id`` is one the product keeps for itself (``INTERNAL_PREFIX``)."""
    return agent_id.startswith(INTERNAL_PREFIX)


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` or raise ``ValueError`` saying what a valid id is.

    The one rule of the engine, the server and the CLI: 1 to 256 characters of any script
    (``агент``, ``🦉 owl``), in Unicode's composed form (NFC: one spelling per id), without
    ``/``, ``\\`` or a leading ``.`` (ids name files), control or invisible formatting
    characters (zero-width spaces, direction marks: two ids that print alike must be one
    id; the zero-width joiner inside an emoji is kept) or leading / trailing whitespace."""
    if not isinstance(agent_id, str) or not agent_id:
        raise ValueError("agent_id must be a non-empty string, e.g. 'researcher' or 'thread-1:planner'")
    if len(agent_id) > MAX_AGENT_ID_CHARS:
        raise ValueError(f"agent_id is {len(agent_id)} characters; the limit is {MAX_AGENT_ID_CHARS}")
    bad = [c for c in agent_id if c in "/\\" or ord(c) < 32 or ord(c) == 127]
    if bad or agent_id.startswith("."):
        raise ValueError(
            f"agent_id {agent_id!r} looks like a path or holds control characters; "
            "use letters, digits and separators such as ':', '|', '-', '_' (no '/', '\\', NUL, leading '.')"
        )
    if agent_id != agent_id.strip():
        raise ValueError(f"agent_id {agent_id!r} starts or ends with whitespace: send {agent_id.strip()!r}")
    invisible = sorted({f"U+{ord(c):04X}" for c in agent_id if _invisible(c)})
    if invisible:
        raise ValueError(
            f"agent_id {agent_id!r} holds invisible characters ({', '.join(invisible)}: zero-width "
            "spaces, direction marks, control or unassigned code points): remove them"
        )
    if unicodedata.normalize("NFC", agent_id) != agent_id:
        raise ValueError(
            f"agent_id {agent_id!r} is not in Unicode's composed form (NFC): send "
            f"{unicodedata.normalize('NFC', agent_id)!r}, which prints the same"
        )
    return agent_id


def _invisible(c: str) -> bool:
    """Control, formatting (but the zero-width joiner of emoji), surrogate, private-use,
    unassigned, line and paragraph separator characters."""
    return c != "\u200d" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
