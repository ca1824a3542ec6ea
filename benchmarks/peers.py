"""The systems the benchmarks put side by side, each driven the way its own users save and
restore a prompt's KV state.

The scenario is an agent's next turn: a context ``P`` of N tokens was read before, and the
agent comes back with a short new turn ``E`` (~15 tokens). Each system answers:

- cold: time to first token of ``P`` from nothing (it builds the state of ``P``; the new
  turn's few extra tokens would add well under 1 % at N >= 1K);
- hot: ``P``'s state in memory, ``P + E`` asked: time to first token (median of 3, each
  with a different ``E``);
- warm: a new process restores ``P``'s saved state from disk and asks ``P + E`` (the clock
  starts after the model is loaded: it covers reading the state and prefilling ``E``);

plus the bytes of the saved state on disk, in memory, and the resident memory one
restored agent adds to a fresh process.

- ``ours``: ``Engine`` (``kv_bits=4``: the default 4-bit format; ``None``: 16-bit).
- ``mlx-lm``: the same converted model through mlx-lm's API: ``generate_step`` to prefill,
  ``save_prompt_cache`` / ``load_prompt_cache`` (safetensors) to store, ``kv_bits=4`` for its
  ``QuantizedKVCache`` (group 64; it cannot quantize Gemma 3's rotating layers), else its
  full-precision cache (the model's dtype: float32 here, as fast CPU matmuls need, so
  ``mlx-lm-full`` stores twice the bytes of a 16-bit cache).
- ``llama.cpp``: llama-cpp-python on the same GGUF (``benchmarks/setup_peers.sh`` builds it
  with this CPU's SIMD), ``type_k``/``type_v`` ``q4_0`` or ``f16`` (flash attention on, as a
  quantized V cache needs), llama.cpp's own ``llama_state_save_file`` /
  ``llama_state_load_file`` (the KV of the used cells and the tokens; llama-cpp-python's
  pickled ``LlamaState`` would add its whole logits buffer, 100-540 MB here).

Token-level systems (mlx-lm, llama.cpp) get ``tokens(P) + tokens(E)``; ours gets the text.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def extension(i: int) -> str:
    """The new turn of hot/warm run ``i``: same length, different words from the 12th char."""
    return f"\n\nQuestion {i + 1}: what does the passage above explain? Answer:"


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, model: str, kv_bits: int | None, state_dir: Path, context: int) -> None:
        from langchain_agent_memory.engine.engine import Engine

        self.state_dir = state_dir
        self.engine = Engine(model, cache_dir=state_dir, kv_bits=kv_bits, context_length=context)

    def _first(self, text: str, expect: str) -> Result:
        from langchain_agent_memory.engine.engine import GenerationParams

        r = self.engine.generate("bench", text, GenerationParams(max_tokens=1))
        assert r.outcome.source.value == expect, r.outcome
        return {"ttft_s": r.timings.ttft_s, "tokens": r.prompt_tokens, "outcome": str(r.outcome)}

    def cold(self, prompt: str) -> Result:
        out = self._first(prompt, "cold")
        files = list(self.state_dir.rglob("blocks/*/*.safetensors"))
        out["disk_bytes"] = sum(f.stat().st_size for f in files)
        out["memory_bytes"] = self.engine.pool.snapshot_stats().hot_bytes
        return out

    def hot(self, prompt: str, i: int) -> Result:
        return self._first(prompt + extension(i), "hot")

    def close(self) -> None:
        self.engine.close()  # its memory back before the next system runs

    @staticmethod
    def warm(model: str, kv_bits: int | None, state_dir: Path, context: int, prompt: str, i: int) -> Result:
        t0 = time.perf_counter()
        ours = Ours(model, kv_bits, state_dir, context)
        start = time.perf_counter() - t0
        rss0 = rss_bytes()
        out = ours._first(prompt + extension(i), "warm")
        return out | {"rss_delta_bytes": rss_bytes() - rss0, "start_s": start}


# ---------------------------------------------------------------------------- mlx-lm


def _mlx_feed(
    model: Any, ids: list[int], cache: list[Any], kv_bits: int | None, quantize_from: int = 0
) -> None:
    """Feed ``ids`` into ``cache`` with mlx-lm's ``generate_step``, quantizing once the
    cache holds ``quantize_from`` tokens (0: from the start, as a 4-bit cache runs);
    ``max_tokens=0``: the first sampled token is evaluated, none fed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    for _ in generate_step(
        mx.array(ids), model, prompt_cache=cache, max_tokens=0, kv_bits=kv_bits,
        quantized_kv_start=quantize_from,
    ):  # fmt: skip
        pass


def _arrays(state: Any) -> list[Any]:
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return [state] if hasattr(state, "nbytes") else []


