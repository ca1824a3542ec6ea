"""The engine's oracles for every supported family (random weights) on whatever device mlx
picks: reload == uninterrupted at 16-bit KV, DIVERGE == cold, batched == alone, 4-bit
reload == hot. Written for the lent GPU machine, where the test suite's shipped-model
fixtures are not available (issue 18 turns this into a ``pytest -m gpu`` selection).

    python scripts/device_oracles.py TOKENIZER_DIR [bfloat16|float32]

TOKENIZER_DIR: a folder with SmolLM2's tokenizer.json / tokenizer_config.json. Prints one
JSON line per family. Measured on the H200 (mlx 0.32.4, CUDA), 2026-12-01: bfloat16: 9/9
reload, 9/9 DIVERGE == cold, 9/9 4-bit reload, batched == alone 6/9 (a bf16 batched
matmul rounds differently from one row's); float32: batched == alone 9/9.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.adapters import is_adapted
from langchain_agent_memory.engine.model.random_model import SMALL_CONFIGS, write_random_model
from langchain_agent_memory.engine.runtime import mx

GREEDY = GenerationParams(max_tokens=8)
SYSTEM = corpus.python_docs()[:1500]  # from the standard library: present on any machine
PROMPTS = {
    "a": SYSTEM[:1100] + "\n\nQ: Its name?\nA:",
    "b": "You teach Python.\n\nQ: while?\nA:",
    "c": "Write a poem.\n",
}


def together(engine: Engine) -> dict[str, str]:
    results: dict[str, str] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def run(agent: str) -> None:
        barrier.wait()
        results[agent] = engine.generate(agent, PROMPTS[agent], GREEDY).text

    threads = [threading.Thread(target=run, args=(a,)) for a in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def two_turns(model: Path, root: Path, kv_bits: int | None) -> tuple[bool, str]:
    """Turn 2 hot on one engine vs warm on a new engine after turn 1: the same text?"""
    hot = Engine(model, cache_dir=root / "hot", kv_bits=kv_bits)
    r1 = hot.generate("x", SYSTEM, GREEDY)
    p2 = SYSTEM + r1.text + "\n\nQ: and the second part?\nA:"
    r2 = hot.generate("x", p2, GREEDY)
    Engine(model, cache_dir=root / "warm", kv_bits=kv_bits).generate("x", SYSTEM, GREEDY)
    warm = Engine(model, cache_dir=root / "warm", kv_bits=kv_bits).generate("x", p2, GREEDY)
    return warm.text == r2.text, str(warm.outcome)


def family(name: str, tokenizer_dir: Path, dtype: str, root: Path) -> dict[str, Any]:
    model = write_random_model(SMALL_CONFIGS[name], root / "model", tokenizer_dir, seed=7, dtype=dtype)
    engine = Engine(model, cache_dir=root / "a", kv_bits=None)
    row: dict[str, Any] = {"adapted": is_adapted(engine.lm.model), "dtype": engine.spec.dtype}
    row["reload_equal"] = two_turns(model, root / "fp16", None)
    engine.generate("x", SYSTEM, GREEDY)
    p3 = SYSTEM[:900] + " -- a different question entirely: what is a patent?"
    diverge = engine.generate("x", p3, GREEDY)
    cold = Engine(model, cache_dir=root / "cold", kv_bits=None).generate("y", p3, GREEDY)
    row["diverge_equal_cold"] = (diverge.text == cold.text, str(diverge.outcome))
    alone = Engine(model, cache_dir=root / "alone", kv_bits=None)
    expected = {a: alone.generate(a, p, GREEDY).text for a, p in PROMPTS.items()}
    batched = Engine(model, cache_dir=root / "batched", kv_bits=None)
    row["batched_equal"] = (together(batched) == expected, batched.stats()["max_decode_batch"])
    row["q4_reload_equal"] = two_turns(model, root / "q4", 4)
    return row


def main() -> None:
    tokenizer_dir = Path(sys.argv[1])
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    print("device", mx.default_device(), "mlx", mx.__version__, flush=True)
    for name in sorted(SMALL_CONFIGS):
        t0 = time.perf_counter()
        try:
            row = family(name, tokenizer_dir, dtype, Path(tempfile.mkdtemp()))
        except Exception:
            row = {"error": traceback.format_exc()[-1500:]}
        row["s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
