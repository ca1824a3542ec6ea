"""Restore bandwidth: an agent's blocks read back (verified, as arrays) against the physical
floors of the same files: ``cat`` to /dev/null from the page cache, and a cold read (the
files dropped from the page cache first with ``posix_fadvise(DONTNEED)``).

    .venv/bin/python benchmarks/restore.py [--tokens 2048 8192 32768] [--repeats 3]

The blocks are an 8B-class model's KV at the default 4-bit-class format (32 layers, 8 KV
heads of 128: packed 4-bit keys and values with fp16 scales, 256-token blocks) written by
the store itself (``BlockFiles.put``) with random contents: the bytes and the
file layout are a real agent's, the values are not (a restore's speed does not depend on
them). Each size is restored three ways, side by side in one run (this machine is shared:
the ratios are what counts):

- ``XXH3``: blocks as written now, checked by their XXH3-128 digests;
- ``SHA-256``: the same blocks with the XXH3 fields taken out of their headers (blocks
  written before they were added): checked by SHA-256;
- ``to tensors``: the whole restore, every layer's tensors made from the blocks read (what
  the layer caches take; the ``XXH3`` row stops at the blocks' bytes in memory);
- the floors: ``cat`` (page cache, into one small buffer used over and over), ``fresh read``
  (the files read into one new buffer of their size: the page faults any restore into new
  memory pays, ~2-3 GB/s on this VM) and a cold ``cat`` of the same files.

Writes results/restore.json and results/restore.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
LAYERS, KV_HEADS, HEAD_DIM, GROUP = 32, 8, 128, 64
FP = "restore-bench"


def _blocks(n_tokens: int, seed: int) -> list[Any]:
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.engine.storage.blocks import BLOCK_TOKENS, Block, block_hash

    mx.random.seed(seed)
    out, parent = [], None
    for b in range(n_tokens // BLOCK_TOKENS):
        tokens = [seed * 7 + b * BLOCK_TOKENS + i for i in range(BLOCK_TOKENS)]
        shape = (1, KV_HEADS, BLOCK_TOKENS)
        tensors = {}
        for layer in range(LAYERS):
            for kv in ("k", "v"):
                tensors[f"L{layer}.{kv}.q"] = mx.random.randint(0, 2**31, (*shape, HEAD_DIM // 8)).astype(
                    mx.uint32
                )
                tensors[f"L{layer}.{kv}.scales"] = mx.random.normal((*shape, HEAD_DIM // GROUP)).astype(
                    mx.float16
                )
                tensors[f"L{layer}.{kv}.biases"] = mx.random.normal((*shape, HEAD_DIM // GROUP)).astype(
                    mx.float16
                )
        h = block_hash(parent, tokens, FP)
        out.append(Block(h, parent, tokens, tensors))
        parent = h
    return out


def _strip_fast_digests(path: Path) -> None:
    """Rewrite a block file's header without its XXH3 fields (a block of an older writer)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for field in ("xxh3", "part_xxh3"):
        header["__metadata__"].pop(field, None)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _drop_from_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cat(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def _restore(store: Any, hashes: list[Any]) -> float:
    from langchain_agent_memory.engine.ops.runtime import mx

    t0 = time.perf_counter()
    groups = store.blocks.read(hashes)
    mx.eval([g.blob for g in groups])
    return time.perf_counter() - t0


def _to_tensors(store: Any, hashes: list[Any]) -> float:
    """A whole restore: the blocks read and verified, then every layer's tensors as the
    layer caches take them (the blocks' rows concatenated along the tokens)."""
    from langchain_agent_memory.engine.ops.runtime import mx

    t0 = time.perf_counter()
    groups = store.blocks.read(hashes)
    mx.eval([g.tensor(name) for g in groups for name in g.names()])
    return time.perf_counter() - t0


def _fresh_read(paths: list[Path]) -> float:
    """The files read into one fresh host buffer of their size (no checks, no arrays): what
    any restore into new memory pays, the kernel's page faults included."""
    import numpy as np

    t0 = time.perf_counter()
    buf = np.empty(sum(p.stat().st_size for p in paths), np.uint8)
    view, at = memoryview(buf), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            at += f.readinto(view[at:])  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def run(tokens: list[int], repeats: int, console: Console) -> dict[str, Any]:
    from langchain_agent_memory.engine.storage.store import DiskBlockStore

    rows = []
    with tempfile.TemporaryDirectory(prefix="restore-bench-", dir=os.environ.get("BENCH_DIR")) as tmp:
        for n in tokens:
            console.print(f"[dim]{n} tokens: writing the blocks…[/dim]")
            fast = DiskBlockStore(Path(tmp) / f"fast-{n}", FP)
            sha = DiskBlockStore(Path(tmp) / f"sha-{n}", FP)
            blocks = _blocks(n, seed=n)
            for blk in blocks:
                fast.blocks.put(blk)
                sha.blocks.put(blk)
            hashes = [b.hash for b in blocks]
            del blocks
            for h in hashes:
                _strip_fast_digests(sha.blocks.path(h))
            paths = {
                "xxh3": [fast.blocks.path(h) for h in hashes],
                "sha": [sha.blocks.path(h) for h in hashes],
            }
            nbytes = sum(p.stat().st_size for p in paths["xxh3"])
            keys = ("xxh3", "sha", "cat", "fresh read", "to tensors", "cold cat", "cold xxh3")
            times: dict[str, list[float]] = {k: [] for k in keys}
            for r in range(repeats):
                console.print(f"[dim]{n} tokens: repeat {r + 1} of {repeats}[/dim]")
                _cat(paths["xxh3"] + paths["sha"])  # both in the page cache
                times["xxh3"].append(_restore(fast, hashes))
                times["sha"].append(_restore(sha, hashes))
                times["cat"].append(_cat(paths["xxh3"]))
                times["fresh read"].append(_fresh_read(paths["xxh3"]))
                times["to tensors"].append(_to_tensors(fast, hashes))
                _drop_from_page_cache(paths["xxh3"])
                times["cold cat"].append(_cat(paths["xxh3"]))
                _drop_from_page_cache(paths["xxh3"])
                times["cold xxh3"].append(_restore(fast, hashes))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({
                "tokens": n, "bytes": nbytes, "blocks": len(hashes),
                "seconds": med, "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
                "xxh3_over_cat": med["xxh3"] / med["cat"], "sha_over_cat": med["sha"] / med["cat"],
                "xxh3_over_fresh_read": med["xxh3"] / med["fresh read"],
                "cold_xxh3_over_cold_cat": med["cold xxh3"] / med["cold cat"],
            })  # fmt: skip
            fast.close()
            sha.close()
    return {"rows": rows, "repeats": repeats, "cpus": os.cpu_count(), "shape": [LAYERS, KV_HEADS, HEAD_DIM]}


def _table(data: dict[str, Any]) -> Table:
    t = Table(title="restore bandwidth (GB/s; median of repeats) and time over the page-cache floor")
    columns = ("tokens", "MB", "XXH3", "SHA-256", "to tensors", "cat", "fresh read", "cold XXH3", "cold cat")
    for c in (*columns, "XXH3/cat", "XXH3/fresh", "SHA/cat"):
        t.add_column(c, justify="right")
    for r in data["rows"]:
        g = r["gb_per_s"]
        keys = ("xxh3", "sha", "to tensors", "cat", "fresh read", "cold xxh3", "cold cat")
        speeds = [f"{g[k]:.2f}" for k in keys]
        ratios = [
            f"{r['xxh3_over_cat']:.2f}×",
            f"{r['xxh3_over_fresh_read']:.2f}×",
            f"{r['sha_over_cat']:.2f}×",
        ]
        t.add_row(str(r["tokens"]), f"{r['bytes'] / 1e6:.0f}", *speeds, *ratios)
    return t


def _plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["tokens"] for r in data["rows"]]
    lines = (
        ("xxh3", "restore, XXH3"), ("sha", "restore, SHA-256"), ("to tensors", "restore to layer tensors"),
        ("cat", "cat (page cache)"), ("fresh read", "read into fresh memory"),
        ("cold xxh3", "restore cold, XXH3"), ("cold cat", "cat (cold)"),
    )  # fmt: skip
    for key, label in lines:
        ax.plot(xs, [r["gb_per_s"][key] for r in data["rows"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("agent context (tokens)")
    ax.set_ylabel("GB/s")
    ax.set_title("Restore bandwidth vs the page-cache and cold-read floors (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "restore.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    console = Console()
    data = run(args.tokens, args.repeats, console)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restore.json").write_text(json.dumps(data, indent=1) + "\n")
    _plot(data, args.out)
    console.print(_table(data))
    console.print(f"wrote {args.out / 'restore.json'} and restore.png")


if __name__ == "__main__":
    main()
