"""Bytes written per conversation turn: only the new blocks (and the rewritten partial
tail block) vs rewriting the agent's whole cache each turn (what the reference system did).

    .venv/bin/python benchmarks/turn_writes.py [--turns 8] [--kv-bits 4]

One agent on the default model, a ~1.2K-token system prompt (Python reference manual),
short questions, 32-token answers. Writes benchmarks/results/turn_writes.json and .png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--kv-bits", type=int, default=4)
    a = ap.parse_args()

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from langchain_agent_memory import corpus
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        eng = Engine(cache_dir=tmp, kv_bits=a.kv_bits)
        system = "Answer briefly using this text.\n\n" + corpus.python_docs_topic("for") * 2
        messages = [{"role": "system", "content": system}]
        for turn in track(range(a.turns), description="turns", console=console):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            prompt = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            r = eng.generate("agent", prompt, GenerationParams(max_tokens=32))
            messages.append({"role": "assistant", "content": r.text})
            files = list(Path(tmp).rglob("blocks/*/*.safetensors"))
            record = eng.admin.store.get_agent("agent")
            assert record is not None
            whole = sum(eng.admin.store.block_path(h).stat().st_size for h in record.blocks)
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": r.prompt_tokens,
                    "reused_tokens": r.reused_tokens,
                    "cached_tokens": len(record.token_ids),
                    "bytes_written": r.bytes_written,
                    "whole_cache_bytes": whole,
                    "block_files": len(files),
                    "outcome": str(r.outcome),
                }
            )
    table = Table(title=f"bytes written per turn (KV {a.kv_bits}-bit)")
    for c in (
        "turn",
        "outcome",
        "prompt tok",
        "reused",
        "cached tok",
        "written",
        "whole cache",
        "written/whole",
    ):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            str(r["turn"]), r["outcome"], str(r["prompt_tokens"]), str(r["reused_tokens"]),
            str(r["cached_tokens"]), f"{r['bytes_written'] / 1e6:.2f} MB",
            f"{r['whole_cache_bytes'] / 1e6:.2f} MB", f"{r['bytes_written'] / r['whole_cache_bytes']:.2f}",
        )  # fmt: skip
    console.print(table)
    later = rows[1:]
    summary = {
        "mean_written_over_whole_after_turn_1": sum(
            r["bytes_written"] / r["whole_cache_bytes"] for r in later
        )
        / len(later),
        "total_written": sum(r["bytes_written"] for r in rows),
        "total_if_rewritten_whole": sum(r["whole_cache_bytes"] for r in rows),
    }
    console.print(summary)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "turn_writes.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))

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
    fig.savefig(out / "turn_writes.png", dpi=120)
    console.print(f"wrote {out / 'turn_writes.json'} and turn_writes.png")


if __name__ == "__main__":
    main()
