"""The prefix index: the one answer to what a request for a prompt starts from.

Every block the engine knows of is a node named by its chained hash (``storage.blocks``:
its tokens after its parent's), with its parent and its token ids, and what holds it: the
agents whose chains name it (stored, in the pool's memory tier or hot alike; whether its
bytes are at hand is asked of memory and the store when a plan reads them: a file can
be collected or quarantined by another process) and the requests in flight whose
prompts pass through it (a fan-out's first request, before it has stored anything).
The index is the engine loop's (``ops.owner``): filled at open from the records the store
holds (``fill``), kept current as turns commit and agents are read, rewritten, deleted or
evicted (``hold``, ``drop``) and as requests start and end (``fly``, ``land``). A thread
that prepares a request off the loop (a shared store's admissions) gets an immutable
view of the part on its prompt's path (``view``).

The rule (``longest_prefix``), the same on the loop and off it:

- the agent's own cache: its text matched with the prompt's (``prefix.match``: BPE
  tokenizes a text's end differently once more follows, so texts are compared, not ids);
  a hybrid model resumes from the newest state snapshot at or before the match
  (``states.resume_point``);
- else the prompt's leading whole blocks that are stored (a shared system prompt:
  ``SHARED``), cut back to a token that ends on a whole character and, on a hybrid model,
  to a block whose state snapshot is stored too; then, past them, the leading tokens of a
  stored next block where its tokens are the prompt's (a harness's instructions end inside
  a block, where each session's own text begins). A block's first tokens' keys and values
  depend on nothing after them, so its first rows are as good as a whole block of those
  tokens.

In flight (``inflight_source``): the request whose prompt shares the most leading tokens
with a new one's (``requests.forks`` copies its caches once it holds them). Layers built
from the same stored prefix share one decode of it (``decoded``: a fan-out's).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kv.layer_work import DecodedPrefix
from ..ops.owner import CHECK_OWNER, Owner, check_owner
from ..prefix import NOT_A_BOUNDARY, MatchKind, PrefixMatch, TokenizedText, match, tokenize_prompt
from ..storage.blocks import (
    BLOCK_TOKENS,
    BlockHash,
    block_hash,
    chain_hashes,
    prompt_hashes,
    state_block_hash,
)
from .states import resume_point

#: A request that reuses nothing.
NOTHING = PrefixMatch(MatchKind.MISS, 0, 0)
#: The fewest of a stored block's leading tokens worth reading past the whole blocks shared:
#: fewer cost less to prefill than the block's read.
MIN_CONTINUATION = 16

#: Those of the hashes asked that are stored (in memory, on this worker's disk, in a shared
#: store: whoever plans says).
Has = Callable[[Sequence[BlockHash]], Collection[BlockHash]]
#: The stored blocks known to follow a block, each with its token ids.
NextBlocks = Callable[[BlockHash], Iterable[tuple[BlockHash, Sequence[int]]]]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt, tokenized once (at the facade: ``Engine``), as the model reads it
    from scratch, and its whole blocks hashed (``prompt_hashes``: never the block of its last
    token, whose logits must be computed)."""

    tokens: TokenizedText
    hashes: tuple[BlockHash, ...]

    @classmethod
    def of(cls, tokenizer: Any, text: str, fingerprint: str) -> Prompt:
        tokens = tokenize_prompt(tokenizer, text)
        return cls(tokens, tuple(prompt_hashes(tokens.ids, fingerprint)))

    @property
    def text(self) -> str:
        return self.tokens.text


