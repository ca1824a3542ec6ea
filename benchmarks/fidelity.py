"""KV-cache fidelity: what each stored KV format does to the model, on both shipped models.

    .venv/bin/python benchmarks/fidelity.py                     # every preset (> 20 min per model)
    .venv/bin/python benchmarks/fidelity.py --formats fp16 q4 q4-rot --models gemma3-270m

Text: the Python reference manual's topics from CPython's own ``pydoc_data`` (held-out
technical English that ships with every Python; the first tokens are used). For each KV
format (``KV_PRESETS``):

- Perplexity, 512-token windows with stride 256: the first 256 tokens of a window are the
  context (prefilled, then *stored* in the format), the next 256 are scored 32 at a time
  with a commit after each chunk — every scored token attends to stored keys for all but
  the < 32 tokens before it in its chunk, as in a conversation. Also one long window per
  context length (2K, 4K, 8K): that context stored, the 256 tokens after it scored alike.
- Per-layer relative L2 error of K and V after a round trip through the format.
- Greedy agreement with 16-bit KV: a two-turn exchange per prompt; turn 1 runs wholly at
  full precision (identical for every format), turn 2 decodes 48 tokens over turn 1's
  stored cache. Agreement = leading tokens equal to the 16-bit run's.
- Bytes per token of the stored cache (the agreement runs' ~800-token caches, and one
  full 256-token block: what long caches are made of), and the ratio to 16-bit.
- Prefill tok/s of 512 new tokens and decode tok/s of 16 steps over a stored 2K context
  (both attend over a full-precision copy of the stored keys, unpacked once per request
  for BLAS: the decode figure includes that unpack, at its first step).

Writes benchmarks/results/fidelity.json and fidelity.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONTEXTS = (2048, 4096, 8192)
QUESTIONS = [
    ("for", "What does the else clause of a for loop do?"),
    ("try", "When does the finally clause run?"),
    ("with", "What does a with statement call on its context manager?"),
    ("assert", "What happens when an assert fails?"),
    ("import", "How does an import statement find a module?"),
    ("class", "What does a class definition execute?"),
    ("lambda", "What can a lambda expression contain?"),
    ("while", "How do I leave a while loop early?"),
    ("function", "When are default parameter values evaluated?"),
    ("return", "What does return do inside a generator?"),
    ("global", "What does the global statement declare?"),
    ("yield", "What does a yield expression return?"),
    ("raise", "What does raise from do?"),
    ("del", "What does deleting a name do?"),
    ("slicings", "What does a slicing select?"),
    ("dict", "What does a dictionary display create?"),
]


def text_ids(tok: Any, n: int) -> list[int]:
    from langchain_agent_memory import corpus

    return tok.encode(corpus.python_docs())[:n]


def long_perplexity(
    lm: Any, spec: Any, formats: dict[str, Any], ids: list[int], context: int, stored: bool = False
) -> dict:
    from langchain_agent_memory.engine.kv import KVQuant, make_layer_caches
    from langchain_agent_memory.testing.quality import (
        _fill_pending,
        clone_with_format,
        stored_context_nll,
    )

    base = make_layer_caches(spec, KVQuant.uniform(None))
    _fill_pending(lm.model, base, ids[:context])
    out = {}
    for name, fmt in formats.items():
        n, c = stored_context_nll(
            lm.model, clone_with_format(base, fmt, stored), ids[context - 1 : context + 256]
        )
        out[name] = math.exp(n / c)
    return out


def layer_errors(lm: Any, spec: Any, formats: dict[str, Any], ids: list[int]) -> dict:
    from langchain_agent_memory.engine.kv import KVQuant, make_layer_caches
    from langchain_agent_memory.testing.quality import _fill_pending, kv_roundtrip_errors

    base = make_layer_caches(spec, KVQuant.uniform(None))
    _fill_pending(lm.model, base, ids[:512])
    return {name: kv_roundtrip_errors(base, fmt) for name, fmt in formats.items()}


def two_turns(tok: Any) -> list[tuple[Any, Any]]:
    """Per prompt: turn 1 and a function of turn 1's reply giving turn 2 (a chat for an
    instruct model, plain text continuation for a base model)."""
    from langchain_agent_memory import corpus

    pairs = []
    for topic, question in QUESTIONS:
        doc = corpus.python_docs_topic(topic)[:2500]
        if tok.chat_template:
            msgs = [
                {"role": "system", "content": "Answer from this text:\n\n" + doc},
                {"role": "user", "content": "Summarise the text in one sentence."},
            ]

            def second(reply: str, msgs: list = msgs, question: str = question) -> str:
                more = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
                return tok.apply_chat_template(more, add_generation_prompt=True, tokenize=False)

            pairs.append((tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), second))
        else:
            pairs.append((doc[:1500], lambda reply, doc=doc: doc[:1500] + reply + doc[1500:2000]))
    return pairs


def greedy_agreement(
    model_name: str, formats: dict[str, Any], progress: Any, attention: str | None = None
) -> dict:
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    turn1 = GenerationParams(max_tokens=16)
    turn2 = GenerationParams(max_tokens=48)
    outputs: dict[str, list[list[int]]] = {}
    bytes_per_token: dict[str, float] = {}
    for name, fmt in formats.items():
        with tempfile.TemporaryDirectory() as tmp:
            eng = Engine(model_name, cache_dir=tmp, kv_format=fmt, attention=attention)
            outs = []
            for i, (p1, second) in enumerate(two_turns(eng.tokenizer)):
                r1 = eng.generate(f"a{i}", p1, turn1)  # wholly at full precision
                r2 = eng.generate(f"a{i}", second(r1.text), turn2)  # over turn 1, stored
                assert r2.outcome.source.value == "hot" and r2.reused_tokens > 0, r2.outcome
                outs.append(eng.tokenizer.encode(r2.text, add_special_tokens=False))
            eng.flush()  # saves run on a thread of their own: the files are complete after it
            files = list(Path(tmp).rglob("blocks/*/*.safetensors"))
            n_tokens = sum(eng.admin.cached_tokens(f"a{i}") for i in range(len(QUESTIONS)))
            bytes_per_token[name] = sum(f.stat().st_size for f in files) / max(n_tokens, 1)
            outputs[name] = outs
            eng.close()
        progress()
    agreement = {}
    for name, outs in outputs.items():
        lengths = []
        for a, b in zip(outs, outputs["fp16"], strict=True):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            lengths.append(48 if a == b else n)  # identical (maybe ended early): full agreement
        agreement[name] = lengths
    return {"agreement": agreement, "bytes_per_token": bytes_per_token}


def block_bytes(model_name: str, formats: dict[str, Any], ids: list[int]) -> dict[str, list[float]]:
    """Per format, bytes per token of the first three block files of a 700-token cache:
    block 0 (which holds the head tokens), block 1 (a full block: what long caches are made
    of) and the partial tail block."""
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    out = {}
    for name, fmt in formats.items():
        with tempfile.TemporaryDirectory() as tmp:
            eng = Engine(model_name, cache_dir=tmp, kv_format=fmt)
            eng.generate("a", eng.tokenizer.decode(ids[:700]), GenerationParams(max_tokens=1))
            eng.flush()  # the record is published once its blocks are written (a save thread)
            record = eng.admin.store.records.get("a")
            assert record is not None
            sizes = [next(Path(tmp).rglob(f"{h}.safetensors")).stat().st_size for h in record.blocks]
            out[name] = [size / (min(256, len(record.token_ids) - 256 * i)) for i, size in enumerate(sizes)]
            eng.close()
    return out


def speeds(lm: Any, spec: Any, formats: dict[str, Any], ids: list[int], stored: bool = False) -> dict:
    """Per format: prefill tok/s of 512 new tokens and decode tok/s of 16 steps, both over
    a stored 2K context (best of 2)."""
    from langchain_agent_memory.engine.kv import KVQuant, make_layer_caches
    from langchain_agent_memory.engine.model.forward import decode_step, prefill
    from langchain_agent_memory.engine.ops.runtime import mx
    from langchain_agent_memory.testing.quality import _fill_pending, clone_with_format

    base = make_layer_caches(spec, KVQuant.uniform(None))
    _fill_pending(lm.model, base, ids[:2048])
    out: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    for name, fmt in formats.items():
        best_p = best_d = float("inf")
        for _ in range(2):
            caches = clone_with_format(base, fmt, stored)
            for c in caches:
                c.commit()
            mx.eval([c.state for c in caches])
            t0 = time.perf_counter()
            mx.eval(prefill(lm.model, ids[2048:2560], caches))
            best_p = min(best_p, time.perf_counter() - t0)
            for c in caches:
                c.commit()  # decode attends to 2,560 stored tokens
            mx.eval([c.state for c in caches])
            t0 = time.perf_counter()
            for t in ids[2560:2576]:
                mx.eval(decode_step(lm.model, t, caches))
            best_d = min(best_d, time.perf_counter() - t0)
        out["prefill"][name] = 512 / best_p
        out["decode"][name] = 16 / best_d
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--formats", nargs="+", default=None, help="KV_PRESETS names (fp16 always included)")
    ap.add_argument("--windows", type=int, default=12, help="512-token windows for the perplexity")
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS), help="long-context lengths")
    ap.add_argument(
        "--attention",
        choices=["copy", "stored"],
        default="copy",
        help="what a request attends over (stored: its stored form; writes fidelity_stored.json)",
    )
    ap.add_argument("--name", default=None, help="results/NAME.json (default fidelity / fidelity_stored)")
    ap.add_argument(
        "--speeds-only",
        action="store_true",
        help="re-measure only the speeds and block bytes (quiet machine), updating fidelity.json",
    )
    a = ap.parse_args()
    stored = a.attention == "stored"
    stem = a.name or ("fidelity_stored" if stored else "fidelity")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from langchain_agent_memory import load_model
    from langchain_agent_memory.engine.kv import KV_PRESETS
    from langchain_agent_memory.testing.quality import stored_perplexity

    names = ["fp16", *[n for n in (a.formats or KV_PRESETS) if n != "fp16"]]
    formats = {n: KV_PRESETS[n] for n in names}
    console = Console(width=max(Console().width, 180))  # the table is wide; keep it whole in logs
    results: dict[str, Any] = {}
    with Progress(console=console) as progress:
        task = progress.add_task("fidelity", total=len(a.models) * (4 + len(a.contexts) + len(formats)))

        def step(what: str = "") -> None:
            progress.advance(task)
            if what:
                progress.update(task, description=what)

        out = HERE / "results"
        if a.speeds_only:
            results = json.loads((out / f"{stem}.json").read_text())
        for model_name in a.models:
            lm = load_model(model_name)
            spec = lm.structure.spec
            ids = text_ids(lm.tokenizer, max(*a.contexts, 2048) + 528)  # speeds reads 2,576
            if a.speeds_only:
                r = results[model_name]
                speed = speeds(lm, spec, formats, ids, stored)
                r["prefill_tok_s"], r["decode_tok_s"] = speed["prefill"], speed["decode"]
                r["block_bytes_per_token"] = block_bytes(model_name, formats, ids)
                continue
            r: dict[str, Any] = {"fp16_bytes_per_token": spec.fp16_bytes_per_token()}
            progress.update(task, description=f"{model_name}: perplexity (512 windows)")
            r["ppl_512"] = stored_perplexity(lm.model, spec, formats, ids, a.windows, stored)
            step(f"{model_name}: long contexts")
            r["ppl_long"] = {}
            for ctx in a.contexts:
                r["ppl_long"][str(ctx)] = long_perplexity(lm, spec, formats, ids, ctx, stored)
                step()
            progress.update(task, description=f"{model_name}: per-layer K/V error")
            r["layer_errors"] = layer_errors(lm, spec, formats, ids)
            step(f"{model_name}: prefill speed")
            speed = speeds(lm, spec, formats, ids, stored)
            r["prefill_tok_s"], r["decode_tok_s"] = speed["prefill"], speed["decode"]
            r["block_bytes_per_token"] = block_bytes(model_name, formats, ids)
            step(f"{model_name}: greedy agreement")
            r.update(greedy_agreement(model_name, formats, step, a.attention))
            step()
            r["measured_on"] = {name: time.strftime("%Y-%m-%d") for name in formats}
            results[model_name] = r

    for model_name, r in results.items():
        table = Table(title=f"{model_name}: KV formats vs 16-bit KV")
        contexts = [int(c) for c in r["ppl_long"]]
        cols = ["format", "ppl 512", "Δ%", *[f"ppl {c // 1024}K" for c in contexts], "K err", "V err"]
        cols += ["greedy ≥32", "agree median", "bytes/tok", "×FP16", "full block ×FP16"]
        cols += ["prefill tok/s", "decode tok/s"]
        for c in cols:
            table.add_column(c, justify="right")
        base = r["ppl_512"]["fp16"]
        for name in formats:
            errs = r["layer_errors"][name]
            agree = r["agreement"][name]
            bpt = r["bytes_per_token"][name]
            table.add_row(
                name,
                f"{r['ppl_512'][name]:.3f}",
                f"{100 * (r['ppl_512'][name] / base - 1):+.2f}",
                *[f"{r['ppl_long'][str(c)][name]:.3f}" for c in contexts],
                f"{statistics.mean(e[0] for e in errs):.3f}",
                f"{statistics.mean(e[1] for e in errs):.3f}",
                f"{sum(x >= 32 for x in agree)}/{len(agree)}",
                f"{statistics.median(agree):.0f}",
                f"{bpt:.0f}",
                f"{bpt / r['bytes_per_token']['fp16']:.3f}",
                f"{r['block_bytes_per_token'][name][1] / r['block_bytes_per_token']['fp16'][1]:.3f}",
                f"{r['prefill_tok_s'][name]:.0f}",
                f"{r['decode_tok_s'][name]:.1f}",
            )
        console.print(table)

    out.mkdir(exist_ok=True)
    path = out / f"{stem}.json"
    if path.exists() and not a.speeds_only:  # a run of some formats / models keeps the others'
        results = _merged(json.loads(path.read_text()), results)
    path.write_text(json.dumps(results, indent=2))
    every = sorted({n for r in results.values() for n in r["ppl_512"]}, key=lambda n: (n != "fp16", n))
    plot(results, every, out / f"{stem}.png")
    console.print(f"wrote {path} and {stem}.png")


def _merged(old: dict, new: dict) -> dict:
    """``new`` over ``old``, key by key down to the per-format values."""
    out = dict(old)
    for k, v in new.items():
        out[k] = _merged(old[k], v) if isinstance(v, dict) and isinstance(old.get(k), dict) else v
    return out


def plot(results: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 8.5), squeeze=False)
    for col, (model_name, r) in enumerate(results.items()):
        base = r["ppl_512"]["fp16"]
        top, bottom = axes[0][col], axes[1][col]
        for name in names:
            ratio = r["bytes_per_token"][name] / r["bytes_per_token"]["fp16"]
            delta = 100 * (r["ppl_512"][name] / base - 1)
            agree = r["agreement"][name]
            share = 100 * sum(x >= 32 for x in agree) / len(agree)
            for ax, y in ((top, delta), (bottom, share)):
                ax.scatter(ratio, y, s=40)
                ax.annotate(name, (ratio, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
        top.axhline(3.0, color="C3", ls="--", lw=1, label="+3 % target")
        top.set_ylabel("perplexity change vs 16-bit KV (%)")
        top.set_title(model_name)
        bottom.axhline(50, color="C3", ls="--", lw=1, label="most prompts")
        bottom.set_ylabel("prompts with >= 32 tokens equal to 16-bit KV (%)")
        for ax in (top, bottom):
            ax.axvline(0.35, color="C7", ls=":", lw=1, label="0.35x bytes")
            ax.set_xlabel("stored bytes / 16-bit bytes")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
