"""What a user's SSD pays per conversation turn: the bytes each turn's save writes (its new
tokens' rows: new blocks, a segment of the last, partly filled block's rows since the whole
prefix it continues, or that block whole: earlier rows again, ``rewritten``), and
everything the process wrote (``/proc/self/io``'s ``write_bytes``: block files, the index
and its journal), against the new tokens' K/V at the default format (the floor: what any
store of them must write) and against rewriting the agent's whole cache each turn (what
the reference system did).

    .venv/bin/python benchmarks/turn_writes.py [--turns 50] [--kv-bits 4] [--answer-tokens 32]
        [--restore-at 50 200]

One agent on the default model, a ~1.2K-token system prompt (Python reference manual),
short questions, answers of up to 32 tokens (200 turns of them pass the model's 8K context:
``--answer-tokens 12``); each turn's save waited for before the next. After the
turns of ``--restore-at`` (and the last), what the way it was written costs a restore: a
fresh engine's warm load of the agent against the same text stored whole (written in one
turn), side by side, median of 3. Writes benchmarks/results/turn_writes.json and .png
(``--out NAME``: NAME.json and NAME.png).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUESTIONS = [
    "What does the for statement do?",
    "What is an iterable?",
    "Can a for loop have an else clause?",
    "What does break do?",
    "What does continue do?",
    "What is the range function for?",
    "How do I loop over a dict?",
    "How do I loop with an index?",
    "What is a while loop?",
    "What happens when an exception is raised in a loop?",
]


def _restores(eng: Any, tmp: str, kv_bits: int, repeats: int = 3) -> dict[str, Any]:
    """What the way the agent was written costs a restore: a fresh engine's warm load of it
    (its blocks written turn by turn) against the same text written in one turn (whole
    blocks, in a directory of its own), side by side, median of ``repeats``. Each load is
    of a fork (``probe``, deleted after): its save leaves the agent as the turns left it."""
    import shutil
    import statistics

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    text = eng.admin.cached_text("agent")
    one = GenerationParams(max_tokens=1)
    whole_dir = tempfile.mkdtemp(prefix="turn-writes-whole-")
    writer = Engine(cache_dir=whole_dir, kv_bits=kv_bits)
    writer.generate("agent", text, one).wait_saved()
    times: dict[str, list[float]] = {"turns": [], "whole": []}
    for _ in range(repeats):
        for kind, owner, where in (("turns", eng, tmp), ("whole", writer, whole_dir)):
            owner.admin.fork("agent", "probe")
            fresh = Engine(cache_dir=where, kv_bits=kv_bits)
            r = fresh.generate("probe", fresh.admin.cached_text("probe") + " ok", one)
            assert str(r.outcome).startswith("warm"), r.outcome
            times[kind].append(r.timings.load_s)
            fresh.close()
            owner.admin.delete("probe")
    writer.close()
    shutil.rmtree(whole_dir, ignore_errors=True)
    record = eng.admin.store.records.get("agent")
    assert record is not None
    turns_s, whole_s = statistics.median(times["turns"]), statistics.median(times["whole"])
    return {
        "cached_tokens": len(record.token_ids),
        "restore_turns_s": turns_s,
        "restore_whole_s": whole_s,
        "restore_ratio": turns_s / whole_s,
        "chain_blocks": len(record.chain),
        "segment_parts": len(record.priors),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--kv-bits", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--out", default="turn_writes", help="results/OUT.json and .png")
    ap.add_argument("--restore-at", type=int, nargs="*", default=[50], help="and after the last turn")
    a = ap.parse_args()

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from langchain_agent_memory import corpus
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    console = Console()
    rows, restores = [], []
    with tempfile.TemporaryDirectory() as tmp:
        eng = Engine(cache_dir=tmp, kv_bits=a.kv_bits)
        system = "Answer briefly using this text.\n\n" + corpus.python_docs_topic("for") * 2
        messages = [{"role": "system", "content": system}]
        cached_before, per_token = 0, 0.0
        for turn in track(range(a.turns), description="turns", console=console):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            prompt = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            io_before = _written()
            r = eng.generate("agent", prompt, GenerationParams(max_tokens=a.answer_tokens))
            r.wait_saved()
            io_bytes = _written() - io_before
            messages.append({"role": "assistant", "content": r.text})
            files = list(Path(tmp).rglob("blocks/*/*.safetensors"))
            record = eng.admin.store.records.get("agent")
            assert record is not None
            whole = sum(eng.admin.store.blocks.path(h).stat().st_size for h in record.blocks)
            if not per_token and len(record.token_ids) >= 256:  # one whole block's tensors: the format's rate
                per_token = _block_tensor_bytes(eng, record.blocks[0]) / 256
            new_tokens = len(record.token_ids) - cached_before
            floor = round(new_tokens * per_token)
            cached_before = len(record.token_ids)
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": r.prompt_tokens,
                    "reused_tokens": r.reused_tokens,
                    "cached_tokens": len(record.token_ids),
                    "new_tokens": new_tokens,
                    "new_tokens_kv_bytes": floor,
                    # earlier rows written again: a segment's since its prefix, a block whole
                    "rewritten_kv_bytes": max(0, r.bytes_written - floor) if turn else 0,
                    "bytes_written": r.bytes_written,
                    "process_bytes_written": io_bytes,
                    "whole_cache_bytes": whole,
                    "block_files": len(files),
                    "outcome": str(r.outcome),
                    "segment_parts": len(record.priors),
                    "last_block_files": _files(eng, record.chain[-1]),
                }
            )
            if turn + 1 in a.restore_at or turn + 1 == a.turns:
                restores.append({"turns": turn + 1, **_restores(eng, tmp, a.kv_bits)})
                console.print(restores[-1])
        eng.close()
    table = Table(title=f"bytes written per turn (KV {a.kv_bits}-bit)")
    for c in ("turn", "outcome", "new tok", "cached tok", "new tokens' KV", "save wrote", "process wrote",
              "whole cache", "save / new KV", "process / new KV"):  # fmt: skip
        table.add_column(c, justify="right")
    for r in rows:
        if r["turn"] not in (1, 2, 3, 10, 25, len(rows)) and r["turn"] % 10:
            continue
        table.add_row(
            str(r["turn"]), r["outcome"], str(r["new_tokens"]), str(r["cached_tokens"]),
            f"{r['new_tokens_kv_bytes'] / 1e6:.2f} MB", f"{r['bytes_written'] / 1e6:.2f} MB",
            f"{r['process_bytes_written'] / 1e6:.2f} MB", f"{r['whole_cache_bytes'] / 1e6:.2f} MB",
            f"{r['bytes_written'] / r['new_tokens_kv_bytes']:.2f}",
            f"{r['process_bytes_written'] / r['new_tokens_kv_bytes']:.2f}",
        )  # fmt: skip
    console.print(table)
    later = rows[1:]
    new_kv = sum(r["new_tokens_kv_bytes"] for r in later)
    summary = {
        "turns": len(rows),
        "answer_tokens": a.answer_tokens,
        # after the first turn (whose system prompt is new tokens too)
        "save_over_new_kv": sum(r["bytes_written"] for r in later) / new_kv,
        "process_over_new_kv": sum(r["process_bytes_written"] for r in later) / new_kv,
        "mean_written_over_whole_after_turn_1": sum(
            r["bytes_written"] / r["whole_cache_bytes"] for r in later
        )
        / len(later),
        "total_written": sum(r["bytes_written"] for r in rows),
        "total_process_written": sum(r["process_bytes_written"] for r in rows),
        "total_if_rewritten_whole": sum(r["whole_cache_bytes"] for r in rows),
        "rewritten_over_new_kv": sum(r["rewritten_kv_bytes"] for r in later) / new_kv,
        "max_segment_parts": max(r["segment_parts"] for r in rows),
        "max_last_block_files": max(r["last_block_files"] for r in rows),
        "restores": restores,
    }
    console.print(summary)
    restored = Table(title="a fresh engine's warm restore (median of 3)")
    for c in ("turns", "cached tok", "blocks", "segment parts", "written by turns", "written whole", "ratio"):
        restored.add_column(c, justify="right")
    for x in restores:
        restored.add_row(
            str(x["turns"]), str(x["cached_tokens"]), str(x["chain_blocks"]), str(x["segment_parts"]),
            f"{x['restore_turns_s']:.3f} s", f"{x['restore_whole_s']:.3f} s", f"{x['restore_ratio']:.2f}x",
        )  # fmt: skip
    console.print(restored)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{a.out}.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["turn"] for r in rows]
    ax.bar([x - 0.2 for x in xs], [r["bytes_written"] / 1e6 for r in rows], 0.4, label="written (ours)")
    ax.bar([x + 0.2 for x in xs], [r["whole_cache_bytes"] / 1e6 for r in rows], 0.4, label="whole cache")
    ax.set_xlabel("turn")
    ax.set_ylabel("MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{a.out}.png", dpi=120)
    console.print(f"wrote {out / a.out}.json and .png")


def _files(eng: Any, h: str) -> int:
    """The files block ``h`` is read from: itself and those its segments continue."""
    files = 1
    while (h := eng.admin.store.blocks.prior_of(h)) is not None:
        files += 1
    return files


def _written() -> int:
    """``write_bytes`` of ``/proc/self/io``: what this process sent to storage (0 elsewhere)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _block_tensor_bytes(eng: object, h: object) -> int:
    """A stored block's tensor bytes (its file less the header)."""
    from safetensors import safe_open

    path = eng.admin.store.blocks.path(h)  # type: ignore[attr-defined]
    with safe_open(str(path), "numpy") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 - a safetensors handle


if __name__ == "__main__":
    main()
