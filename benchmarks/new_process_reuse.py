"""A harness's next session in a new process: what it reads of the session a process before
it stored (the same instructions, which end inside a block, then each session's own text).

    .venv/bin/python benchmarks/new_process_reuse.py [--instructions-chars 9000] [--repeats 3]

Each step runs in a process of its own (``--step``), on the shipped SmolLM2-135M at 16-bit KV:

1. ``store``: session 1's first turn (agent ``s1``) in an empty cache directory, saved;
2. ``next``: a new process, session 2's first turn (agent ``s2``): its prompt shares the
   instructions with session 1's; reported: tokens read from the store, tokens prefilled,
   time to first token (the engine's ``load_s + prefill_s`` and the wall), and its text;
3. ``cold``: session 2's prompt in an empty directory (the text it must equal).

Run it with ``PYTHONPATH`` at two source trees to compare them (the script uses the
engine's public API only). Writes results/new_process_reuse.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _prompt(tokenizer: object, instructions: str, question: str) -> str:
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]


def step(name: str, cache_dir: str, chars: int) -> dict[str, object]:
    """One step in this process (see the module's docstring)."""
    from langchain_agent_memory import corpus
    from langchain_agent_memory.engine import Engine, GenerationParams

    instructions = "Use this text.\n\n" + corpus.python_docs()[:chars]
    question = "What is a for loop?" if name == "store" else "What does assert do?"
    with Engine("smollm2-135m", cache_dir=cache_dir, kv_bits=None) as engine:
        prompt = _prompt(engine.tokenizer, instructions, question)
        t0 = time.perf_counter()
        result = engine.generate("s1" if name == "store" else "s2", prompt, GenerationParams(max_tokens=16))
        wall = time.perf_counter() - t0
    t = result.timings
    return {
        "step": name,
        "outcome": str(result.outcome),
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "prefilled_tokens": result.prompt_tokens - result.reused_tokens,
        "ttft_s": t.load_s + t.prefill_s,
        "wall_s": wall,
        "text": result.text,
    }


def _run(name: str, cache_dir: Path, chars: int) -> dict[str, object]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--step",
            name,
            "--cache-dir",
            str(cache_dir),
            "--instructions-chars",
            str(chars),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instructions-chars", type=int, default=9000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step", choices=("store", "next", "cold"))
    parser.add_argument("--cache-dir")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "new_process_reuse.json")
    args = parser.parse_args()
    if args.step is not None:
        print(json.dumps(step(args.step, args.cache_dir, args.instructions_chars)))
        return
    rows = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            _run("store", Path(tmp) / "kv", args.instructions_chars)
            nxt = _run("next", Path(tmp) / "kv", args.instructions_chars)
            cold = _run("cold", Path(tmp) / "cold", args.instructions_chars)
        nxt["same_text_as_cold"] = nxt["text"] == cold["text"]
        nxt["cold_ttft_s"] = cold["ttft_s"]
        rows.append(nxt)
        print(json.dumps({k: v for k, v in nxt.items() if k != "text"}))
    summary = {
        "instructions_chars": args.instructions_chars,
        "prompt_tokens": rows[0]["prompt_tokens"],
        "reused_tokens": rows[0]["reused_tokens"],
        "prefilled_tokens": rows[0]["prefilled_tokens"],
        "outcome": rows[0]["outcome"],
        "ttft_s_median": statistics.median(float(r["ttft_s"]) for r in rows),
        "cold_ttft_s_median": statistics.median(float(r["cold_ttft_s"]) for r in rows),
        "same_text_as_cold": all(r["same_text_as_cold"] for r in rows),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