@dataclass(frozen=True, slots=True)
class OwnCache:
    """An agent's own cache as a plan sees it: the text and tokens it stands for, its chain,
    a hybrid's stored state snapshots (token position -> block) and the positions its live
    recurrent layers hold a snapshot of."""

    tokens: TokenizedText
    chain: Sequence[BlockHash]
    snapshots: Mapping[int, BlockHash] = field(default_factory=dict)
    held: Collection[int] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReusePlan:
    """What a request starts from: the first ``tokens`` tokens of ``chain`` (the agent's
    own chain, or blocks other agents stored: ``match.kind is SHARED``), a hybrid model's
    recurrent layers from ``snapshot`` (None: none stored there)."""

    match: PrefixMatch
    tokens: int
    chain: Sequence[BlockHash] = ()
    snapshot: BlockHash | None = None

    @property
    def own(self) -> bool:
        """From the agent's own cache."""
        return self.tokens > 0 and self.match.kind not in (MatchKind.SHARED, MatchKind.MISS)

    def blocks(self) -> list[BlockHash]:
        """The blocks the request reads: the chain's up to ``tokens``, and the snapshot."""
        return [*self.chain[: -(-self.tokens // BLOCK_TOKENS)], *([self.snapshot] if self.snapshot else [])]


def longest_prefix(
    prompt: Prompt | None,
    own: OwnCache | None,
    *,
    has: Has,
    next_blocks: NextBlocks,
    fingerprint: str,
    hybrid: bool,
) -> ReusePlan:
    """What a request for ``prompt`` (None: the agent's whole cache, a prefetch) starts from:
    the agent's own cache (``own``) where it matches, else the prompt's stored leading
    blocks and the leading tokens of a stored next block (``has``: which blocks are stored;
    ``next_blocks``: the index's, or its view's), else nothing."""
    if own is not None:
        plan = _own(prompt, own, hybrid)
        if plan is not None:
            return plan
    if prompt is None:
        return ReusePlan(match=NOTHING, tokens=0)
    return _shared(prompt, has, next_blocks, fingerprint, hybrid)


def _own(prompt: Prompt | None, own: OwnCache, hybrid: bool) -> ReusePlan | None:
    tokens = own.tokens
    if prompt is None:
        m = PrefixMatch(MatchKind.EXACT, len(tokens), len(tokens.text))
    else:
        m = match(tokens, prompt.text)
    if m.kind is MatchKind.MISS:
        return None
    n = m.reuse_tokens
    if hybrid:
        n = resume_point(tokens, n, set(own.snapshots) | set(own.held))
        if n == 0:  # no state to resume from before the match: as good as nothing
            return None
    snapshot = own.snapshots.get(n) if hybrid else None
    return ReusePlan(match=m, tokens=n, chain=own.chain, snapshot=snapshot)


def _shared(prompt: Prompt, has: Has, next_blocks: NextBlocks, fingerprint: str, hybrid: bool) -> ReusePlan:
    full = prompt.tokens
    present = has(prompt.hashes) if prompt.hashes else ()
    chain: list[BlockHash] = []
    for h in prompt.hashes:
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
        return ReusePlan(match=NOTHING, tokens=0)
    n = len(chain) * BLOCK_TOKENS
    if not hybrid:  # no state snapshot stands inside a block
        block, extra = _continuation(full, chain, next_blocks, has)
        if extra:
            chain.append(block)
            n += extra
    shared = PrefixMatch(MatchKind.SHARED, n, full.ends[n - 1])
    return ReusePlan(
        match=shared, tokens=n, chain=chain, snapshot=snapshots[len(chain) - 1] if hybrid else None
    )


def _continuation(
    full: TokenizedText, chain: list[BlockHash], next_blocks: NextBlocks, has: Has
) -> tuple[BlockHash, int]:
    """The stored block after ``chain`` whose leading tokens are most of the prompt's next
    ones, and how many of them to reuse: cut back to a token that ends on a whole character,
    short of the prompt's last token (a request prefills at least one), at least
    ``MIN_CONTINUATION``; else (``chain[-1]``, 0)."""
    at = len(chain) * BLOCK_TOKENS
    wanted = full.ids[at : min(at + BLOCK_TOKENS, len(full) - 1)]
    best: tuple[int, BlockHash] = (0, chain[-1])
    for block, ids in next_blocks(chain[-1]):
        same = _same(wanted, ids)
        while same and full.ends[at + same - 1] == NOT_A_BOUNDARY:
            same -= 1
        if same > best[0] and block in has([block]):
            best = (same, block)
    return (best[1], best[0]) if best[0] >= MIN_CONTINUATION else (chain[-1], 0)


def _same(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True, eq=False)
class _Node:
    """A block the index knows: its parent, its token ids (never changed once made: a view
    hands them out), and what holds it."""

    parent: BlockHash | None
    ids: array[int]
    #: how many agents' chains name it
    agents: int = 0
    #: the requests in flight whose prompts pass through it, in the order they came
    flights: dict[int, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class IndexView:
    """The index's part on one prompt's path, for a thread that plans off the loop: the
    blocks known to follow each of the prompt's whole blocks (``next_blocks``)."""

    nexts: Mapping[BlockHash, tuple[tuple[BlockHash, Sequence[int]], ...]] = field(default_factory=dict)

    def next_blocks(self, parent: BlockHash) -> tuple[tuple[BlockHash, Sequence[int]], ...]:
        return self.nexts.get(parent, ())


class PrefixIndex:
    """The blocks one engine knows of, by chained hash (see the module's docstring). The
    loop's alone: other threads get a ``view``."""

    def __init__(self, fingerprint: str, *, has: Has, hybrid: bool, owner: Owner | None = None) -> None:
        self.fingerprint = fingerprint
        self.hybrid = hybrid
        self.owner = owner
        #: which blocks are stored, asked on the loop (memory and this worker's disk)
        self.has = has
        self._nodes: dict[BlockHash, _Node] = {}
        #: parent (None: the root) -> its children, in the order they were first known
        self._children: dict[BlockHash | None, dict[BlockHash, None]] = {}
        #: agent -> the chain the index holds for it
        self._chains: dict[str, tuple[BlockHash, ...]] = {}
        #: request (by id) -> the chain of its prompt's tokens
        self._flights: dict[int, tuple[BlockHash, ...]] = {}
        #: (last block, tokens, layer) -> that layer's stored prefix decoded once for all the
        #: requests that start from it (``DecodedPrefix``); gone with its last user.
        self._decoded: weakref.WeakValueDictionary[tuple[Any, ...], DecodedPrefix] = (
            weakref.WeakValueDictionary()
        )

    def __len__(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------ the answer

    def plan(self, prompt: Prompt | None, own: OwnCache | None) -> ReusePlan:
        """``longest_prefix`` on the loop: what is stored asked of memory and this worker's
        disk, the next blocks of the agents' chains known here."""
        return longest_prefix(
            prompt,
            own,
            has=self.has,
            next_blocks=self.next_blocks,
            fingerprint=self.fingerprint,
            hybrid=self.hybrid,
        )

    def next_blocks(self, parent: BlockHash) -> Iterator[tuple[BlockHash, Sequence[int]]]:
        """The blocks of agents' chains that follow ``parent``, with their token ids."""
        for h in self._children.get(parent, ()):
            node = self._nodes[h]
            if node.agents:
                yield h, node.ids

    def view(self, prompt: Prompt) -> IndexView:
        """What a plan for ``prompt`` off the loop needs of the index (immutable: the token
        ids handed over are never changed)."""
        nexts = {}
        for h in prompt.hashes:
            if h not in self._nodes:
                break
            following = tuple(self.next_blocks(h))
            if following:
                nexts[h] = following
        return IndexView(nexts)

    def inflight_source(self, ids: Sequence[int]) -> tuple[object, int] | None:
        """The request in flight whose prompt (``fly``) shares the most leading tokens with
        ``ids``, and how many (None: none shares any)."""
        parent: BlockHash | None = None
        at = 0
        best: tuple[object, int] | None = None
        while at + BLOCK_TOKENS <= len(ids):
            h = block_hash(parent, ids[at : at + BLOCK_TOKENS], self.fingerprint)
            node = self._nodes.get(h)
            if node is None or not node.flights:
                break
            best = (next(iter(node.flights.values())), at + BLOCK_TOKENS)
            parent = h
            at += BLOCK_TOKENS
        wanted = ids[at : at + BLOCK_TOKENS]
        for h in self._children.get(parent, ()):
            node = self._nodes[h]
            if not node.flights:
                continue
            same = _same(wanted, node.ids)
            if same and at + same > (best[1] if best is not None else 0):
                best = (next(iter(node.flights.values())), at + same)
        return best

    def decoded(self, blocks: Sequence[BlockHash], n_tokens: int, layer: int) -> DecodedPrefix:
        """The decode of one layer's first ``n_tokens`` stored in ``blocks`` that every layer
        built from them shares (made here the first time)."""
        if CHECK_OWNER:
            check_owner(self.owner, "PrefixIndex.decoded")
        key = (blocks[-1] if blocks else None, n_tokens, layer)
        decoded = self._decoded.get(key)
        if decoded is None:
            decoded = self._decoded[key] = DecodedPrefix()
        return decoded

    # ------------------------------------------------------------------ kept current (on the loop)

    def fill(self, records: Iterable[tuple[str, Sequence[BlockHash], Sequence[int]]]) -> None:
        """Every (agent, chain, token ids) the store holds (at open)."""
        for agent_id, chain, ids in records:
            self.hold(agent_id, chain, ids)

    def hold(self, agent_id: str, chain: Sequence[BlockHash], ids: Sequence[int]) -> None:
        """``agent_id``'s chain is now ``chain`` of these token ids (a commit, a record read);
        a chain that does not fit its tokens is not taken."""
        if CHECK_OWNER:
            check_owner(self.owner, "PrefixIndex.hold")
        chain = tuple(chain)
        old = self._chains.get(agent_id, ())
        if chain == old:
            return
        if -(-len(ids) // BLOCK_TOKENS) != len(chain):
            self.drop(agent_id)
            return
        for k, h in enumerate(chain):
            self._node(h, chain[k - 1] if k else None, ids, k).agents += 1
        self._chains[agent_id] = chain
        for h in old:
            self._nodes[h].agents -= 1
            self._prune(h)

    def drop(self, agent_id: str) -> None:
        """``agent_id`` has no chain any more (deleted, evicted, its save not stored)."""
        if CHECK_OWNER:
            check_owner(self.owner, "PrefixIndex.drop")
        for h in self._chains.pop(agent_id, ()):
            self._nodes[h].agents -= 1
            self._prune(h)

    def fly(self, request: object, ids: Sequence[int]) -> None:
        """``request`` is in flight with these prompt tokens (its layers will hold them)."""
        if CHECK_OWNER:
            check_owner(self.owner, "PrefixIndex.fly")
        chain = tuple(chain_hashes(ids, self.fingerprint))
        for k, h in enumerate(chain):
            self._node(h, chain[k - 1] if k else None, ids, k).flights[id(request)] = request
        self._flights[id(request)] = chain

    def land(self, request: object) -> None:
        """``request`` is no longer in flight (finished, failed)."""
        if CHECK_OWNER:
            check_owner(self.owner, "PrefixIndex.land")
        for h in self._flights.pop(id(request), ()):
            self._nodes[h].flights.pop(id(request), None)
            self._prune(h)

    def _node(self, h: BlockHash, parent: BlockHash | None, ids: Sequence[int], k: int) -> _Node:
        node = self._nodes.get(h)
        if node is None:
            node = self._nodes[h] = _Node(parent, array("I", ids[k * BLOCK_TOKENS : (k + 1) * BLOCK_TOKENS]))
            self._children.setdefault(parent, {})[h] = None
        return node

    def _prune(self, h: BlockHash) -> None:
        """Forget ``h`` once nothing holds it."""
        node = self._nodes[h]
        if node.agents or node.flights:
            return
        del self._nodes[h]
        siblings = self._children[node.parent]
        del siblings[h]
        if not siblings:
            del self._children[node.parent]

    def stats(self) -> dict[str, int]:
        """What the index holds (``Engine.stats``)."""
        return {"blocks": len(self._nodes), "agents": len(self._chains), "in_flight": len(self._flights)}
