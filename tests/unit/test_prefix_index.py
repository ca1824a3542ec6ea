"""The prefix index, without a model: what a prompt starts from among stored chains (whole
blocks, then a next block's leading tokens), what requests in flight share, its view off
the loop, and its bookkeeping as agents come and go."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest

from langchain_agent_memory.engine.caches.prefix_index import (
    MIN_CONTINUATION,
    OwnCache,
    PrefixIndex,
    Prompt,
    longest_prefix,
)
from langchain_agent_memory.engine.ops.owner import CHECK_OWNER, OwnerError
from langchain_agent_memory.engine.prefix import NOT_A_BOUNDARY, MatchKind, TokenizedText
from langchain_agent_memory.engine.requests.worker import Worker
from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS, BlockHash, chain_hashes, prompt_hashes

FP = "fp"


def _text(ids: Sequence[int], split: Sequence[int] = ()) -> TokenizedText:
    """One character per token; the tokens at ``split`` end inside a character."""
    ends = [NOT_A_BOUNDARY if i in split else i + 1 for i in range(len(ids))]
    return TokenizedText("x" * len(ids), list(ids), ends)


def _prompt(ids: Sequence[int], split: Sequence[int] = ()) -> Prompt:
    return Prompt(_text(ids, split), tuple(prompt_hashes(ids, FP)))


def _index(stored: dict[str, list[int]]) -> PrefixIndex:
    index = PrefixIndex(FP, has=lambda hashes: set(hashes), hybrid=False)
    index.fill((agent, list(chain_hashes(ids, FP)), ids) for agent, ids in stored.items())
    return index


SESSION = list(range(600))  # instructions of 584 tokens, then the session's own text


def _other_session(common: int, n: int = 700) -> list[int]:
    return SESSION[:common] + [10_000 + i for i in range(n - common)]


def test_a_stored_next_block_gives_its_leading_tokens() -> None:
    index = _index({"a": SESSION})
    plan = index.plan(_prompt(_other_session(584)), None)
    a = list(chain_hashes(SESSION, FP))
    assert plan.match.kind is MatchKind.SHARED
    assert (plan.tokens, list(plan.chain)) == (584, a[:3])
    assert plan.blocks() == a[:3]


def test_too_few_leading_tokens_are_not_worth_a_read() -> None:
    index = _index({"a": SESSION})
    plan = index.plan(_prompt(_other_session(512 + MIN_CONTINUATION - 1)), None)
    assert plan.tokens == 512 and len(plan.chain) == 2
    assert index.plan(_prompt(_other_session(512 + MIN_CONTINUATION)), None).tokens == 512 + MIN_CONTINUATION


def test_leading_tokens_end_on_a_whole_character_short_of_the_last_token() -> None:
    index = _index({"a": SESSION})
    # the common run ends with two tokens of one split character: it backs off past them
    plan = index.plan(_prompt(_other_session(560), split=[558, 559]), None)
    assert plan.tokens == 558
    # the prompt is all of a's first 560 tokens: its last one is run for its logits
    assert index.plan(_prompt(SESSION[:560]), None).tokens == 559


def test_nothing_past_the_whole_blocks_that_are_stored() -> None:
    a = list(chain_hashes(SESSION, FP))
    index = PrefixIndex(FP, has=lambda hashes: {h for h in hashes if h != a[0]}, hybrid=False)
    index.fill([("a", a, SESSION)])
    plan = index.plan(_prompt(_other_session(584)), None)
    assert (plan.match.kind, plan.tokens) == (MatchKind.MISS, 0)
    # a next block whose file is gone is not read either
    index = PrefixIndex(FP, has=lambda hashes: {h for h in hashes if h != a[2]}, hybrid=False)
    index.fill([("a", a, SESSION)])
    assert index.plan(_prompt(_other_session(584)), None).tokens == 512


def test_the_agents_own_cache_comes_first() -> None:
    index = _index({"a": SESSION})
    own_ids = _other_session(300, 400)
    own = OwnCache(_text(own_ids), list(chain_hashes(own_ids, FP)))
    prompt = _prompt([*own_ids, 7, 7])
    plan = index.plan(prompt, own)
    assert (plan.match.kind, plan.tokens, plan.own) == (MatchKind.EXTEND, 400, True)
    assert index.plan(None, own).tokens == 400  # a prefetch: the whole of it


def test_the_view_off_the_loop_answers_as_the_index_does() -> None:
    index = _index({"a": SESSION, "b": _other_session(300)})
    for common in (100, 300, 520, 584):
        prompt = _prompt(_other_session(common, 800))
        view = index.view(prompt)
        off = longest_prefix(
            prompt, None, has=index.has, next_blocks=view.next_blocks, fingerprint=FP, hybrid=False
        )
        assert off == index.plan(prompt, None), common


def test_dropped_agents_leave_nothing_behind() -> None:
    index = _index({"a": SESSION, "b": _other_session(300)})
    assert len(index) == 3 + 2  # a's three blocks; b's second and third (its first is a's)
    index.drop("a")
    assert len(index) == 3
    a = list(chain_hashes(SESSION, FP))
    b = list(chain_hashes(_other_session(300), FP))
    assert [h for h, _ in index.next_blocks(a[0])] == [b[1]]  # b's next block, a's gone
    index.hold("b", list(chain_hashes(SESSION, FP)), SESSION)  # b's next turn: a's tokens
    assert len(index) == 3
    index.drop("b")
    assert len(index) == 0 and index.stats() == {"blocks": 0, "agents": 0, "in_flight": 0}


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_in_flight_the_longest_shared_prefix_wins() -> None:
    """Against the oracle: the longest common prefix with any prompt in flight."""
    rng = random.Random(7)
    index = PrefixIndex(FP, has=lambda hashes: set(), hybrid=False)
    flying: dict[int, tuple[object, list[int]]] = {}
    base = [rng.randrange(5) for _ in range(900)]
    for step in range(80):
        ids = base[: rng.randrange(1, 900)] + [rng.randrange(5) for _ in range(rng.randrange(300))]
        found = index.inflight_source(ids)
        best = max((_common(ids, other) for _, other in flying.values()), default=0)
        if best == 0:
            assert found is None, step
        else:
            assert found is not None and found[1] == best, (step, found, best)
            assert _common(ids, flying[id(found[0])][1]) == best
        request = object()
        flying[id(request)] = (request, ids)
        index.fly(request, ids)
        if rng.random() < 0.3:
            gone, _ = flying.pop(rng.choice(list(flying)))
            index.land(gone)
    for request, _ in list(flying.values()):
        index.land(request)
    assert len(index) == 0


@pytest.mark.skipif(not CHECK_OWNER, reason="the owner check is off (AGENT_MEMORY_OWNER_CHECK)")
def test_only_the_loop_changes_the_index() -> None:
    loop = Worker("test-index-loop")
    try:
        index = loop.submit(
            lambda: PrefixIndex(FP, has=lambda hashes: set(), hybrid=False, owner=loop.owner)
        ).result()
        chain: list[BlockHash] = list(chain_hashes(SESSION, FP))
        loop.submit(index.hold, "a", chain, SESSION).result()
        raised: list[BaseException] = []

        def helper() -> None:
            try:
                index.drop("a")
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=helper, name="helper")
        thread.start()
        thread.join()
        assert raised and isinstance(raised[0], OwnerError) and "PrefixIndex.drop" in str(raised[0])
        assert len(index) == -(-len(SESSION) // BLOCK_TOKENS)
    finally:
        loop.stop()
