"""The reuse rule, in one place: which of its stored tokens (and their blocks) a request for
a prompt starts from. The shared store's admission asks it to know what to fetch before the
request reaches the model's thread (``admissions``); the agent caches ask it again there,
with what is then in memory, to know what to load (``agents``). Pure: what a block store
holds is asked through the ``has`` it is given.

- The agent's own cache: its text is matched with the prompt (``prefix.match``); a hybrid
  model resumes from the newest state snapshot at or before the match (``states``).
- Nothing of its own: the prompt's leading whole blocks that some agent stored (a shared
  system prompt, ``SHARED``), cut back to a token that ends on a whole character and, on a
  hybrid model, to a block whose state snapshot is stored too; then, past them, the leading
  tokens of another agent's next block where its tokens are the prompt's (a harness's
  instructions end inside a block, where each session's own text begins). A block's first
  tokens' keys and values depend on nothing after them, so its first rows are as good as a
  whole block of those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..prefix import NOT_A_BOUNDARY, MatchKind, PrefixMatch, TokenizedText, match, tokenize_prompt
from ..storage.blocks import BLOCK_TOKENS, BlockHash, prompt_hashes, state_block_hash
from .states import resume_point

#: A request that reuses nothing.
NOTHING = PrefixMatch(MatchKind.MISS, 0, 0)
#: The fewest of another agent's block's leading tokens worth reading past the whole blocks
#: shared: fewer cost less to prefill than the block's read.
MIN_CONTINUATION = 16

#: Blocks that follow a block in some agent's chain, each with its token ids (``plan_shared``
#: is given ``continuations(parent, k)``: the ``k``-th blocks of chains whose block ``k - 1``
#: is ``parent``).
Continuations = Callable[[BlockHash, int], Iterable[tuple[BlockHash, Sequence[int]]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReusePlan:
    """What a request starts from: the first ``tokens`` tokens of ``chain`` (the agent's
    own chain, or another agent's leading blocks: ``match.kind is SHARED``), a hybrid
    model's recurrent layers from ``snapshot`` (None: none stored there)."""

    match: PrefixMatch
    tokens: int
    chain: Sequence[BlockHash] = ()
    snapshot: BlockHash | None = None
    #: the prompt, tokenized whole (what a request without a cache of its own prefills)
    prompt: TokenizedText | None = field(default=None, repr=False)

    @property
    def own(self) -> bool:
        """From the agent's own cache."""
        return self.tokens > 0 and self.match.kind not in (MatchKind.SHARED, MatchKind.MISS)

    def blocks(self) -> list[BlockHash]:
        """The blocks the request reads: the chain's up to ``tokens``, and the snapshot."""
        return [*self.chain[: -(-self.tokens // BLOCK_TOKENS)], *([self.snapshot] if self.snapshot else [])]


def plan_own(
    tokens: TokenizedText,
    prompt: str | None,
    chain: Sequence[BlockHash],
    *,
    hybrid: bool,
    snapshots: Mapping[int, BlockHash],
    held: Collection[int] = (),
) -> ReusePlan | None:
    """What a request for ``prompt`` (None: the whole cache, a prefetch) reuses of the
    agent's own cache (``tokens``, stored as ``chain``); None: nothing. ``snapshots``: a
    hybrid's stored state snapshots (token position -> block), ``held``: positions its live
    layers hold a snapshot of."""
    m = (
        match(tokens, prompt)
        if prompt is not None
        else PrefixMatch(MatchKind.EXACT, len(tokens), len(tokens.text))
    )
    if m.kind is MatchKind.MISS:
        return None
    n = m.reuse_tokens
    if hybrid:
        n = resume_point(tokens, n, set(snapshots) | set(held))
        if n == 0:  # no state to resume from before the match: as good as nothing
            return None
    return ReusePlan(match=m, tokens=n, chain=chain, snapshot=snapshots.get(n) if hybrid else None)


def plan_shared(
    prompt: str | TokenizedText,
    tokenizer: Any,
    fingerprint: str,
    *,
    hybrid: bool,
    has: Callable[[Sequence[BlockHash]], Collection[BlockHash]],
    continuations: Continuations | None = None,
) -> ReusePlan:
    """What a request for ``prompt`` without a usable cache of its own reuses: the leading
    whole blocks of the prompt that ``has`` says are stored (``has(hashes)``: those of
    ``hashes`` the store holds; asked once for the blocks, once for their snapshots), and
    past them the longest run of a stored next block's leading tokens that are the prompt's
    (``continuations``; not on a hybrid model: no state snapshot stands inside a block)."""
    full = prompt if isinstance(prompt, TokenizedText) else tokenize_prompt(tokenizer, prompt)
    hashes = list(prompt_hashes(full.ids, fingerprint))
    present = has(hashes) if hashes else ()
    chain = []
    for h in hashes:
        if h not in present:
            break
        chain.append(h)
    snapshots = [state_block_hash(h, fingerprint) for h in chain] if hybrid else []
    stored = set(has(snapshots)) if snapshots else set()
    while chain and (
        full.ends[len(chain) * BLOCK_TOKENS - 1] == NOT_A_BOUNDARY
        or (hybrid and snapshots[len(chain) - 1] not in stored)
    ):
        chain.pop()
    if not chain:
        return ReusePlan(match=NOTHING, tokens=0, prompt=full)
    n = len(chain) * BLOCK_TOKENS
    if continuations is not None and not hybrid:
        block, extra = _continuation(full, chain, continuations, has)
        if extra:
            chain.append(block)
            n += extra
    shared = PrefixMatch(MatchKind.SHARED, n, full.ends[n - 1])
    return ReusePlan(
        match=shared,
        tokens=n,
        chain=chain,
        snapshot=snapshots[len(chain) - 1] if hybrid else None,
        prompt=full,
    )


def _continuation(
    full: TokenizedText,
    chain: list[BlockHash],
    continuations: Continuations,
    has: Callable[[Sequence[BlockHash]], Collection[BlockHash]],
) -> tuple[BlockHash, int]:
    """The stored block after ``chain`` whose leading tokens are most of the prompt's next
    ones, and how many of them to reuse: cut back to a token that ends on a whole character,
    short of the prompt's last token (a request prefills at least one), at least
    ``MIN_CONTINUATION``; else (``chain[-1]``, 0)."""
    at = len(chain) * BLOCK_TOKENS
    wanted = full.ids[at : min(at + BLOCK_TOKENS, len(full) - 1)]
    best: tuple[int, BlockHash] = (0, chain[-1])
    for block, ids in continuations(chain[-1], len(chain)):
        same = 0
        for mine, theirs in zip(wanted, ids, strict=False):
            if mine != theirs:
                break
            same += 1
        while same and full.ends[at + same - 1] == NOT_A_BOUNDARY:
            same -= 1
        if same > best[0] and block in has([block]):
            best = (same, block)
    return (best[1], best[0]) if best[0] >= MIN_CONTINUATION else (chain[-1], 0)


def plan_reuse(
    prompt: str,
    tokenizer: Any,
    fingerprint: str,
    *,
    own: tuple[TokenizedText, Sequence[BlockHash], Mapping[int, BlockHash]] | None,
    hybrid: bool,
    has: Callable[[Sequence[BlockHash]], Collection[BlockHash]],
    held: Collection[int] = (),
) -> ReusePlan:
    """The agent's own cache if it matches (``own``: its tokens, chain and snapshots), else
    the prompt's shared leading blocks, else nothing (``plan_own``, ``plan_shared``)."""
    if own is not None:
        tokens, chain, snapshots = own
        plan = plan_own(tokens, prompt, chain, hybrid=hybrid, snapshots=snapshots, held=held)
        if plan is not None:
            return plan
    return plan_shared(prompt, tokenizer, fingerprint, hybrid=hybrid, has=has)
