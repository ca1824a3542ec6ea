"""A request's end: ``commit`` (on the engine's loop) moves what it added into the stored
form and leaves the blocks the store lacks ready to write; ``write_job`` says what the I/O
side writes, ``write_record`` (on the save thread) stores the blocks, then the record, and
``written`` (on the loop again) takes in how that ended. Until a save is written its blocks
are served from memory (``queued_block``), and its agent is never dropped from the hot tier
nor evicted from disk (``saving_agents``): its next request must not read an older record."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import CacheFormatError, CommitConflictError
from ..kv import RecurrentCache
from ..ops.owner import CHECK_OWNER, check_owner
from ..prefix import TokenizedText
from ..storage.block_writes import BlockWrites, WriteOutcome
from ..storage.blocks import (
    BLOCK_TOKENS,
    AgentRecord,
    Block,
    BlockHash,
    CacheWriteError,
    block_hash,
    chain_hashes,
    freeze_blocks,
)
from ..storage.pool import BlockPool
from ..storage.protocols import BlockStore, Lease, seen_version
from .agent_state import Admission, AgentState, PendingSave, kept_from
from .block_cuts import blocks_of
from .hot_agents import HotAgents
from .prefix_index import PrefixIndex
from .states import commit_snapshots

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CacheWrites:
    """The commit and write path of one engine's agent caches."""

    store: BlockStore
    pool: BlockPool
    hot: HotAgents
    #: what a commit's chain is known by for the next requests' reuse
    index: PrefixIndex
    #: a hybrid's snapshot bytes over its K/V's (``states.commit_snapshots``)
    state_budget: float | None
    #: requests attend on the stored form: the pool's memory tier keeps no copy of a save
    serve_stored: bool = False

    def __post_init__(self) -> None:
        #: Blocks built by a commit and not written yet (a request reads them from here
        #: meanwhile), how many queued saves hold each, and the agents of those saves.
        self._queued: dict[BlockHash, Block] = {}
        self._queued_saves: Counter[BlockHash] = Counter()
        self._saving: Counter[str] = Counter()
        #: Each agent's latest record whose save is not written yet, for readers on other
        #: threads (a server's listing, which must not wait for saves but must list a turn
        #: it answered): published by the loop, replaced whole, never changed in place.
        self.saving_records: Mapping[str, AgentRecord] = MappingProxyType({})

    def commit(self, agent_id: str, start: Admission, known: TokenizedText) -> PendingSave:
        """The end of a request that began at ``start`` and now stands for ``known``, on the
        worker thread: its tokens moved into the stored form, the tensors of the blocks the
        store lacks made ready for a write on another thread (``freeze_blocks``), the agent
        kept hot. ``write_job`` then says what the I/O side writes."""
        if CHECK_OWNER:
            check_owner(self.hot.owner, "CacheWrites.commit")
        layers, old = start.layers, start.state
        n = len(known)
        kept = start.kept_blocks()
        fp = self.store.fingerprint
        chain = [*kept, *chain_hashes(known.ids, fp, kept[-1] if kept else None, len(kept))]
        states, new_states, at_end = commit_snapshots(
            start, chain, known, fp, self.has_local, self.state_budget
        )
        for layer in layers:
            layer.commit(keep_work=self.hot.policy.work_budget_bytes > 0, keep_from=kept_from(layer, n))
            if layer.offset > n and not isinstance(layer, RecurrentCache):
                layer.trim_to(n)
        record = AgentRecord(
            agent_id, chain + list(states.values()), known.ids, known.ends, known.text, states=list(states)
        )
        # Local knowledge only (no store round trip on this thread): a block the store has
        # elsewhere is built for nothing, never written twice.
        wanted = [(b, h) for b, h in enumerate(chain) if not self.has_local(h)]
        blocks = blocks_of(self.pool, [b for b, _ in wanted], chain, known, layers)
        self._append_only(blocks, chain, len(kept), old)
        blocks.update(new_states)
        freeze_blocks(list(blocks.values()))  # those not cut from a run already
        self._queued.update(blocks)
        self._queued_saves.update(blocks.keys())
        self._saving[agent_id] += 1
        self.saving_records = MappingProxyType({**self.saving_records, agent_id: record})
        for layer in layers:
            if layer.spec.window is not None:
                layer.drop_before(kept_from(layer, n))
        # A hybrid's state past ``n`` (a stop sequence) is not kept: it resumes from snapshots.
        state = AgentState(
            known, chain, layers if at_end else None, seen_version(self.store.replication, agent_id), states
        )
        self.hot.keep(agent_id, state)
        self.index.hold(agent_id, chain, known.ids)
        nbytes = sum(block.written_nbytes for block in blocks.values())
        replaced = old.blocks + list(old.states.values()) if old else []
        return PendingSave(record, blocks, replaced, state, nbytes, start.lease)

    def _append_only(
        self, blocks: dict[BlockHash, Block], chain: list[BlockHash], t: int, old: AgentState | None
    ) -> None:
        """Write block ``t``, the first one this commit changed, as a segment where it
        continues the agent's stored, partly filled last block: its rows after the whole
        block that stored chain starts from (a turn of ~50 new tokens rewrote up to 255 rows
        when written whole: 3.5x the bytes). Block 0 (with its 16-bit head tokens) is
        always whole, and so is a block this commit fills or one whose segment would hold
        more rows than its prefix: see below."""
        if old is None or not 0 < t < len(old.blocks) or chain[t] not in blocks:
            return
        block = blocks[chain[t]]
        n = len(block.token_ids)
        # NOTE: a block that fills is written whole (compacted): the chain then names one file
        # for it and its segments are released by the save, so a restore reads one file per
        # full block (a 50-turn agent read 52 parts besides its 14 blocks: 2.5x the restore
        # of the same text stored whole). The file is the one a one-turn save of these
        # tokens writes (same hash, same bytes per row), shared with it. Its cost: the
        # block's earlier rows written once more, on the save thread (the commit holds every
        # row of the block already).
        if n == BLOCK_TOKENS:
            return
        m = len(old.tokens) - t * BLOCK_TOKENS
        if not 0 < m < n or any(len(x.shape) != 4 or x.shape[2] != n for x in block.tensors.values()):
            return  # not a continuation, or a tensor not laid out by token (none is today): whole
        prefix = self._whole_prefix(old.blocks[t], chain[t - 1], block.token_ids[:m])
        if prefix is None:
            return  # where the stored block starts from is not known here: written whole
        base, p = prefix
        # NOTE: the segment holds every row since the whole prefix (the previous segment's
        # rows again), never continues a segment: the last block is read from two files at
        # most, as the issue asks (a chain of a segment per turn was 4-7 parts late in a
        # block's cycle, 1.3-1.8x the whole form's restore at 50 turns). The block is
        # written whole instead once the segment would hold more rows than its prefix: the
        # prefix at least doubles each time, which kept the rows written within 3% of the
        # cheapest schedule of whole writes for 40-60 new tokens a turn (simulated).
        if n - p > p or not self.has_local(base):
            return
        if block_hash(chain[t - 1], block.token_ids[:p], self.store.fingerprint) != base:
            return  # the block's first p tokens are not the stored ones (a DIVERGE inside it)
        block.rows_from = p

    def _whole_prefix(
        self, h: BlockHash, parent: BlockHash, token_ids: list[int]
    ) -> tuple[BlockHash, int] | None:
        """The whole block that stored block ``h`` (``token_ids``, after block ``parent``) is
        read from first, and its tokens: ``h`` itself where it is whole, else the block its
        segments continue. None where ``h``'s file is gone or unreadable."""
        fp = self.store.fingerprint
        m = len(token_ids)
        for _ in range(BLOCK_TOKENS):  # agents saved before this change: a segment a turn
            in_hand = self.queued_block(h) or self.pool.hot_block(h)
            try:
                prior = in_hand.prior(fp) if in_hand is not None else self.store.blocks.prior_of(h)
            except CacheFormatError:  # BlockMissingError too
                return None
            if prior is None:
                return h, m
            if in_hand is not None:
                m = in_hand.rows_from
            else:  # a header names its prior by hash only: the prefix of these tokens it is
                hashes = ((p, block_hash(parent, token_ids[:p], fp)) for p in range(m - 1, 0, -1))
                m = next((p for p, x in hashes if x == prior), 0)
                if not m:
                    return None
            h = prior
        return None

    def write_job(self, save: PendingSave) -> WriteJob:
        """What the I/O side writes for ``save`` (on the loop): its record, the blocks the
        record names that memory holds (the save's own, the pool's, other saves' not written
        yet: the job reads nothing of the loop's), what it replaces, its lease."""
        in_hand = dict(save.blocks)
        for h in save.record.blocks:
            block = in_hand.get(h) or self.pool.hot_block(h) or self.queued_block(h)
            if block is not None:
                in_hand[h] = block
        # Served from the stored form, the agent's live caches hold what the blocks hold:
        # a copy in the pool's memory tier would double what a hot agent costs.
        return WriteJob(save.record, in_hand, tuple(save.old), save.lease, admit=not self.serve_stored)

    def written(self, save: PendingSave, done: Written) -> None:
        """The I/O side ended ``save``'s write (``write_record``; on the loop): the blocks it
        wrote kept hot, those it deleted forgotten, its blocks no longer served from the
        queue; the agent's live state gets the stored version, or, where the record was not
        stored, is forgotten (its next request starts from what is stored)."""
        if CHECK_OWNER:
            check_owner(self.hot.owner, "CacheWrites.written")
        self.pool.apply(done.outcome, admit=not self.serve_stored)
        # Counter subtraction drops what reaches zero: a block no save holds leaves.
        self._queued_saves -= Counter(save.blocks.keys())
        self._saving -= Counter([save.record.agent_id])
        if save.record.agent_id not in self._saving:  # its last queued save: the store's now
            published = dict(self.saving_records)
            published.pop(save.record.agent_id, None)
            self.saving_records = MappingProxyType(published)
        for h in save.blocks:
            if h not in self._queued_saves:
                self._queued.pop(h, None)
        if done.stored:
            save.state.version = done.version
        else:  # its next request reads what is stored (the index takes it again then)
            self.hot.drop(save.record.agent_id, only=save.state)
            self.index.drop(save.record.agent_id)

    def queued_block(self, h: BlockHash) -> Block | None:
        """A block a save has not written yet (held in memory until it is)."""
        return self._queued.get(h)

    def queued_bytes(self) -> int:
        """Bytes of the blocks saves hold in memory until written (those the pool's tier
        holds too counted there)."""
        return sum(b.nbytes for h, b in self._queued.items() if not self.pool.is_hot(h))

    def queued_hashes(self) -> list[BlockHash]:
        """The blocks of saves not written yet."""
        return list(self._queued)

    def held(self, h: BlockHash) -> bool:
        """Whether block ``h`` is in memory (the pool's tier or a save's queue)."""
        return self.pool.is_hot(h) or self.queued_block(h) is not None

    def has_local(self, h: BlockHash) -> bool:
        """Whether block ``h`` is here: in memory or on this worker's disk (no round trip)."""
        return self.held(h) or self.store.local.blocks.has(h)

    def saving_agents(self) -> set[str]:
        """Agents with a save not written yet (``write``)."""
        return set(self._saving)


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One save, for the I/O side (``write_record``): nothing in it is the loop's to change.
    The record is handed over (the write names its segments' priors in it)."""

    record: AgentRecord
    #: the blocks of ``record`` in memory when the turn ended: the new ones, and any whose
    #: file the store may lack or whose header need not be read
    in_hand: Mapping[BlockHash, Block]
    #: the chain it replaces
    old: tuple[BlockHash, ...]
    #: the request's lease: the record's commit gives it back
    lease: Lease | None
    #: whether the blocks written are kept in the pool's memory tier
    admit: bool


@dataclass(frozen=True, slots=True)
class Written:
    """How a save's write ended (``write_record``), for the loop (``CacheWrites.written``)."""

    #: whether the record was stored (False: it failed, or another worker's save won)
    stored: bool
    #: what the store writes did (the blocks written, the blocks deleted)
    outcome: WriteOutcome
    #: the shared store's version of the agent after the write (None: not known)
    version: int | None = None
    #: what made it fail (a conflict is no failure: None)
    error: BaseException | None = None


def write_record(job: WriteJob, writes: BlockWrites) -> Written:
    """Store ``job`` (on the I/O thread, no MLX op): the new blocks, then the record (the
    blocks it replaced that nothing else names are deleted). A save that fails leaves the
    previous record (``Written.error``); where a shared store refused it (another worker
    saved the agent first) its save stands and this one is not kept."""
    record = job.record
    outcome = WriteOutcome()

    def block_of(i: int) -> Block:
        block = job.in_hand.get(record.blocks[i])
        if block is None:
            raise CacheWriteError(
                f"block {i} of agent {record.agent_id!r}'s cache was deleted by another process "
                "before it could be saved; the cache was not saved (the next request prefills)"
            )
        return block

    try:
        writes.save_agent(record, block_of, job.old, into=outcome, in_hand=job.in_hand)
        if job.lease is not None:
            job.lease.committed()  # the record's commit gave it back
    except CommitConflictError as exc:
        # Another worker saved this agent while the request ran: its save stands (no torn
        # record), this reply's cache is not kept; the next request reads the winner's.
        logger.warning("agent %r: not saved, another worker saved it first (%s)", record.agent_id, exc)
        return Written(False, outcome)
    except Exception as exc:
        return Written(False, outcome, error=exc)
    finally:
        if job.lease is not None:
            job.lease.release()  # no-op after the commit; a failed save gives it back
    return Written(True, outcome, seen_version(writes.store.replication, record.agent_id))
