"""The agent-cache manager: which cache a request starts from, and what it leaves behind.

A request's agent is looked up hot (live layer caches in memory), then in the pool's memory
tier, then on disk; what the request starts from is the prefix index's answer
(``prefix_index``: its own cache's text matched with the prompt, else blocks other agents
stored for the same leading tokens, ``SHARED``); layer caches are built from the blocks
the answer keeps. A damaged record or block is quarantined and the request prefills (said
in a log line). ``commit`` stores what a request added and keeps the agent hot
(``HotPolicy``: how many stay hot, which keep working copies).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kv import KVQuant, LayerCache, ModelCacheSpec, RecurrentCache, make_layer_caches
from ..ops.owner import Owner
from ..ops.runtime import mx
from ..prefix import MatchKind, PrefixMatch, TokenizedText, tokenize
from ..results import CacheSource
from ..storage.block_writes import WriteOutcome
from ..storage.blocks import (
    BLOCK_TOKENS,
    AgentRecord,
    BlockHash,
    BlockMissingError,
    CacheFormatError,
    NewerFormatError,
)
from ..storage.budget import EvictionReport
from ..storage.objects import BlocksUnavailableError
from ..storage.pool import BlockPool
from ..storage.protocols import BlockStore, Lease, StoreReads, seen_version, take_lease
from .agent_state import Admission, AgentState, HotPolicy, holds_window, layers_bytes, record_tokens
from .cache_writes import CacheWrites
from .hot_agents import HotAgents
from .prefix_index import NOTHING, IndexView, OwnCache, PrefixIndex, Prompt, ReusePlan
from .restore import available_prefix, layers_from_blocks
from .schedule import Schedule
from .states import BUDGET

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Loaded:
    """Layer caches holding an agent's first ``tokens`` tokens, and whether a block of them
    was read from disk (``AgentCaches.materialize``)."""

    layers: list[LayerCache]
    from_disk: bool
    tokens: int


@dataclass(frozen=True, slots=True)
class AgentView:
    """What the loop knows of an agent, handed to a thread that prepares its request (a
    shared store's admissions): read there instead of the loop's state, which goes on."""

    #: the live copy's tokens, chain and snapshots (None: not hot)
    live: AgentState | None
    #: the shared store's version the live copy is (None: none live, or not known)
    version: int | None
    #: the blocks in memory (``AgentCaches.held_blocks``)
    held: frozenset[BlockHash]
    #: the prefix index on the request's prompt's path (``PrefixIndex.view``)
    index: IndexView = field(default_factory=IndexView)


class AgentCaches:
    """Every agent's cache of one engine: hot ones in memory (``hot``), all of them in the
    pool and store; a request's start here, its end in ``writes``. All of it is the engine
    loop's (``ops.owner``): no lock guards it, other threads send the loop messages."""

    def __init__(
        self,
        *,
        spec: ModelCacheSpec,
        quant: KVQuant,
        store: BlockStore,
        pool: BlockPool,
        tokenizer: Any,
        policy: HotPolicy,
        prefill_rotated: bool,
        schedule: Schedule | None = None,
        serve_stored: bool = False,
        state_budget: float | None = BUDGET,
        reserved_rows: tuple[int, ...] | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.spec, self.quant, self.store, self.pool = spec, quant, store, pool
        #: What the model thread's paths read (admit, load, restore): never a round trip.
        #: The rest (``_point``, ``cached``, admissions) read ``store`` off that thread.
        self.reads = store.local_tier()
        self.tokenizer, self.prefill_rotated = tokenizer, prefill_rotated
        #: Requests attend on the stored form (``kv.stored``): no working copies are made.
        self.serve_stored = serve_stored
        #: a hybrid's snapshot bytes over its K/V's (``states``)
        self.state_budget = state_budget
        #: Per layer, the working-copy rows the engine reserved (``kv.reserve``; None: none).
        self.reserved_rows = reserved_rows
        self.hot = HotAgents(policy, lambda: self.writes.saving_agents(), schedule, owner)
        #: the one reuse authority: every block known by chained hash (``prefix_index``)
        self.index = PrefixIndex(store.fingerprint, has=self._stored, hybrid=spec.hybrid, owner=owner)
        self.writes = CacheWrites(
            store=store,
            pool=pool,
            hot=self.hot,
            index=self.index,
            state_budget=state_budget,
            serve_stored=serve_stored,
        )
        # The write path's, for the restore (``restore.BlockSources``) and the steps.
        self.commit, self.held = self.writes.commit, self.writes.held
        self.queued_block, self.has_local = self.writes.queued_block, self.writes.has_local
        self.saving_agents = self.writes.saving_agents

    @property
    def fingerprint(self) -> str:
        return self.store.fingerprint

    @property
    def policy(self) -> HotPolicy:
        return self.hot.policy

    def new_layers(self) -> list[LayerCache]:
        return make_layer_caches(
            self.spec, self.quant, self.prefill_rotated, self.reserved_rows, self.serve_stored
        )

    # ------------------------------------------------------------------ a request's start

    def admit(self, agent_id: str, prompt: Prompt, lease: Lease | None = None) -> Admission:
        """The caches a request for ``prompt`` starts from, loaded, and what to prefill.
        ``lease``: the agent's, taken already (off this thread: ``admissions``)."""
        self.hot.schedule.started(agent_id)  # what was said of this turn is spent
        hot = self.hot.get(agent_id)
        # A shared store: take the agent's lease; another worker saved it since: reread.
        if lease is None:
            lease = take_lease(self.reads.replication, agent_id, hot.version if hot else None)
        if not lease.current and hot is not None:
            self.hot.drop(agent_id)
        with lease:  # given back if the admission fails
            start = self._admit(agent_id, prompt)
        start.lease = lease
        return start

    def _admit(self, agent_id: str, prompt: Prompt) -> Admission:
        state, source = self.lookup(agent_id)
        plan = self.index.plan(prompt, own_cache(state))
        if state is not None and plan.own:
            t0 = time.perf_counter()
            loaded = self.materialize(agent_id, state, plan)
            if loaded is not None:
                m, reused = plan.match, loaded.tokens
                known = TokenizedText(state.tokens.text, state.tokens.ids[:], state.tokens.ends[:])
                known.truncate(reused)
                if reused != m.reuse_tokens:  # back to a snapshot, or the store delivered part
                    m = PrefixMatch(MatchKind.DIVERGE, reused, len(known.text))
                if not prompt.text.startswith(known.text) or len(known.text) != m.reuse_chars:
                    raise RuntimeError("prefix bookkeeping out of step (this is a bug)")
                # NOTE: the tail is tokenized as text of its own, as it was when the cache was
                # matched by text: BPE reads the end of the stored text and the tail apart.
                tail = tokenize(self.tokenizer, prompt.text[len(known.text) :], add_special_tokens=False)
                source = CacheSource.WARM if loaded.from_disk else source
                load_s = time.perf_counter() - t0
                return Admission(
                    state=state, source=source, match=m, layers=loaded.layers, known=known,
                    tail=tail, load_s=load_s, prefix_blocks=state.blocks, prefetched=state.prefetched,
                )  # fmt: skip
            plan = self.index.plan(prompt, None)  # its own is unusable: what others stored
        return self.start_shared(state, prompt, plan)

    def lookup(self, agent_id: str) -> tuple[AgentState | None, CacheSource]:
        state = self.hot.touch(agent_id)
        if state is not None:
            return state, CacheSource.HOT
        record = self.read_record(agent_id, self.reads)
        if record is None:
            return None, CacheSource.COLD
        tokens = record_tokens(record)
        self.index.hold(agent_id, record.chain, record.token_ids)  # saved by another process, maybe
        # HOT until a block has to be read from disk (``materialize`` says so): blocks
        # still in the pool's memory tier serve a recorded agent without any I/O.
        version = seen_version(self.store.replication, agent_id)
        return AgentState(tokens, record.chain, None, version, record.state_blocks()), CacheSource.HOT

    def read_record(self, agent_id: str, via: StoreReads) -> AgentRecord | None:
        """The agent's record read ``via`` the store (off the model's thread) or its
        ``reads`` (on it); an unusable one is moved aside (None)."""
        try:
            return via.records.get(agent_id)
        except NewerFormatError:
            raise  # a newer version's cache: refuse rather than overwrite it
        except CacheFormatError as exc:
            # Moved aside (so this is said once), references kept: the next save reuses
            # the record's sound blocks and rewrites it.
            via.maintenance.quarantine_agent(agent_id)
            logger.warning(
                "agent %r: stored cache record unusable (%s); moved to quarantine/, falling back "
                "to prefill (sound blocks shared by content are still reused), the next save "
                "rewrites it",
                agent_id,
                exc,
            )
            return None

    def materialize(self, agent_id: str, state: AgentState, plan: ReusePlan) -> Loaded | None:
        """Layer caches holding the first ``plan.tokens`` of ``state`` (fewer if a shared
        store does not deliver every block in time: ``Loaded.tokens`` says how many); None
        if the stored cache is unusable (logged)."""
        n_tokens, snapshot = plan.tokens, plan.snapshot
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
                return Loaded(live, from_disk, n_tokens)
        try:
            try:
                return Loaded(*self.from_blocks(state.blocks, n_tokens, state=snapshot), n_tokens)
            except BlocksUnavailableError as exc:
                fewer = (
                    0 if self.spec.hybrid else available_prefix(self, state.blocks, state.tokens, n_tokens)
                )
                logger.warning(
                    "agent %r: %s; reusing the %d of %d cached tokens on this worker and prefilling the rest",
                    agent_id, exc, fewer, n_tokens,
                )  # fmt: skip
                return Loaded(*self.from_blocks(state.blocks, fewer), fewer) if fewer else None
        except BlocksUnavailableError:
            return None
        except CacheFormatError as exc:
            quarantined = self._quarantine_bad(state.blocks)
            aside = f"; {quarantined} bad block file(s) moved to quarantine/" if quarantined else ""
            logger.warning(
                "agent %r: stored cache unusable (%s)%s; falling back to prefill (sound blocks "
                "shared by content are still reused), the next save rewrites it",
                agent_id, exc, aside,
            )  # fmt: skip
            return None

    def _quarantine_bad(self, chain: list[BlockHash]) -> int:
        """Move every unreadable block of ``chain`` aside, the blocks its segments continue
        first (a segment of a damaged or missing block is unreadable too); return how many
        were moved."""
        moved = 0
        with self.reads.locked():
            for h in chain:
                for b in reversed(self._lineage(h)):
                    self.pool.forget(b)
                    try:
                        self.reads.blocks.get(b)
                    except (BlockMissingError, BlocksUnavailableError):
                        continue
                    except CacheFormatError:
                        moved += self.reads.blocks.quarantine(b) is not None
        return moved

    def _lineage(self, h: BlockHash) -> list[BlockHash]:
        """``h``, then the blocks of its earlier rows as far as their headers can be read."""
        out = [h]
        with contextlib.suppress(CacheFormatError, BlocksUnavailableError):
            while (prior := self.reads.blocks.prior_of(out[-1])) is not None and prior not in out:
                out.append(prior)
        return out

    def from_blocks(
        self,
        chain: list[BlockHash],
        n_tokens: int,
        only: Collection[int] | None = None,
        state: BlockHash | None = None,
    ) -> tuple[list[LayerCache], bool]:
        """Layer caches of the first ``n_tokens`` of ``chain`` (a hybrid model's recurrent
        layers from the snapshot block ``state``), and whether a block was read from disk
        (``restore.layers_from_blocks``). Layers built from the same blocks decode their
        working copies' stored part once between them (``DecodedPrefix``: a fan-out)."""
        layers, from_disk = layers_from_blocks(self, chain, n_tokens, only, state)
        if self.serve_stored:
            return layers, from_disk
        blocks = chain[: -(-n_tokens // BLOCK_TOKENS)]
        for i in range(len(layers)) if only is None else sorted(only):
            layer = layers[i]
            if not isinstance(layer, RecurrentCache):
                layer.work.share(self.index.decoded(blocks, n_tokens, i))
        return layers, from_disk

    def start_shared(self, state: AgentState | None, prompt: Prompt, plan: ReusePlan) -> Admission:
        """No usable cache of the agent's own: start from the blocks other agents stored that
        ``plan`` (the index's) keeps, else empty."""
        full = prompt.tokens
        if plan.tokens:
            t0 = time.perf_counter()
            try:
                layers, from_disk = self.from_blocks(list(plan.chain), plan.tokens, state=plan.snapshot)
            except (CacheFormatError, BlocksUnavailableError) as exc:
                logger.warning("shared blocks unusable (%s); prefilling from scratch", exc)
            else:
                known, tail = full.split(plan.tokens)
                source = CacheSource.WARM if from_disk else CacheSource.HOT
                load_s = time.perf_counter() - t0
                return Admission(
                    state=state, source=source, match=plan.match, layers=layers, known=known,
                    tail=tail, load_s=load_s, prefix_blocks=list(plan.chain),
                )  # fmt: skip
        return Admission(
            state=state, source=CacheSource.COLD, match=NOTHING, layers=self.new_layers(),
            known=TokenizedText(""), tail=full.split(0)[1], load_s=0.0, prefix_blocks=[],
        )  # fmt: skip

    def _stored(self, hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of ``hashes`` in memory or in this worker's store (the index's ``has`` on the
        loop: every one is asked, a hybrid's snapshots are sparse, so a missing one ends
        nothing)."""
        return {h for h in hashes if self.held(h) or self.reads.blocks.has(h)}

    def load_hot(self, agent_id: str) -> bool:
        """Build an agent's live caches from its blocks (a prefetch); False if it has no
        cache, is live already, or its cache is unusable."""
        live = self.hot.get(agent_id)
        if live is not None and live.layers is not None:
            return False
        state, _ = self.lookup(agent_id)
        plan = self.index.plan(None, own_cache(state))
        if state is None or not plan.own:
            return False
        loaded = self.materialize(agent_id, state, plan)
        if loaded is None or loaded.tokens != len(state.tokens):
            return False
        state.layers, state.prefetched = loaded.layers, loaded.from_disk
        # Loaded ahead of its turn: it does not push out an agent whose turn comes sooner.
        if not self.hot.keep(agent_id, state, unless_needed_sooner=True):
            return False
        dtype = getattr(mx, self.spec.dtype)
        for layer in loaded.layers:  # unpacked now, while its turn is not here yet
            if isinstance(layer, LayerCache):
                layer.unpack(dtype)
        return True

    # ------------------------------------------------------------------ administration (on the loop)

    def forget_agent(self, agent_id: str, outcome: WriteOutcome) -> None:
        """A fork, a restore or a delete rewrote ``agent_id``'s record (on the I/O side): its
        live copy, which stands for the old text, goes; the pool's tier follows the writes;
        the index takes the record there is now (read here: this worker's store)."""
        self.hot.drop(agent_id)
        self.pool.apply(outcome, admit=False)
        record = self.read_record(agent_id, self.reads)
        if record is None:
            self.index.drop(agent_id)
        else:
            self.index.hold(agent_id, record.chain, record.token_ids)

    def forget_evicted(self, report: EvictionReport) -> None:
        """The disk budget evicted agents (on the I/O side): forgotten in memory too (their
        next request prefills), their deleted blocks' memory copies with them."""
        for _, agent in report.evicted:
            self.hot.drop(agent)
            self.index.drop(agent)
        for h in report.deleted_blocks.get(self.fingerprint, ()):
            self.pool.forget(h)

    def live_tokens(self, agent_id: str) -> TokenizedText | None:
        """The text and tokens the agent's live copy stands for (None: not hot)."""
        state = self.hot.get(agent_id)
        return state.tokens if state is not None else None

    def drop_hot(self, agent_id: str | None = None) -> None:
        self.hot.drop(agent_id)

    def clear_memory(self) -> None:
        """Free every live cache and the pool's memory tier (what is stored stays)."""
        self.hot.drop()
        for h in self.pool.hot_hashes():
            self.pool.forget(h)

    def view(self, agent_id: str | None, prompt: Prompt | None = None) -> AgentView:
        """What a request's preparation off the loop may know of ``agent_id`` (None: of no
        agent: the blocks held only) and of the index on ``prompt``'s path. Its live copy's
        tokens and chain are never changed in place (a commit makes a new ``AgentState``),
        so the copy handed over is just that."""
        state = self.hot.get(agent_id) if agent_id is not None else None
        if state is not None:
            state = AgentState(state.tokens, state.blocks, None, state.version, dict(state.states))
        index = self.index.view(prompt) if prompt is not None else IndexView()
        return AgentView(state, state.version if state is not None else None, self.held_blocks(), index)

    def held_blocks(self) -> frozenset[BlockHash]:
        """The blocks in memory now (the pool's tier, the saves not written yet): what the
        admissions' threads take as held (``held``), read from this copy, not the loop's."""
        return frozenset(self.pool.hot_hashes()) | frozenset(self.writes.queued_hashes())

    def working_copy_bytes(self) -> int:
        return self.hot.working_copy_bytes()

    def memory_beside_the_tier(
        self, serving: Iterable[Sequence[LayerCache | RecurrentCache]]
    ) -> dict[str, int]:
        """What the caches hold in memory besides the hot tier and the pool: the layers of
        the requests in flight (``serving``) that no hot agent holds, and the blocks of saves
        not written yet. With the tier and the pool, what a leak would be told apart from."""
        tier = {id(layer) for state in self.hot.states() for layer in state.layers or ()}
        own = {id(layer): layer for layers in serving for layer in layers if id(layer) not in tier}
        return {"serving_bytes": layers_bytes(own.values()), "queued_save_bytes": self.writes.queued_bytes()}

    def hot_tier(self) -> dict[str, Any]:
        """The hot tier's bounds and state (``Engine.stats``)."""
        policy, schedule = self.hot.policy, self.hot.schedule
        return {
            "agents": len(self.hot), "bytes": self.hot.live_bytes(), "max_agents": policy.max_agents,
            "hot_bytes": policy.max_bytes, "tool_ttl_s": schedule.tool_ttl_s,
            "eviction": "schedule" if schedule.follow else "lru",
            "evictions": self.hot.evictions, "told": schedule.told(),
        }  # fmt: skip


def own_cache(state: AgentState | None) -> OwnCache | None:
    """What a plan sees of an agent's cache (None: it has none); a hybrid's live recurrent
    layers hold snapshots besides the stored ones."""
    if state is None:
        return None
    live = next((c for c in state.layers or () if isinstance(c, RecurrentCache)), None)
    held = live.held() if live is not None else ()
    return OwnCache(state.tokens, state.blocks, state.states, held)