class MlxLm:
    FILE = "mlx_lm_cache.safetensors"

    def __init__(
        self, model_dir: Path, kv_bits: int | None, state_dir: Path, loaded: tuple[Any, Any] | None = None
    ) -> None:
        """``loaded``: (model, tokenizer) already in memory (a GPU holds one copy of 8B weights)."""
        from mlx_lm import load

        self.kv_bits, self.path = kv_bits, state_dir / self.FILE
        self.model, self.tokenizer = loaded if loaded is not None else load(str(model_dir))

    def _ids(self, prompt: str, i: int | None = None) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        if i is not None:
            ids += self.tokenizer.encode(extension(i), add_special_tokens=False)
        return ids

    def cold(self, prompt: str, prefill_16bit: bool = False) -> Result:
        """``prefill_16bit``: build the 4-bit state by a full-precision prefill, quantized
        at its end (the same saved state; a 4-bit prefill is ~7x slower at 8K tokens):
        the cold time is then not that of a 4-bit cache and is left out (None)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

        ids = self._ids(prompt)
        cache = make_prompt_cache(self.model)
        t0 = time.perf_counter()
        _mlx_feed(self.model, ids, cache, self.kv_bits, quantize_from=len(ids) - 1 if prefill_16bit else 0)
        ttft = None if prefill_16bit else time.perf_counter() - t0
        mx.eval([c.state for c in cache])
        save_prompt_cache(str(self.path), cache)
        memory = sum(a.nbytes for c in cache for a in _arrays(c.state))
        disk = self.path.stat().st_size
        return {"ttft_s": ttft, "tokens": len(ids), "disk_bytes": disk, "memory_bytes": memory}

    def _extend(self, prompt: str, i: int, load_first: bool) -> Result:
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        ids, n = self._ids(prompt, i), len(self._ids(prompt))
        rss0, t0 = rss_bytes(), time.perf_counter()
        cache = load_prompt_cache(str(self.path))
        mx.eval([c.state for c in cache])
        if not load_first:  # hot: the state was in memory before the clock started
            rss0, t0 = rss_bytes(), time.perf_counter()
        _mlx_feed(self.model, ids[n:], cache, self.kv_bits)
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "tokens": len(ids), "rss_delta_bytes": rss_bytes() - rss0}

    def hot(self, prompt: str, i: int) -> Result:
        return self._extend(prompt, i, load_first=False)

    @staticmethod
    def warm(model_dir: Path, kv_bits: int | None, state_dir: Path, prompt: str, i: int) -> Result:
        t0 = time.perf_counter()
        peer = MlxLm(model_dir, kv_bits, state_dir)
        start = time.perf_counter() - t0
        return peer._extend(prompt, i, load_first=True) | {"start_s": start}


# ---------------------------------------------------------------------------- llama.cpp

LLAMA_KV = {"q4_0": 2, "f16": 1}  # GGML_TYPE_Q4_0, GGML_TYPE_F16


class LlamaCpp:
    FILE = "llama_state_{kv}.bin"

    def __init__(self, gguf: Path, kv: str, state_dir: Path, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.path = state_dir / self.FILE.format(kv=kv)
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=2,
            n_batch=512,
            type_k=LLAMA_KV[kv],
            type_v=LLAMA_KV[kv],
            flash_attn=True,
            verbose=False,
        )

    def close(self) -> None:
        self.llm.close()

    def _ids(self, prompt: str, i: int | None = None) -> list[int]:
        ids = list(self.llm.tokenize(prompt.encode(), add_bos=True))
        if i is not None:
            ids += list(self.llm.tokenize(extension(i).encode(), add_bos=False))
        return ids

    def _first(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.create_completion(ids, max_tokens=1, temperature=0.0)
        return time.perf_counter() - t0

    def cold(self, prompt: str) -> Result:
        import llama_cpp

        ids = self._ids(prompt)
        ttft = self._first(ids)  # the sampled token is not evaluated: the KV holds P only
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        if not llama_cpp.llama_state_save_file(self.llm.ctx, str(self.path).encode(), tokens, len(ids)):
            raise RuntimeError("llama_state_save_file failed")
        memory = int(llama_cpp.llama_state_get_size(self.llm.ctx))
        disk = self.path.stat().st_size
        return {"ttft_s": ttft, "tokens": len(ids), "disk_bytes": disk, "memory_bytes": memory}

    def hot(self, prompt: str, i: int) -> Result:
        ids = self._ids(prompt, i)  # prefix-matched against what the context holds
        return {"ttft_s": self._first(ids), "tokens": len(ids)}

    def _restore(self) -> None:
        import ctypes

        import llama_cpp

        capacity = self.llm.n_ctx()
        tokens = (llama_cpp.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(
            self.llm.ctx, str(self.path).encode(), tokens, capacity, ctypes.byref(n)
        ):
            raise RuntimeError("llama_state_load_file failed")
        # tell llama-cpp-python what the context now holds, so it prefix-matches against it
        self.llm.input_ids[: n.value] = tokens[: n.value]
        self.llm.n_tokens = n.value
        self.llm._requires_eval = True

    @staticmethod
    def warm(gguf: Path, kv: str, state_dir: Path, n_ctx: int, prompt: str, i: int) -> Result:
        t0 = time.perf_counter()
        peer = LlamaCpp(gguf, kv, state_dir, n_ctx)  # allocates (and clears) its KV buffer
        start = time.perf_counter() - t0
        ids = peer._ids(prompt, i)
        rss0, t0 = rss_bytes(), time.perf_counter()
        peer._restore()
        peer.llm.create_completion(ids, max_tokens=1, temperature=0.0)
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "tokens": len(ids), "rss_delta_bytes": rss_bytes() - rss0, "start_s": start}
