"""A process that saves, forks and deletes agent caches in a loop until it is killed.

``test_crash_safety.py`` starts it, waits for ``ready`` and SIGKILLs it at a random moment.
It goes through the same persistence code as the engine (``BlockWrites.save_agent`` /
``set_agent`` / ``delete_agent`` over ``DiskBlockStore``) with blocks of real layout (8
layers of 4-bit K/V, ~0.4 MB each; a block's tensors follow from its hash, as content
addressing requires), so nearly all of its time is spent saving. Half of its saves are a
hybrid model's: the record also names recurrent-state snapshots (``engine.states``), blocks
of their own written before the record.

Every operation is journaled before it starts (``intent``: what the agent will stand for
afterwards) and after it ends (``done``), so the killer knows, per agent, the old and the
possible new state.

    python crash_child.py ROOT JOURNAL SEED
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from langchain_agent_memory.engine.caches.states import snapshot_hash, state_block
from langchain_agent_memory.engine.kv import LayerSpec
from langchain_agent_memory.engine.ops.runtime import mx
from langchain_agent_memory.engine.storage.block_writes import BlockWrites
from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS, AgentRecord, Block, block_hash
from langchain_agent_memory.engine.storage.store import DiskBlockStore

FINGERPRINT = "crash-test"
AGENTS = [f"thread-{i}:agent" for i in range(6)]
MAX_TOKENS = 3000
LAYERS, HEADS, DIM = 8, 3, 64
#: A recurrent layer's state (a convolution window and a delta-rule matrix), in the snapshots.
RECURRENT = LayerSpec(0, 0, 0, None, (((3, 256), "float32"), ((4, 64, 64), "float32")))


def record_digest(record: AgentRecord | None) -> str | None:
    if record is None:
        return None
    payload = json.dumps([record.blocks, record.token_ids, record.token_ends, record.text, record.states])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def block_for(h: str, parent: str | None, token_ids: list[int]) -> Block:
    key = mx.random.key(int(h[:8], 16))
    n = len(token_ids)
    tensors = {}
    for layer in range(LAYERS):
        for kv in "kv":
            key, sub = mx.random.split(key)
            tensors[f"L{layer}.{kv}.q"] = mx.random.randint(
                0, 2**31, (1, HEADS, n, DIM // 8), key=sub
            ).astype(mx.uint32)
            tensors[f"L{layer}.{kv}.scales"] = mx.ones((1, HEADS, n, 1), dtype=mx.float16)
            tensors[f"L{layer}.{kv}.biases"] = mx.zeros((1, HEADS, n, 1), dtype=mx.float16)
    return Block(h, parent, token_ids, tensors)  # type: ignore[arg-type]


def snapshot_for(chain: list[str], n: int, at: int) -> Block:
    """The state snapshot after ``at`` of ``n`` tokens (its arrays follow from its name)."""
    key = mx.random.key(int(snapshot_hash(chain, n, at, FINGERPRINT)[:8], 16))  # type: ignore[arg-type]
    state = tuple(mx.random.normal((1, *shape), key=key) for shape, _ in RECURRENT.state or ())
    return state_block(chain, n, at, FINGERPRINT, [RECURRENT], [state])  # type: ignore[arg-type]


def chain_of(token_ids: list[int]) -> list[str]:
    chain: list[str] = []
    for a in range(0, len(token_ids), BLOCK_TOKENS):
        chain.append(block_hash(chain[-1] if chain else None, token_ids[a : a + BLOCK_TOKENS], FINGERPRINT))
    return chain


def main(root: str, journal_path: str, seed: int) -> None:
    store = DiskBlockStore(root, FINGERPRINT)
    pool = BlockWrites(store)
    rng = random.Random(seed)
    journal = Path(journal_path).open("a")  # noqa: SIM115 (open until the kill)

    def log(**entry: object) -> None:
        journal.write(json.dumps(entry) + "\n")
        journal.flush()  # in the kernel's page cache: a SIGKILL cannot lose it

    print("ready", flush=True)
    seq = 0
    while True:
        seq += 1
        agent = rng.choice(AGENTS)
        current = store.records.get(agent)
        roll = rng.random()
        if roll < 0.1:
            log(seq=seq, agent=agent, intent=None)
            pool.delete_agent(agent)
        elif roll < 0.2:
            source = store.records.get(rng.choice(AGENTS))
            if source is None:
                continue
            fork = AgentRecord(
                agent, source.blocks, source.token_ids, source.token_ends, source.text, states=source.states
            )
            log(seq=seq, agent=agent, intent=record_digest(fork))
            pool.set_agent(fork)
        else:
            tokens = list(current.token_ids) if current is not None and rng.random() < 0.85 else []
            if tokens and rng.random() < 0.2:
                tokens = tokens[: rng.randrange(len(tokens))]  # a diverging turn
            if len(tokens) > MAX_TOKENS:
                tokens = []
            tokens += [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 400))]
            chain = chain_of(tokens)
            n = len(tokens)
            states = sorted({p for p in range(BLOCK_TOKENS, n, BLOCK_TOKENS) if rng.random() < 0.5} | {n})
            states = states if rng.random() < 0.5 else []  # half of the saves: a hybrid's
            snaps = [snapshot_hash(chain, n, p, FINGERPRINT) for p in states]
            ends = list(range(1, n + 1))
            record = AgentRecord(agent, chain + snaps, tokens, ends, "t" * n, states=states)  # type: ignore[arg-type]

            def build(
                i: int, chain: list[str] = chain, tokens: list[int] = tokens, states: list[int] = states
            ) -> Block:
                if i >= len(chain):
                    return snapshot_for(chain, len(tokens), states[i - len(chain)])
                return block_for(
                    chain[i], chain[i - 1] if i else None, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
                )

            log(seq=seq, agent=agent, intent=record_digest(record))
            pool.save_agent(record, build, current.blocks if current else [])  # type: ignore[arg-type]
        log(seq=seq, done=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
