"""Match a new prompt to the text a stored cache stands for, character by character.

Token ids are the wrong key: BPE tokenizes ``"...answer" + "<|im_end|>..."`` differently
from ``"...answer"`` alone, so id comparison misses prefixes that are reusable. The cache
remembers its *text* and, for each token, the character where it ends; a new prompt is
compared as text, and the cache is reused up to the last token that ends inside the
common prefix:

- ``EXACT``: the same text. Everything is reusable, but the last token is re-run for
  fresh logits (a cache holds keys and values, not logits).
- ``EXTEND``: the stored text is a prefix of the prompt: prefill only the new tail.
- ``DIVERGE``: the texts part somewhere: keep the tokens that end at or before the
  point where they part (at any overlap), trim the rest, prefill from there.
- ``SHARED``: the agent has no usable cache, but the prompt starts with whole blocks
  another agent stored (same tokens at the same positions: the same keys and values).
- ``MISS``: nothing reusable.

>>> stored = TokenizedText("Hello world", [1, 2], [5, 11])
>>> match(stored, "Hello world, again")
PrefixMatch(kind=<MatchKind.EXTEND: 'extend'>, reuse_tokens=2, reuse_chars=11)
>>> match(stored, "Hello there")
PrefixMatch(kind=<MatchKind.DIVERGE: 'diverge'>, reuse_tokens=1, reuse_chars=5)
>>> match(stored, "Hello world")
PrefixMatch(kind=<MatchKind.EXACT: 'exact'>, reuse_tokens=1, reuse_chars=5)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

NOT_A_BOUNDARY = -1  # a token that ends inside a character (byte-level BPE splits emoji)


class MatchKind(str, Enum):
    EXACT = "exact"
    EXTEND = "extend"
    DIVERGE = "diverge"
    SHARED = "shared"  # no cache of its own, but whole blocks another agent stored
    MISS = "miss"


@dataclass(slots=True)
class TokenizedText:
    """Text and the token ids that stand for it; ``ends[i]`` is the character index where
    token ``i`` ends, or ``NOT_A_BOUNDARY`` where cutting after it would split a character."""

    text: str
    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.ends):
            raise ValueError(f"{len(self.ids)} token ids but {len(self.ends)} token ends")

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, other: TokenizedText) -> None:
        """Append ``other`` (whose ``ends`` count from its own start)."""
        base = len(self.text)
        self.text += other.text
        self.ids += other.ids
        self.ends += [e + base if e != NOT_A_BOUNDARY else e for e in other.ends]

    def split(self, n_tokens: int) -> tuple[TokenizedText, TokenizedText]:
        """(first ``n_tokens`` tokens, the rest with ends counted from where they start)."""
        cut = self.ends[n_tokens - 1] if n_tokens else 0
        if cut == NOT_A_BOUNDARY:
            raise ValueError("cannot split after a token that ends inside a character")
        rest = [e - cut if e != NOT_A_BOUNDARY else e for e in self.ends[n_tokens:]]
        return (
            TokenizedText(self.text[:cut], self.ids[:n_tokens], self.ends[:n_tokens]),
            TokenizedText(self.text[cut:], self.ids[n_tokens:], rest),
        )

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens and exactly the text they stand for."""
        if n_tokens == 0:
            self.text, self.ids, self.ends = "", [], []
            return
        end = self.ends[n_tokens - 1]
        if end == NOT_A_BOUNDARY:
            raise ValueError("cannot cut after a token that ends inside a character")
        self.text, self.ids, self.ends = self.text[:end], self.ids[:n_tokens], self.ends[:n_tokens]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    kind: MatchKind
    reuse_tokens: int  # cached tokens to keep
    reuse_chars: int  # the prompt text those tokens stand for; prefill prompt[reuse_chars:]


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix; binary search over C-level slice compares
    (O(n log n) char compares, but no Python loop over characters)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def match(stored: TokenizedText, prompt: str) -> PrefixMatch:
    if not stored.ids or not prompt:
        return PrefixMatch(MatchKind.MISS, 0, 0)
    common = common_prefix_length(stored.text, prompt)
    if common == len(stored.text) < len(prompt) and stored.ends[-1] == common:
        return PrefixMatch(MatchKind.EXTEND, len(stored.ids), common)
    # Keep tokens that end inside the common prefix, and at least one character of the
    # prompt to run: a cache holds keys and values, not the logits of its last token.
    keep = _last_boundary(stored, len(stored.ids), min(common, len(prompt) - 1))
    if keep == 0:
        return PrefixMatch(MatchKind.MISS, 0, 0)
    kind = MatchKind.EXACT if prompt == stored.text else MatchKind.DIVERGE
    return PrefixMatch(kind, keep, _chars(stored, keep))


def _chars(stored: TokenizedText, n_tokens: int) -> int:
    return stored.ends[n_tokens - 1] if n_tokens else 0


def _last_boundary(stored: TokenizedText, limit: int, max_chars: int) -> int:
    """The largest k <= limit such that token k-1 ends cleanly at or before ``max_chars``.

    Ends never decrease, so this is a backwards scan that stops early in practice.
    """
    k = limit
    while k > 0:
        end = stored.ends[k - 1]
        if end != NOT_A_BOUNDARY and end <= max_chars:
            # A token whose text is empty (BOS) ends where the previous one did: fine.
            return k
        k -= 1
    return 0


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> TokenizedText:
    """Token ids and clean character ends of ``text``, from a Hugging Face fast tokenizer
    (or an mlx-lm ``TokenizerWrapper`` around one)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    enc = hf.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    offsets = enc.offsets
    ends: list[int] = []
    for i, (_, end) in enumerate(offsets):
        next_start = offsets[i + 1][0] if i + 1 < len(offsets) else len(text)
        ends.append(end if end <= next_start else NOT_A_BOUNDARY)
    if ends and ends[-1] != NOT_A_BOUNDARY and ends[-1] < len(text):
        # Trailing text no token covers (e.g. stripped whitespace): not representable.
        ends[-1] = NOT_A_BOUNDARY
    return TokenizedText(text, list(enc.ids), ends)


def tokenize_prompt(tokenizer: Any, prompt: str) -> TokenizedText:
    """A whole prompt as the model reads it from scratch: the tokenizer's special tokens
    (BOS) added unless the text starts with them already (chat templates write their own)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenize(tokenizer, prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
