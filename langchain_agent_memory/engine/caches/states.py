"""Recurrent-state snapshots of a hybrid model's agents: which to keep, their blocks, and
where a request can resume.

A snapshot is the state of every recurrent layer at one position of the agent's tokens: a
block boundary a prefill passed, or the token before the end of a turn (an EXTEND then
re-runs one token, an EXACT none, and the turn's last token can be re-run for its logits).
It is stored as a block of its own (``state_block_hash``: a function of the chain block
holding its last token, so agents with the same tokens share it, and stores write, count and
collect it as any block), named by the agent record after its chain (``AgentRecord.states``).

Why a policy: one snapshot of a large hybrid is tens of megabytes (Qwen3-Next-80B: 36
delta-rule layers x 32 heads x 128 x 128 in float32, the dtype mlx-lm keeps them in =
75.5 MB), against ~2 MB of its attention layers' K/V per 256-token block in the default
format. Every block's would be ~35x the K/V; the
policy keeps every snapshot within ``DENSE`` blocks of the end (a request that parts from
the stored text a little before its end re-runs at most one block), then one near every
doubling of the distance from the end (a DIVERGE far back re-runs at most about as much as
it keeps), and always the newest (the end of the turn); and no more of them than take
``BUDGET`` times the bytes of the agent's K/V (``snapshot_limit``): the newest, then the
doublings nearest the end first, then the rest. On the Qwen3-Next-80B shape at 32K that
is 3 of the 10 (an agent then takes 1.8x its K/V on disk, where all 10 took 3.8x), and a
DIVERGE 1K tokens back still resumes 123 tokens before its point
(``benchmarks/hybrid.py`` measures the policies' cost curves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from ..kv import LayerSpec, RecurrentCache
from ..kv.recurrent import State, state_tensors
from ..ops.runtime import mx
from ..prefix import NOT_A_BOUNDARY, TokenizedText
from ..storage.blocks import BLOCK_TOKENS, STATE_TOKEN, Block, BlockHash, state_block_hash
from .agent_state import Admission

#: Snapshots kept without thinning: those within this many blocks of the end.
DENSE = 4

#: An agent's snapshots take at most this many times the bytes of its attention layers'
#: K/V in the stored format, beyond ``FLOOR`` of them: with 1.0 a hybrid agent takes at
#: most twice what its K/V alone would, once its K/V outweighs ``FLOOR`` snapshots.
BUDGET = 1.0

#: Snapshots an agent keeps whatever they weigh: the end of its turn and the newest one at
#: least ``DENSE`` blocks before it (an EXTEND, and a DIVERGE a few turns back, stay warm on
#: a short agent, whose K/V weighs less than one snapshot of a large hybrid).
FLOOR = 2


def keep(
    candidates: Collection[int],
    n_tokens: int,
    dense: int = DENSE,
    also: Collection[int] = (),
    limit: int | None = None,
) -> list[int]:
    """The positions (of ``candidates``: snapshots stored or held) an agent of ``n_tokens``
    keeps, ascending: the newest (the end of its turn), the newest in each block within
    ``dense`` blocks of the end (an agent of many short turns keeps one per block, not two
    per turn), then the newest at or before ``n_tokens - dense * 256 * 2**k`` for each k;
    and ``also`` (the prompt's end of the last turn: a regenerated reply resumes there).
    At most ``limit`` of them (``snapshot_limit``), chosen in that order of worth: the
    newest, the doublings from the nearest, ``also``, then the recent blocks from the
    newest. ``benchmarks/hybrid.py`` measures other ``dense`` values and limits."""
    have = sorted(p for p in candidates if 0 < p <= n_tokens)
    if not have:
        return []
    recent = {(p - 1) // BLOCK_TOKENS: p for p in have if p >= n_tokens - dense * BLOCK_TOKENS}
    ladder = []
    k = 0
    while True:
        target = n_tokens - dense * BLOCK_TOKENS * (1 << k)
        if target < have[0]:
            break
        ladder.append(max(p for p in have if p <= target))
        k += 1
    ranked = [have[-1], *ladder, *sorted((p for p in also if p in have), reverse=True)]
    ranked += sorted(recent.values(), reverse=True)
    kept = list(dict.fromkeys(ranked))  # first rank of each position, in rank order
    return sorted(kept if limit is None else kept[: max(1, limit)])


def snapshot_limit(layers: Sequence[object], n_tokens: int, budget: float | None = BUDGET) -> int | None:
    """How many snapshots an agent of ``n_tokens`` over these layer caches may keep: as many
    as ``budget`` times its attention layers' stored K/V bytes hold, and at least ``FLOOR``
    (None: no bound, or no attention layer to weigh them against)."""
    kv = snap = 0
    for c in layers:
        if isinstance(c, RecurrentCache):
            assert c.spec.state is not None
            snap += sum(math.prod(shape) * getattr(mx, dtype).size for shape, dtype in c.spec.state)
        else:
            spec, quant = c.spec, c.quant  # type: ignore[attr-defined]
            per_head = quant.keys.row_bytes(spec.k_head_dim) + quant.values.row_bytes(spec.v_head_dim)
            kv += spec.kv_heads * per_head * n_tokens
    if budget is None or not kv or not snap:
        return None
    return max(FLOOR, int(budget * kv // snap))


def _where(n_tokens: int, at: int) -> tuple[int, int]:
    """(chain index of the block holding token ``at - 1``, tokens from ``at`` to its end)."""
    i = (at - 1) // BLOCK_TOKENS
    return i, min((i + 1) * BLOCK_TOKENS, n_tokens) - at


def snapshot_hash(chain: Sequence[BlockHash], n_tokens: int, at: int, fingerprint: str) -> BlockHash:
    """The block name of the state after ``at`` tokens of an agent whose chain of ``n_tokens``
    is ``chain`` (``state_block_hash`` of the chain block holding token ``at - 1``)."""
    i, before_end = _where(n_tokens, at)
    return state_block_hash(chain[i], fingerprint, before_end)


def state_block(
    chain: Sequence[BlockHash],
    n_tokens: int,
    at: int,
    fingerprint: str,
    specs: Sequence[LayerSpec],
    states: Sequence[State | None],
) -> Block:
    """The block of the recurrent layers' ``states`` after ``at`` tokens (one per layer;
    None for attention layers), named by ``snapshot_hash``."""
    tensors = {}
    for j, (spec, state) in enumerate(zip(specs, states, strict=True)):
        if spec.recurrent:
            assert state is not None
            tensors.update(state_tensors(j, state))
    i, before_end = _where(n_tokens, at)
    h = snapshot_hash(chain, n_tokens, at, fingerprint)
    return Block(h, chain[i], [STATE_TOKEN - before_end], tensors)


def resume_point(tokens: TokenizedText, n_tokens: int, snapshots: Collection[int]) -> int:
    """The furthest position ``<= n_tokens`` a request can resume from: one with a snapshot
    (token positions) that ends on a whole character (0: from the start)."""
    for p in sorted(snapshots, reverse=True):
        if 0 < p <= n_tokens and tokens.ends[p - 1] != NOT_A_BOUNDARY:
            return p
    return 0


def commit_snapshots(
    start: Admission,
    chain: list[BlockHash],
    known: TokenizedText,
    fingerprint: str,
    has_local: Callable[[BlockHash], bool],
    budget: float | None = BUDGET,
) -> tuple[dict[int, BlockHash], dict[BlockHash, Block], bool]:
    """A hybrid's commit: the snapshots its record keeps (position -> block, ascending;
    ``keep``) of those the request holds (block boundaries its prefill passed, the prompt's
    end, the token before the end) and those stored before it that it kept (``budget``:
    ``snapshot_limit``); the blocks of the new ones the store lacks (``has_local``); and
    whether the live recurrent layers stand at the end of ``known`` (not past it: a stop
    sequence cut the reply). Nothing for a model without recurrent layers."""
    n = len(known)
    layers = start.layers
    first = next((c for c in layers if isinstance(c, RecurrentCache)), None)
    if first is None:
        return {}, {}, True
    prompt_end = start.reused + len(start.tail)
    # One that ends inside a character is never a resume point (``resume_point``): kept, it
    # would only take the place of one that is (a random-weight reply of partial characters
    # left a 32K agent's EXACT 1,027 tokens to re-run).
    new = {
        p
        for p in first.held()
        if 0 < p <= n
        and (p % BLOCK_TOKENS == 0 or p in (n - 1, prompt_end))
        and known.ends[p - 1] != NOT_A_BOUNDARY
    }
    old = start.state.states if start.state is not None else {}
    stored = {p: h for p, h in old.items() if p <= start.reused}
    out: dict[int, BlockHash] = {}
    blocks: dict[BlockHash, Block] = {}
    specs = [c.spec for c in layers]
    for p in keep(new | set(stored), n, also=[prompt_end], limit=snapshot_limit(layers, n, budget)):
        if p in stored:
            out[p] = stored[p]
            continue
        h = out[p] = snapshot_hash(chain, n, p, fingerprint)
        if not has_local(h):
            per_layer = [c.state_at(p) if isinstance(c, RecurrentCache) else None for c in layers]
            blocks[h] = state_block(chain, n, p, fingerprint, specs, per_layer)
    return out, blocks, first.offset == n


def thin_held(start: Admission, pinned: Collection[int] = (), budget: float | None = BUDGET) -> None:
    """Drop the snapshots a request in prefill holds that its commit would not keep (``keep``
    at the prompt's end; the reply moves the end by a few tokens), except ``pinned`` ones
    (a fork's point): a 32K prefill passes 128 block boundaries, 9.9 GB of snapshots of a
    Qwen3-Next-80B shape, where about a dozen stay."""
    recurrent = [c for c in start.layers if isinstance(c, RecurrentCache)]
    if not recurrent:
        return
    end = start.reused + len(start.tail)
    held = set(recurrent[0].snapshots)
    stored = {p for p in (start.state.states if start.state is not None else ()) if p <= start.reused}
    limit = snapshot_limit(start.layers, end, budget)
    wanted = set(keep(held | stored, end, also=[end], limit=limit)) | set(pinned)
    for c in recurrent:
        for p in held - wanted:
            del c.snapshots[p]
