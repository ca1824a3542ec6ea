"""The agent-cache manager: which cache a request starts from, and what it leaves behind.

A request's agent is looked up hot (live layer caches in memory), then in the pool's memory
tier, then on disk; its prompt is matched to the cached text (``prefix``); layer caches are
built from the blocks the match keeps; with nothing of its own, whole blocks another agent
stored for the same leading tokens are reused (``SHARED``). A damaged record or block is
quarantined and the request prefills (said in a log line). ``commit`` stores what a request
added and keeps the agent hot (``HotPolicy``: how many stay hot, which keep working copies).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from .agent_state import Admission, AgentState, HotPolicy, PendingSave, holds_window, kept_from, record_tokens
from .block_cuts import blocks_of
from .kv import KVQuant, LayerCache, ModelCacheSpec, RecurrentCache, make_layer_caches
from .prefix import NOT_A_BOUNDARY, MatchKind, PrefixMatch, TokenizedText, match, tokenize, tokenize_prompt
from .restore import available_prefix, layers_from_blocks
from .results import CacheSource
from .states import BUDGET, commit_snapshots, resume
from .storage.blocks import (
    BLOCK_TOKENS,
    AgentRecord,
    Block,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    CacheWriteError,
    NewerFormatError,
    chain_hashes,
    freeze_blocks,
    prompt_hashes,
    state_block_hash,
    validate_agent_id,
)
from .storage.budget import EvictionReport, StorageBudget, enforce
from .storage.catalog import CommitConflictError
from .storage.objects import BlocksUnavailableError
from .storage.pool import BlockPool
from .storage.protocols import BlockStore, Lease, take_lease

T = TypeVar("T")

logger = logging.getLogger(__name__)


class AgentCaches:
    """Every agent's cache of one engine: hot ones in memory, all of them in the pool and
    store. ``lock`` guards the hot table, the pool and live layer caches."""

    state_budget: float | None = BUDGET  # a hybrid's snapshot bytes over its K/V's (``keep``)

    def __init__(
        self,
        spec: ModelCacheSpec,
        quant: KVQuant,
        store: BlockStore,
        pool: BlockPool,
        tokenizer: Any,
        policy: HotPolicy,
        prefill_rotated: bool,
        serve_stored: bool = False,
    ) -> None:
        self.spec, self.quant, self.store, self.pool = spec, quant, store, pool
        self.tokenizer = tokenizer
        self.policy = policy
        self.prefill_rotated = prefill_rotated
        #: Requests attend on the stored form (``kv.stored``): no working copies are made.
        self.serve_stored = serve_stored
        #: Per layer, the working-copy rows the engine reserved (``kv.reserve``; None: none).
        self.reserved_rows: tuple[int, ...] | None = None
        self.hot: OrderedDict[str, AgentState] = OrderedDict()  # LRU order
        self.lock = threading.RLock()
        #: Blocks built by a commit and not written yet (a request reads them from here
        #: meanwhile), how many queued saves hold each, and the agents of those saves.
        self._queued: dict[BlockHash, Block] = {}
        self._queued_saves: Counter[BlockHash] = Counter()
        self.saving: Counter[str] = Counter()
        self._queued_lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        return self.store.fingerprint

    def new_layers(self) -> list[LayerCache]:
        return make_layer_caches(
            self.spec, self.quant, self.prefill_rotated, self.reserved_rows, self.serve_stored
        )

    # ------------------------------------------------------------------ a request's start

    def admit(self, agent_id: str, prompt: str, lease: Lease | None = None) -> Admission:
        """The caches a request for ``prompt`` starts from, loaded, and what to prefill.
        ``lease``: the agent's, taken already (off this thread: ``admissions``)."""
        with self.lock:
            hot = self.hot.get(agent_id)
            # A shared store: take the agent's lease; another worker saved it since: reread.
            if lease is None:
                lease = take_lease(self.store, agent_id, hot.version if hot else None)
            if not lease.current and hot is not None:
                self.hot.pop(agent_id, None)
            with lease:  # given back if the admission fails
                start = self._admit(agent_id, prompt)
            start.lease = lease
            return start

    def _admit(self, agent_id: str, prompt: str) -> Admission:
        with self.lock:
            state, source = self.lookup(agent_id)
            m = match(state.tokens, prompt) if state else match(TokenizedText(""), prompt)
            if state is not None and m.kind is not MatchKind.MISS:
                t0 = time.perf_counter()
                layers, from_disk, reused = self.materialize(agent_id, state, m.reuse_tokens)
                if layers is not None:
                    known = TokenizedText(state.tokens.text, state.tokens.ids[:], state.tokens.ends[:])
                    known.truncate(reused)
                    if reused != m.reuse_tokens:  # the store delivered only part: prefill the rest
                        m = PrefixMatch(MatchKind.DIVERGE, reused, len(known.text))
                    if not prompt.startswith(known.text) or len(known.text) != m.reuse_chars:
                        raise RuntimeError("prefix bookkeeping out of step (this is a bug)")
                    tail = tokenize(self.tokenizer, prompt[len(known.text) :], add_special_tokens=False)
                    source = CacheSource.WARM if from_disk else source
                    load_s = time.perf_counter() - t0
                    return Admission(state, source, m, layers, known, tail, load_s, state.blocks)
            return self.cold_start(state, prompt)

    def lookup(self, agent_id: str) -> tuple[AgentState | None, CacheSource]:
        state = self.hot.get(agent_id)
        if state is not None:
            self.hot.move_to_end(agent_id)
            return state, CacheSource.HOT
        record = self.read_record(agent_id)
        if record is None:
            return None, CacheSource.COLD
        tokens = record_tokens(record)
        # HOT until a block has to be read from disk (``materialize`` says so): blocks
        # still in the pool's memory tier serve a recorded agent without any I/O.
        version = self.store.seen_version(agent_id)
        return AgentState(tokens, record.chain, None, version, record.state_blocks()), CacheSource.HOT

    def read_record(self, agent_id: str) -> AgentRecord | None:
        try:
            return self.store.get_agent(agent_id)
        except NewerFormatError:
            raise  # a newer version's cache: refuse rather than overwrite it
        except CacheFormatError as exc:
            # Moved aside (so this is said once), references kept: the next save reuses
            # the record's sound blocks and rewrites it.
            self.store.quarantine_agent(agent_id)
            logger.warning(
                "agent %r: stored cache record unusable (%s); moved to quarantine/, falling back "
                "to prefill (sound blocks shared by content are still reused), the next save "
                "rewrites it",
                agent_id,
                exc,
            )
            return None

    def materialize(
        self, agent_id: str, state: AgentState, n_tokens: int
    ) -> tuple[list[LayerCache] | None, bool, int]:
        """Layer caches holding the first ``n_tokens`` of ``state`` (fewer if a shared store
        does not deliver every block in time, or, on a hybrid model, back to the newest
        state snapshot: how many is the third value) and whether any block came from disk;
        ``(None, False, 0)`` if the stored cache is unusable (logged) or, on a hybrid model,
        has no snapshot to resume from before ``n_tokens``."""
        snapshot: BlockHash | None = None
        if self.spec.hybrid:
            n_tokens, snapshot = resume(state, n_tokens)
            if n_tokens == 0:
                return None, False, 0
        live = state.layers
        if live is not None:
            lacking = [i for i, layer in enumerate(live) if not holds_window(layer, n_tokens)]
            rebuilt: list[LayerCache] | None = None
            from_disk = False
            if lacking and len(lacking) < len(live):
                # A request that goes back before the last turn (a DIVERGE): the sliding layers
                # kept only their window and need older tokens from the blocks, the full layers
                # (and their working copies) still hold all they need.
                try:
                    rebuilt, from_disk = self.from_blocks(
                        state.blocks, n_tokens, only=lacking, state=snapshot
                    )
                except (BlocksUnavailableError, CacheFormatError):
                    rebuilt = None  # the whole rebuild below says what went wrong
            if not lacking or rebuilt is not None:
                for i, layer in enumerate(live):
                    if rebuilt is not None and i in lacking:
                        live[i] = rebuilt[i]
                    else:
                        layer.trim_to(n_tokens)
                state.layers = None  # handed over to this request
                return live, from_disk, n_tokens
        try:
            try:
                return (*self.from_blocks(state.blocks, n_tokens, state=snapshot), n_tokens)
            except BlocksUnavailableError as exc:
                fewer = (
                    0 if self.spec.hybrid else available_prefix(self, state.blocks, state.tokens, n_tokens)
                )
                logger.warning(
                    "agent %r: %s; reusing the %d of %d cached tokens on this worker and prefilling the rest",
                    agent_id,
                    exc,
                    fewer,
                    n_tokens,
                )
                if fewer == 0:
                    return None, False, 0
                return (*self.from_blocks(state.blocks, fewer), fewer)
        except BlocksUnavailableError:
            return None, False, 0
        except CacheFormatError as exc:
            quarantined = self._quarantine_bad(state.blocks)
            aside = f"; {quarantined} bad block file(s) moved to quarantine/" if quarantined else ""
            logger.warning(
                "agent %r: stored cache unusable (%s)%s; falling back to prefill (sound blocks "
                "shared by content are still reused), the next save rewrites it",
                agent_id,
                exc,
                aside,
            )
            return None, False, 0

    def _quarantine_bad(self, chain: list[BlockHash]) -> int:
        """Move every unreadable block of ``chain`` aside; return how many were moved."""
        moved = 0
        with self.store.locked():
            for h in chain:
                self.pool.forget(h)
                try:
                    self.store.get_block(h)
                except (BlockMissingError, BlocksUnavailableError):
                    continue
                except CacheFormatError:
                    moved += self.store.quarantine_block(h) is not None
        return moved

    def from_blocks(
        self,
        chain: list[BlockHash],
        n_tokens: int,
        only: Collection[int] | None = None,
        state: BlockHash | None = None,
    ) -> tuple[list[LayerCache], bool]:
        """Layer caches of the first ``n_tokens`` of ``chain`` (a hybrid model's recurrent
        layers from the snapshot block ``state``), and whether a block was read from disk
        (``restore.layers_from_blocks``)."""
        return layers_from_blocks(self, chain, n_tokens, only, state)

    def cold_start(self, state: AgentState | None, prompt: str) -> Admission:
        """No usable cache of the agent's own: reuse whole blocks any agent stored for the
        same leading tokens (a shared system prompt), else start empty."""
        full = tokenize_prompt(self.tokenizer, prompt)
        chain = list(itertools.takewhile(self._has, prompt_hashes(full.ids, self.fingerprint)))
        while chain and (
            full.ends[len(chain) * BLOCK_TOKENS - 1] == NOT_A_BOUNDARY
            or (self.spec.hybrid and not self._has(state_block_hash(chain[-1], self.fingerprint)))
        ):
            chain.pop()
        if chain:
            n = len(chain) * BLOCK_TOKENS
            t0 = time.perf_counter()
            snapshot = state_block_hash(chain[-1], self.fingerprint) if self.spec.hybrid else None
            try:
                layers, from_disk = self.from_blocks(chain, n, state=snapshot)
            except (CacheFormatError, BlocksUnavailableError) as exc:
                logger.warning("shared blocks unusable (%s); prefilling from scratch", exc)
            else:
                known, tail = full.split(n)
                source = CacheSource.WARM if from_disk else CacheSource.HOT
                shared = PrefixMatch(MatchKind.SHARED, n, len(known.text))
                load_s = time.perf_counter() - t0
                return Admission(state, source, shared, layers, known, tail, load_s, chain)
        miss = PrefixMatch(MatchKind.MISS, 0, 0)
        return Admission(state, CacheSource.COLD, miss, self.new_layers(), TokenizedText(""), full, 0.0, [])

    # ------------------------------------------------------------------ a request's end

    def commit(self, agent_id: str, start: Admission, known: TokenizedText) -> PendingSave:
        """The end of a request that began at ``start`` and now stands for ``known``, on the
        worker thread: its tokens moved into the stored form, the tensors of the blocks the
        store lacks made ready for a write on another thread (``freeze_blocks``), the agent
        kept hot. ``write`` (on the save thread) then stores them."""
        layers, old = start.layers, start.state
        n = len(known)
        chain = self._chain_of(known, start.kept_blocks())
        fp, budget = self.fingerprint, self.state_budget
        states, new_states, at_end = commit_snapshots(start, chain, known, fp, self.has_local, budget)
        for layer in layers:
            layer.commit(keep_work=self.policy.work_budget_bytes > 0, keep_from=kept_from(layer, n))
            if layer.offset > n and not isinstance(layer, RecurrentCache):
                layer.trim_to(n)
        record = AgentRecord(
            agent_id, chain + list(states.values()), known.ids, known.ends, known.text, states=list(states)
        )
        # Local knowledge only (no store round trip on this thread): a block the store has
        # elsewhere is built for nothing, never written twice.
        wanted = [(b, h) for b, h in enumerate(chain) if not self.has_local(h)]
        blocks = blocks_of(self.pool, [b for b, _ in wanted], chain, known, layers)
        blocks.update(new_states)
        freeze_blocks(list(blocks.values()))  # those not cut from a run already
        with self._queued_lock:
            self._queued.update(blocks)
            self._queued_saves.update(blocks.keys())
            self.saving[agent_id] += 1
        for layer in layers:
            if layer.spec.window is not None:
                layer.drop_before(kept_from(layer, n))
        # A hybrid's state past ``n`` (a stop sequence) is not kept: it resumes from snapshots.
        state = AgentState(
            known, chain, layers if at_end else None, self.store.seen_version(agent_id), states
        )
        self.keep_hot(agent_id, state)
        nbytes = sum(block.nbytes for block in blocks.values())
        replaced = old.blocks + list(old.states.values()) if old else []
        return PendingSave(record, blocks, replaced, state, nbytes, start.lease)

    def _has(self, h: BlockHash) -> bool:
        return self.held(h) or self.store.has_block(h)

    def has_local(self, h: BlockHash) -> bool:
        """Whether block ``h`` is here: in memory or on this worker's disk (no round trip)."""
        return self.held(h) or self.store.has_local_block(h)

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
            self._forget(save)
            return None
        except BaseException:
            self._forget(save)
            raise
        finally:
            if save.lease is not None:
                save.lease.release()  # no-op after the commit; a failed save gives it back
            with self._queued_lock:
                # Counter subtraction drops what reaches zero: a block no save holds leaves.
                self._queued_saves -= Counter(save.blocks.keys())
                self.saving -= Counter([record.agent_id])
                for h in save.blocks:
                    if h not in self._queued_saves:
                        self._queued.pop(h, None)
        with self.lock:
            save.state.version = self.store.seen_version(record.agent_id)
        return record

    def _forget(self, save: PendingSave) -> None:
        """Drop the live state ``save`` stood for, unless a later request replaced it."""
        with self.lock:
            if self.hot.get(save.record.agent_id) is save.state:
                self.hot.pop(save.record.agent_id, None)

    def _chain_of(self, known: TokenizedText, kept: list[BlockHash]) -> list[BlockHash]:
        """The block chain of ``known``; ``kept``: the hashes of its first whole blocks,
        already known (a commit hashes only what the request added)."""
        return [*kept, *chain_hashes(known.ids, self.fingerprint, kept[-1] if kept else None, len(kept))]

    def keep_hot(self, agent_id: str, state: AgentState) -> None:
        self.hot[agent_id] = state
        self.hot.move_to_end(agent_id)
        self.policy.enforce(self.hot, self.saving_agents())

    def queued_block(self, h: BlockHash) -> Block | None:
        """A block a save has not written yet (held in memory until it is)."""
        with self._queued_lock:
            return self._queued.get(h)

    def held(self, h: BlockHash) -> bool:
        """Whether block ``h`` is in memory (the pool's tier or a save's queue)."""
        return self.pool.is_hot(h) or self.queued_block(h) is not None

    def saving_agents(self) -> set[str]:
        """Agents with a save not written yet (``write``)."""
        with self._queued_lock:
            return set(self.saving)

    def load_hot(self, agent_id: str) -> bool:
        """Build an agent's live caches from its blocks (a prefetch); False if it has no
        cache, is live already, or its cache is unusable."""
        live = self.hot.get(agent_id)
        if live is not None and live.layers is not None:
            return False
        state, _ = self.lookup(agent_id)
        if state is None:
            return False
        layers, _, reused = self.materialize(agent_id, state, len(state.tokens))
        if layers is None or reused != len(state.tokens):
            return False
        state.layers = layers
        self.keep_hot(agent_id, state)
        return True

    # ------------------------------------------------------------------ administration

    def set_agent(self, agent_id: str, source: AgentRecord) -> None:
        """Make ``agent_id``'s cache stand for what ``source`` does (blocks shared)."""
        self._point(agent_id, lambda: self.pool.set_agent(source.named(agent_id)))

    def fork(self, source_id: str, agent_id: str) -> AgentRecord:
        """``agent_id`` stands for what ``source_id``'s stored cache does now (its record read
        with the write: ``BlockPool.fork``); returns that record."""
        validate_agent_id(source_id)
        return self._point(agent_id, lambda: self.pool.fork(source_id, lambda src: src.named(agent_id)))

    def _point(self, agent_id: str, write: Callable[[], T]) -> T:
        """``write()`` a new record for ``agent_id`` under its lease; its live copy dropped."""
        validate_agent_id(agent_id)
        try:  # not under ``lock`` (the model steps'): the store's lock and lease are waited for
            with take_lease(self.store, agent_id, self.store.seen_version(agent_id)) as lease:
                if not lease.current:
                    self.read_record(agent_id)  # a shared store's newer version: this replaces that one
                done = write()
                lease.committed()
                return done
        finally:
            with self.lock:
                self.hot.pop(agent_id, None)  # a live copy would stand for the old text

    def evict(self, budget: StorageBudget, in_use: set[str], low_water: float) -> EvictionReport:
        """Bring the store within ``budget`` (``budget.enforce``), never evicting ``in_use``;
        evicted agents are forgotten in memory too (their next request prefills)."""
        with self.store.locked():  # not the model steps' lock: deletes take disk time
            report = enforce([self.store], budget, in_use=lambda _, a: a in in_use, low_water=low_water)
        with self.lock:
            for _, agent in report.evicted:
                self.hot.pop(agent, None)
            for h in report.deleted_blocks.get(self.fingerprint, ()):
                self.pool.forget(h)
        return report

    def delete(self, agent_id: str) -> bool:
        with self.lock:
            self.hot.pop(agent_id, None)
        return self.pool.delete_agent(agent_id)

    def cached_tokens(self, agent_id: str) -> int:
        return len(self.cached(agent_id))

    def cached_text(self, agent_id: str) -> str:
        return self.cached(agent_id).text

    def cached(self, agent_id: str) -> TokenizedText:
        """The text and tokens the agent's cache stands for (empty: none)."""
        with self.lock:
            state = self.hot.get(agent_id)
            if state is not None:
                return state.tokens
        record = self.read_record(agent_id)  # not under the model steps' lock: a store round trip
        return record_tokens(record) if record is not None else TokenizedText("")

    def drop_hot(self, agent_id: str | None = None) -> None:
        with self.lock:
            if agent_id is None:
                self.hot.clear()
            else:
                self.hot.pop(agent_id, None)

    def clear_memory(self) -> None:
        """Free every live cache and the pool's memory tier (what is stored stays)."""
        with self.lock:
            self.hot.clear()
            for h in self.pool.hot_hashes():
                self.pool.forget(h)

    def working_copy_bytes(self) -> int:
        return sum(c.work_nbytes for state in self.hot.values() for c in state.layers or ())
