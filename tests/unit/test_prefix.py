"""Text prefix matching: every outcome, character boundaries, split characters."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import _byte_decoder

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.prefix import (
    NOT_A_BOUNDARY,
    MatchKind,
    TokenizedText,
    common_prefix_length,
    match,
    tokenize_prompt,
)
from langchain_agent_memory.engine.requests.text import token_ends

# "Hello" " world" "," " bye"  -> ends 5, 11, 12, 16
STORED = TokenizedText("Hello world, bye", [10, 11, 12, 13], [5, 11, 12, 16])


@pytest.mark.parametrize(
    ("prompt", "kind", "tokens", "chars"),
    [
        ("Hello world, bye and more", MatchKind.EXTEND, 4, 16),
        ("Hello world, bye", MatchKind.EXACT, 3, 12),  # last token re-run for its logits
        ("Hello world, hi", MatchKind.DIVERGE, 3, 12),
        ("Hello wor", MatchKind.DIVERGE, 1, 5),  # a prefix of the stored text: trim
        ("Hello world", MatchKind.DIVERGE, 1, 5),  # ends on a boundary: still one token to run
        ("Help", MatchKind.MISS, 0, 0),
        ("", MatchKind.MISS, 0, 0),
    ],
)
def test_outcomes(prompt: str, kind: MatchKind, tokens: int, chars: int) -> None:
    m = match(STORED, prompt)
    assert (m.kind, m.reuse_tokens, m.reuse_chars) == (kind, tokens, chars)
    assert m.reuse_chars < len(prompt) or kind is MatchKind.MISS  # something left to run


def test_never_cuts_inside_a_character() -> None:
    # byte-level BPE: an emoji split over two tokens; only the second ends a character
    stored = TokenizedText("ab\U0001f600c", [1, 2, 3, 4], [2, NOT_A_BOUNDARY, 3, 4])
    m = match(stored, "ab\U0001f600X")
    assert (m.reuse_tokens, m.reuse_chars) == (3, 3)
    m = match(stored, "ab\U0001f601")
    assert (m.reuse_tokens, m.reuse_chars) == (1, 2)  # backs off past the split token


def test_extend_needs_a_clean_last_token() -> None:
    stored = TokenizedText("ab\U0001f600", [1, 2, 3], [2, NOT_A_BOUNDARY, NOT_A_BOUNDARY])
    m = match(stored, "ab\U0001f600 more")
    assert m.kind is MatchKind.DIVERGE and m.reuse_tokens == 1


def test_split_truncate_extend_round_trip() -> None:
    t = TokenizedText(STORED.text, STORED.ids[:], STORED.ends[:])
    head, tail = t.split(2)
    assert (head.text, head.ids, head.ends) == ("Hello world", [10, 11], [5, 11])
    assert (tail.text, tail.ids, tail.ends) == (", bye", [12, 13], [1, 5])
    head.extend(tail)
    assert (head.text, head.ids, head.ends) == (STORED.text, STORED.ids, STORED.ends)
    head.truncate(3)
    assert (head.text, head.ids) == ("Hello world,", [10, 11, 12])
    with pytest.raises(ValueError, match="inside a character"):
        TokenizedText("ab", [1, 2], [NOT_A_BOUNDARY, 2]).truncate(1)


@pytest.mark.parametrize(
    ("a", "b", "n"), [("", "x", 0), ("abc", "abd", 2), ("abc", "abc", 3), ("ab", "abc", 2)]
)
def test_common_prefix_length(a: str, b: str, n: int) -> None:
    assert common_prefix_length(a, b) == n


def test_a_byte_piece_inside_a_reply_is_a_place_to_cut(smollm: LoadedModel) -> None:
    """A reply (SmolLM2's byte-level BPE) with the first byte of a 3-byte character, then a
    token that starts a new one: its text keeps a U+FFFD, and the byte piece ends there
    (the tokens up to it decode to the text up to it). An EXACT match then keeps every
    token but the last, as on a reply of whole characters (on the H100, a random-weight
    Falcon-H1 reply with a byte piece second to last re-ran 7 tokens more, as a DIVERGE).
    A byte piece that the next token completes stays inside its character."""
    tok = smollm.tokenizer
    byte = {b: tok.convert_tokens_to_ids(c) for c, b in _byte_decoder().items()}
    prompt = tokenize_prompt(tok, "Q: the price?\nA:")
    for piece in ([byte[0xE2]], [byte[0xE2], byte[0x82]]):
        reply_ids = (
            tok.encode(" It costs", add_special_tokens=False)
            + piece
            + tok.encode(" x", add_special_tokens=False)
        )
        reply = token_ends(tok, prompt.ids[-1], reply_ids)
        assert reply.text == " It costs\ufffd x"
        assert NOT_A_BOUNDARY not in reply.ends
        stored = TokenizedText(prompt.text, prompt.ids[:], prompt.ends[:])
        stored.extend(reply)
        m = match(stored, stored.text)
        assert (m.kind, m.reuse_tokens) == (MatchKind.EXACT, len(stored) - 1)
        assert tok.decode(stored.ids[: m.reuse_tokens]) == stored.text[: m.reuse_chars]
    euro = [byte[0xE2], byte[0x82], byte[0xAC]]  # "€", one byte per token
    reply = token_ends(tok, prompt.ids[-1], tok.encode(" It costs", add_special_tokens=False) + euro)
    assert reply.text == " It costs\u20ac" and reply.ends[-3:] == [
        NOT_A_BOUNDARY,
        NOT_A_BOUNDARY,
        len(reply.text),
    ]
