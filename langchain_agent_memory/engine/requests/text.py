"""A request's generated text: streamed as tokens arrive, cut at stop sequences, and the
token ends that let the next turn match it by text.

>>> stops = StopMatcher(["</s>", "\\nUser:"])
>>> stops.hold, stops.find("Hi there\\nUser: more", 0)
(5, (8, '\\nUser:'))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..prefix import NOT_A_BOUNDARY, TokenizedText


@dataclass(slots=True)
class StopMatcher:
    """Where the first stop sequence begins in a text. ``hold``: how many trailing
    characters a stream must hold back, since a stop sequence may be only partly there."""

    stops: list[str]
    hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.stops = [s for s in self.stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, search_from: int) -> tuple[int, str] | None:
        """Where the earliest stop sequence that starts at ``search_from`` or later begins,
        and which one it is."""
        best = None
        for s in self.stops:
            i = text.find(s, max(0, search_from))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best


class TextStream:
    """One request's text as it is decoded: ``add`` a token and get the text that is safe
    to emit (nothing a stop sequence could still claim); ``stopped`` once one was found."""

    def __init__(self, tokenizer: Any, stops: list[str], anchor: int | None = None) -> None:
        self._detok = tokenizer.detokenizer  # mlx-lm's streaming detokenizer (a copy per caller)
        self._stops = StopMatcher(stops)
        #: ``anchor`` (the prompt's last token): keep a leading space the detokenizer drops at
        #: the start of its text, decided by decoding the first token after the anchor.
        self._tokenizer, self._anchor = tokenizer, anchor
        self._lead: str | None = None if anchor is not None else ""
        self._first: int | None = None
        self.text = ""  # the reply so far (cut at a stop sequence once ``stopped``)
        self.emitted = 0  # characters of ``text`` handed out
        self.stopped = False
        self.stop_sequence: str | None = None  # the one that stopped it

    def add(self, token: int) -> str:
        """Feed one generated token; return the new text to emit (maybe "")."""
        if self._first is None:
            self._first = token
        self._detok.add_token(token)
        return self._advance(self._text(), final=False)

    def _text(self) -> str:
        text = self._detok.text
        if self._lead is None and text:  # the first text: was a leading space dropped?
            base = self._tokenizer.decode([self._anchor])
            piece = self._tokenizer.decode([self._anchor, self._first])[len(base) :]
            self._lead = " " if piece.startswith(" ") and not text.startswith(" ") else ""
        return (self._lead or "") + text

    def finish(self) -> str:
        """No more tokens: flush the detokenizer; return the rest of the text to emit."""
        if not self.stopped:
            self._detok.finalize()
            self._advance(self._text(), final=True)
        rest = self.text[self.emitted :]
        self.emitted = len(self.text)
        return rest

    def _advance(self, text: str, final: bool) -> str:
        hold = self._stops.hold
        found = self._stops.find(text, self.emitted - hold)
        if found is not None:
            self.text, self.stopped, self.stop_sequence = text[: found[0]], True, found[1]
            return ""
        self.text = text
        if final or len(text) - hold <= self.emitted:
            return ""
        new = text[self.emitted : len(text) - hold]
        self.emitted = len(text) - hold
        return new


def token_ends(tokenizer: Any, anchor: int | None, ids: list[int]) -> TokenizedText:
    """Generated ``ids``, their text as it continues the context, and each token's end.

    Decoded after an ``anchor`` token (the last context token) so that tokenizers that drop
    a leading space at the start of a decode keep it here. Each token is decoded after the
    last token that ended on a whole character (O(tokens), not a decode of every prefix);
    where that does not add up to the decode of the whole (a tokenizer whose cleanup looks
    across tokens), every prefix is decoded instead.

    A token whose text so far ends in U+FFFD (bytes of a character not yet whole) is no
    place to cut, unless what follows shows its bytes never became one (a byte piece of a
    split character, then a token that starts a new one: the text keeps a U+FFFD): there
    the tokens up to it decode to the text up to that U+FFFD, and any text after it decodes
    the same after them (a truncated UTF-8 sequence ends at the next byte that starts a
    character), so it ends there like any other token (``_held_ends``).
    """
    head = [anchor] if anchor is not None else []
    base = tokenizer.decode(head)
    full = tokenizer.decode(head + ids)[len(base) :] if ids else ""
    ends, built = [], ""
    held: list[tuple[int, str]] = []  # tokens inside a character since the last clean one
    ctx, ctx_text, start = head, base, 0  # the last clean token (or the anchor) and what follows it
    for i in range(len(ids)):
        piece = tokenizer.decode(ctx + ids[start : i + 1])[len(ctx_text) :]
        if piece.endswith("\ufffd"):  # inside a character: not a place to cut (yet)
            ends.append(NOT_A_BOUNDARY)
            held.append((i, piece))
            continue
        _held_ends(ends, held, piece, len(built))
        held = []
        built += piece
        ends.append(len(built))
        ctx, start = [ids[i]], i + 1
        ctx_text = tokenizer.decode(ctx)
    if built != full:
        ends = _token_ends_by_prefixes(tokenizer, head, base, ids, full)
    if ends and ends[-1] != len(full):
        ends[-1] = NOT_A_BOUNDARY
    return TokenizedText(full, ids, ends)


def _held_ends(ends: list[int], held: list[tuple[int, str]], piece: str, at: int) -> None:
    """Tokens ``held`` (index, their text from ``at``, ending in U+FFFD) before a token whose
    text from ``at`` is ``piece`` (whole characters): each one whose text ``piece`` starts
    with ends there after all (never before one that did). The others stay inside a
    character (their bytes and the next token's made one)."""
    last = 0
    for i, text in held:
        if piece.startswith(text) and len(text) >= last:
            ends[i], last = at + len(text), len(text)


def _token_ends_by_prefixes(
    tokenizer: Any, head: list[int], base: str, ids: list[int], full: str
) -> list[int]:
    ends: list[int] = []
    held: list[tuple[int, str]] = []
    for i in range(len(ids)):
        piece = tokenizer.decode(head + ids[: i + 1])[len(base) :]
        if not full.startswith(piece):
            ends.append(NOT_A_BOUNDARY)
        elif piece.endswith("\ufffd"):  # as in ``token_ends``: a place to cut once a clean token follows
            ends.append(NOT_A_BOUNDARY)
            held.append((i, piece))
        else:
            _held_ends(ends, held, piece, 0)
            held = []
            ends.append(len(piece))
    return ends


def last_clean(tokens: TokenizedText, limit: int) -> int:
    """The largest ``k <= limit`` such that cutting after token ``k`` keeps whole characters."""
    k = limit
    while k > 0 and tokens.ends[k - 1] == NOT_A_BOUNDARY:
        k -= 1
    return k
