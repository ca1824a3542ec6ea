"""What the agent-cache manager (``agents``) keeps per agent and per request: an agent's
state (its text, blocks and live layer caches), a request's admission (what it starts
from and prefills), a pending save, and the policy of which agents stay hot."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..kv import LayerCache, RecurrentCache
from ..prefix import MatchKind, PrefixMatch, TokenizedText
from ..results import CacheSource
from ..storage.blocks import BLOCK_TOKENS, AgentRecord, Block, BlockHash
from ..storage.protocols import Lease


def record_tokens(record: AgentRecord) -> TokenizedText:
    """The text and tokens a stored record stands for."""
    return TokenizedText(record.text, record.token_ids, record.token_ends)


@dataclass(slots=True)
class AgentState:
    """An agent's committed cache: the text it stands for, its blocks, and live layer
    caches while it is hot (None: rebuild them from the blocks)."""

    tokens: TokenizedText
    blocks: list[BlockHash]  # the chain
    layers: list[LayerCache] | None
    #: The shared store's version this state is (None: a local store, or not known).
    version: int | None = None
    #: A hybrid model's stored recurrent-state snapshots: token position -> its block.
    states: dict[int, BlockHash] = field(default_factory=dict)
    #: Its live caches were read from disk by a prefetch, not yet served to a request.
    prefetched: bool = False


@dataclass(slots=True, kw_only=True)
class Admission:
    """Where a request starts: layer caches holding ``known``, and ``tail`` to prefill."""

    state: AgentState | None  # the agent's cache before the request (None: it had none)
    source: CacheSource
    match: PrefixMatch
    layers: list[LayerCache]
    known: TokenizedText  # what ``layers`` hold
    tail: TokenizedText  # the prompt's tokens still to prefill
    load_s: float
    #: The chain ``known`` was read from (the agent's own, or a SHARED one): its whole
    #: blocks stay the same in the commit, so their hashes are not computed again.
    prefix_blocks: list[BlockHash]
    #: The agent's lease, taken at admission and given back by the commit or by ``fail``.
    lease: Lease | None = None
    #: A HOT start from caches a prefetch read from disk (``CacheOutcome.prefetched``).
    prefetched: bool = False
    reused: int = field(init=False)  # tokens reused: ``known`` as admitted (it grows later)

    def __post_init__(self) -> None:
        self.reused = len(self.known)

    @property
    def outcome_match(self) -> MatchKind:
        """The match reported in the result (a cold start reports MISS)."""
        return self.match.kind if self.source is not CacheSource.COLD else MatchKind.MISS

    def kept_blocks(self) -> list[BlockHash]:
        return self.prefix_blocks[: self.reused // BLOCK_TOKENS]


@dataclass(slots=True)
class PendingSave:
    """What a finished request leaves for the save thread (``AgentCaches.write``)."""

    record: AgentRecord
    blocks: dict[BlockHash, Block]  # the blocks the store lacked, frozen for the write
    old: list[BlockHash]  # the chain it replaces
    state: AgentState  # the agent's live state it stands for
    nbytes: int  # tensor bytes ``blocks`` put on disk (``Block.written_nbytes``)
    lease: Lease | None = None  # the request's: the record's commit gives it back


@dataclass(slots=True)
class HotPolicy:
    """How many agents keep live caches (``max_agents``), how many bytes those caches may
    take (``max_bytes``, stored form and working copies; None: no bound), and how many bytes
    of full-precision working copies the most needed of them keep (a copy is ~3x the stored
    form; with it the next request unpacks nothing). Which agents go first is the caller's
    ``order`` (``schedule.Schedule``: by when each runs next; least recently used first among
    those nothing was said of)."""

    max_agents: int
    work_budget_bytes: int
    max_bytes: int | None = None

    def over(self, hot: Mapping[str, AgentState], pinned: Collection[str], order: Sequence[str]) -> list[str]:
        """The agents ``enforce`` drops: first to last in ``order`` (agents of ``hot``), while
        there are too many or they take too many bytes; never a ``pinned`` one."""
        victims = [a for a in order if a not in pinned]
        count = len(hot)
        total = sum(live_bytes(state) for state in hot.values()) if self.max_bytes is not None else 0
        dropped = []
        bytes_over = self.max_bytes is not None and total > self.max_bytes
        while victims and (count > self.max_agents or bytes_over):
            agent = victims.pop(0)
            count -= 1
            total -= live_bytes(hot[agent]) if self.max_bytes is not None else 0
            bytes_over = self.max_bytes is not None and total > self.max_bytes
            dropped.append(agent)
        return dropped

    def enforce(
        self,
        hot: OrderedDict[str, AgentState],
        pinned: Collection[str] = (),
        order: Sequence[str] | None = None,
    ) -> list[str]:
        """Drop agents, first to last in ``order`` (default: least recently used first), while
        there are more than ``max_agents`` or they take more than ``max_bytes``, never a
        ``pinned`` one (a save of theirs is not written yet, and their next request must not
        read an older record); then drop the working copies over the budget, keeping those of
        the agents last in ``order``. Returns the agents dropped."""
        order = list(hot) if order is None else [a for a in order if a in hot]
        dropped = self.over(hot, pinned, order)
        for agent in dropped:
            del hot[agent]
        used = 0
        for agent in reversed([a for a in order if a in hot]):  # most needed first
            for layer in hot[agent].layers or ():
                if used + layer.work_nbytes > self.work_budget_bytes:
                    layer.drop_work()
                used += layer.work_nbytes
        return dropped


def live_bytes(state: AgentState) -> int:
    """Bytes an agent's live caches hold (stored form and working copies)."""
    return layers_bytes(state.layers or ())


def layers_bytes(layers: Iterable[LayerCache | RecurrentCache]) -> int:
    """Bytes live layer caches hold (stored form and working copies)."""
    return sum(layer.nbytes + layer.work_nbytes for layer in layers)


def kept_from(layer: LayerCache, n_tokens: int) -> int:
    """The first position a layer keeps once an agent stands for ``n_tokens``: a sliding
    layer its window and the last (partial) block, for the next save; a full layer all."""
    if layer.spec.window is None or isinstance(layer, RecurrentCache):
        return 0
    return min(max(0, n_tokens - layer.spec.window), (n_tokens // BLOCK_TOKENS) * BLOCK_TOKENS)


def holds_window(layer: LayerCache, n_tokens: int) -> bool:
    """Whether a live layer can serve a request that keeps its first ``n_tokens``."""
    if isinstance(layer, RecurrentCache):
        return layer.can_trim(n_tokens)
    if layer.committed_end != layer.offset or layer.offset < n_tokens:
        return False
    if layer.spec.window is None:
        return layer.start == 0
    return layer.start <= max(0, n_tokens - layer.spec.window)
