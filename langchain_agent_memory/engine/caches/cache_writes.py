"""A request's end: ``commit`` (on the model's thread) moves what it added into the stored
form and leaves the blocks the store lacks ready to write; ``write`` (on the save thread)
stores them, then the record. Until a save is written its blocks are served from memory
(``queued_block``), and its agent is never dropped from the hot tier nor evicted from disk
(``saving_agents``): its next request must not read an older record."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

from ..errors import CommitConflictError
from ..kv import RecurrentCache
from ..prefix import TokenizedText
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
from ..storage.protocols import BlockStore
from .agent_state import Admission, AgentState, PendingSave, kept_from
from .block_cuts import blocks_of
from .hot_agents import HotAgents
from .states import commit_snapshots

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CacheWrites:
    """The commit and write path of one engine's agent caches."""

    store: BlockStore
    pool: BlockPool
    hot: HotAgents
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
        self._lock = threading.Lock()

    def commit(self, agent_id: str, start: Admission, known: TokenizedText) -> PendingSave:
        """The end of a request that began at ``start`` and now stands for ``known``, on the
        worker thread: its tokens moved into the stored form, the tensors of the blocks the
        store lacks made ready for a write on another thread (``freeze_blocks``), the agent
        kept hot. ``write`` (on the save thread) then stores them."""
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
        with self._lock:
            self._queued.update(blocks)
            self._queued_saves.update(blocks.keys())
            self._saving[agent_id] += 1
        for layer in layers:
            if layer.spec.window is not None:
                layer.drop_before(kept_from(layer, n))
        # A hybrid's state past ``n`` (a stop sequence) is not kept: it resumes from snapshots.
        state = AgentState(
            known, chain, layers if at_end else None, self.store.seen_version(agent_id), states
        )
        self.hot.keep(agent_id, state)
        nbytes = sum(block.written_nbytes for block in blocks.values())
        replaced = old.blocks + list(old.states.values()) if old else []
        return PendingSave(record, blocks, replaced, state, nbytes, start.lease)

    def _append_only(
        self, blocks: dict[BlockHash, Block], chain: list[BlockHash], t: int, old: AgentState | None
    ) -> None:
        """Write block ``t``, the first one this commit changed, as a segment of its new rows
        where it continues the agent's stored, partly filled last block: a turn then writes
        its own tokens' K/V, not the earlier rows of that block again (a save of ~50 new
        tokens rewrote up to 255: 3.5x the bytes). Block 0 (with its 16-bit head tokens)
        is always whole, and so is a block this commit fills: see below."""
        if old is None or not 0 < t < len(old.blocks) or chain[t] not in blocks:
            return
        prior, m = old.blocks[t], len(old.tokens) - t * BLOCK_TOKENS
        block = blocks[chain[t]]
        n = len(block.token_ids)
        # NOTE: a block that fills is written whole (compacted): the chain then names one file
        # for it and its segments are released by the save, so a restore reads one file per
        # full block and one segment chain at most, the last block's (a 50-turn agent read
        # 52 parts besides its 14 blocks: 2.5x the restore of the same text stored whole).
        # The file is the one a one-turn save of these tokens writes (same hash, same bytes
        # per row), shared with it. Its cost: the block's earlier rows written once more, on
        # the save thread (the commit holds every row of the block already).
        if n == BLOCK_TOKENS:
            return
        if not 0 < m < n or not self.has_local(prior):
            return
        if any(len(x.shape) != 4 or x.shape[2] != n for x in block.tensors.values()):
            return  # a tensor not laid out by token (none is today): written whole
        if block_hash(chain[t - 1], block.token_ids[:m], self.store.fingerprint) != prior:
            return  # the block's first m tokens are not the stored ones (a DIVERGE inside it)
        block.rows_from = m

    def write(self, save: PendingSave) -> AgentRecord | None:
        """Store what ``commit`` left (on the save thread, no MLX op): the new blocks, then
        the record (the blocks it replaced that nothing else names are deleted). Returns the
        record, or None where a shared store refused it (another worker saved the agent
        first: its save stands). A save that fails leaves the previous record; the agent's
        live state is forgotten too, so that its next request starts from what is stored."""
        record = save.record

        def block_of(i: int) -> Block:
            h = record.blocks[i]
            block = save.blocks.get(h) or self.pool.hot_block(h) or self.queued_block(h)
            if block is None:
                raise CacheWriteError(
                    f"block {i} of agent {record.agent_id!r}'s cache was deleted by another process "
                    "before it could be saved; the cache was not saved (the next request prefills)"
                )
            return block

        try:
            # Served from the stored form, the agent's live caches hold what the blocks hold:
            # a copy in the pool's memory tier would double what a hot agent costs.
            self.pool.save_agent(record, block_of, save.old, admit=not self.serve_stored)
            if save.lease is not None:
                save.lease.committed()  # the record's commit gave it back
        except CommitConflictError as exc:
            # Another worker saved this agent while the request ran: its save stands (no torn
            # record), this reply's cache is not kept; the next request reads the winner's.
            logger.warning("agent %r: not saved, another worker saved it first (%s)", record.agent_id, exc)
            self.hot.drop(record.agent_id, only=save.state)
            return None
        except BaseException:
            self.hot.drop(record.agent_id, only=save.state)
            raise
        finally:
            if save.lease is not None:
                save.lease.release()  # no-op after the commit; a failed save gives it back
            with self._lock:
                # Counter subtraction drops what reaches zero: a block no save holds leaves.
                self._queued_saves -= Counter(save.blocks.keys())
                self._saving -= Counter([record.agent_id])
                for h in save.blocks:
                    if h not in self._queued_saves:
                        self._queued.pop(h, None)
        with self.hot.lock:
            save.state.version = self.store.seen_version(record.agent_id)
        return record

    def queued_block(self, h: BlockHash) -> Block | None:
        """A block a save has not written yet (held in memory until it is)."""
        with self._lock:
            return self._queued.get(h)

    def held(self, h: BlockHash) -> bool:
        """Whether block ``h`` is in memory (the pool's tier or a save's queue)."""
        return self.pool.is_hot(h) or self.queued_block(h) is not None

    def has_local(self, h: BlockHash) -> bool:
        """Whether block ``h`` is here: in memory or on this worker's disk (no round trip)."""
        return self.held(h) or self.store.has_local_block(h)

    def saving_agents(self) -> set[str]:
        """Agents with a save not written yet (``write``)."""
        with self._lock:
            return set(self._saving)
